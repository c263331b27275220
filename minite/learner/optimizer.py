"""AdamW on fp32 master weights, with global gradient-norm clipping.

The model may hold bf16 parameters (on the GPU, for speed and memory). The optimizer keeps an fp32
master copy of each such parameter; a step is:

1. master.grad = fp32(param.grad) (fp32 parameters are their own masters: no copy);
2. total norm = ||all master grads||_2 (reported); if it is not finite the step is skipped;
3. clip: grads scaled by max_grad_norm / (norm + 1e-6) when norm > max_grad_norm (torch's
   clip_grad_norm_), applied inside the fused AdamW as its gradient divisor (`grad_scale`);
4. fused `torch.optim.AdamW` on the masters (decoupled weight decay on matrices only: parameters with
   fewer than two dimensions, i.e. norms and biases, get none);
5. param.copy_(master) (rounded to the parameter's dtype). The copy bumps the parameter's version
   counter, which is what invalidates its cached quantized weight.

Steps 2-4 never read the norm on the host: the clip factor and the skip (AdamW's `found_inf`) stay
on the device, so the host queues the update while the GPU still runs the backward. `step_queued`
returns the metrics as device tensors; `step` reads them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class MasterAdamW:
    def __init__(self, params, lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, max_grad_norm: float | None = 1.0):
        self.params: list[nn.Parameter] = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the optimizer got no trainable parameters")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={max_grad_norm} must be > 0 (or None for no clipping)")
        self.max_grad_norm = max_grad_norm
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        decay = [m for m in self.masters if m.dim() >= 2]
        no_decay = [m for m in self.masters if m.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=eps,
                                           fused=True)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    def step(self) -> dict[str, float]:
        """One update (`step_queued`); returns grad_norm (before clipping), the clip coefficient and
        whether the step was skipped (non-finite gradient), read from the device at once."""
        out = self.step_queued()
        return dict(zip(out, torch.stack(list(out.values())).tolist()))

    @torch.no_grad()
    def step_queued(self) -> dict[str, torch.Tensor]:
        """One update from the parameters' accumulated grads, queued without a host sync; returns
        grad_norm, clip_coef (0 when skipped) and skipped as 0-dim fp32 device tensors. The
        per-parameter work runs as multi-tensor ops: a few launches for all parameters."""
        pairs = [(p, m) for p, m in zip(self.params, self.masters) if m is not p]
        if pairs:  # 1. fp32 master grads from the parameters' grads, one multi-tensor copy
            with_grad = [(p, m) for p, m in pairs if p.grad is not None]
            for _, m in pairs:
                m.grad = None
            for _, m in with_grad:
                m.grad = torch.empty_like(m)
            if with_grad:
                torch._foreach_copy_([m.grad for _, m in with_grad], [p.grad for p, _ in with_grad])
        grads = [m.grad for m in self.masters if m.grad is not None]
        device = self.masters[0].device
        if not grads:
            zero = torch.zeros((), device=device)
            return {"grad_norm": zero, "clip_coef": zero + 1, "skipped": zero}
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if isinstance(norm, DTensor):  # sharded parameters (FSDP2): the norm over every rank's shards
            norm = norm.full_tensor()
        finite = torch.isfinite(norm)
        divisor = None  # AdamW divides the grads by it: 1 / clip
        if self.max_grad_norm is not None:
            divisor = torch.clamp((norm + 1e-6) / self.max_grad_norm, min=1.0)
        skipped = (~finite).float()
        self.optimizer.grad_scale, self.optimizer.found_inf = divisor, skipped
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale, self.optimizer.found_inf
        if pairs:  # 5. the parameters from their masters (bumps their version counters)
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        clip = torch.ones((), device=device) if divisor is None else divisor.reciprocal()
        return {"grad_norm": norm, "clip_coef": torch.where(finite, clip, 0.0),
                "skipped": skipped}

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.optimizer.param_groups:
            g["lr"] = value

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore moments and masters (and write the masters back into the parameters)."""
        if len(state["masters"]) != len(self.masters):
            raise ValueError(f"state has {len(state['masters'])} masters, the optimizer {len(self.masters)}")
        for p, m, saved in zip(self.params, self.masters, state["masters"]):
            m.copy_(saved)
            if m is not p:
                p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
