"""The MoE router's top-k routing as an autograd op: (weights, ids) from the router logits
(`minite.ref.router`, HF Qwen3-MoE's softmax / top-k / renormalize).

Where the execution runs the element-wise kernels (on CUDA by default) the forward is one launch
(`minite.kernels.router`), for learner and sampler alike, so both get its bits; equal logits go to the
lower expert. Elsewhere torch's softmax, top-k and renormalization (HF's ops; torch orders equal
probabilities its own way). The backward is autograd's of the torch form at the chosen experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy


def _torch_weights(logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The weights of experts `ids` by torch's ops: softmax in fp32, picked, renormalized, cast."""
    w = F.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, normalize):
        weights, ids = lazy.router.route(logits, k, normalize)
        ctx.save_for_backward(logits, ids)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, g, _):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            (d,) = torch.autograd.grad(_torch_weights(x, ids, ctx.normalize), x, g)
        return d, None, None


def route(logits: torch.Tensor, k: int, normalize: bool,
          execution: Execution = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits.dtype, ids [T, k] int64, largest first)."""
    if execution.elementwise_kernels(logits):
        return _Route.apply(logits.contiguous(), k, normalize)
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids
