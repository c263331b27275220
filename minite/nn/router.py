"""The MoE router's top-k routing as an autograd op: (weights, ids) from the router logits
(`minite.ref.router`, HF Qwen3-MoE's softmax / top-k / renormalize).

Where the execution runs the element-wise kernels (on CUDA by default) the forward is one launch
(`minite.kernels.router`), for learner and sampler alike, so both get its bits; equal logits go to the
lower expert. Elsewhere torch's softmax, top-k and renormalization (HF's ops; torch orders equal
probabilities its own way). The backward is autograd's of the torch form at the chosen experts.

`Gate` is the router's linear (a bf16 `Linear`, never quantized) whose call routes: `gate_route`
takes the linear into that launch (`minite.kernels.router.gate_route`): logits
summed in a fixed order over the hidden size (`minite.ref.router.gate_logits`), so a token's logits,
and with them its experts, never depend on the batch in either engine; its backward is the linear's
(dx = dl W, dW = dl^T x) with dl the logits' gradient plus the weights'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn.linear import Linear


def _torch_weights(logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The weights of experts `ids` by torch's ops: softmax in fp32, picked, renormalized, cast."""
    w = F.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, normalize, chunk):
        weights, ids, *counts = lazy.router.route(logits, k, normalize, chunk)
        ctx.save_for_backward(logits, ids)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(ids, *counts)
        return weights, ids, *counts

    @staticmethod
    def backward(ctx, g, *_):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            (d,) = torch.autograd.grad(_torch_weights(x, ids, ctx.normalize), x, g)
        return d, None, None, None


class _GateRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, k, normalize, chunk):
        logits, weights, ids, *counts = lazy.router.gate_route(x, weight, k, normalize, chunk)
        ctx.save_for_backward(x, weight, logits, ids)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(ids, *counts)
        return logits, weights, ids, *counts

    @staticmethod
    def backward(ctx, g_logits, g_weights, *_):
        x, weight, logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            lg = logits.detach().requires_grad_()
            (d,) = torch.autograd.grad(_torch_weights(lg, ids, ctx.normalize), lg, g_weights)
        if g_logits is not None:
            d = d + g_logits
        dx = d @ weight if ctx.needs_input_grad[0] else None
        dw = d.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def fused_gate(x: torch.Tensor, weight: torch.Tensor, execution: Execution = DEFAULT) -> bool:
    """Whether `gate_route` computes the gate in the routing kernel here (else `F.linear`, then
    `route`): where the element-wise kernels run, for a weight in x's dtype."""
    return execution.elementwise_kernels(x) and weight.dtype == x.dtype and weight.device == x.device


def gate_route(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool,
               execution: Execution = DEFAULT, chunk_counts: bool = False):
    """x [T, H], the gate's weight [E, H] -> (logits [T, E], weights [T, k], ids [T, k]) and, with
    `chunk_counts`, the per-chunk expert counts (or None): `route` of the gate's logits, in one launch
    where `fused_gate` holds."""
    if not fused_gate(x, weight, execution):
        logits = F.linear(x, weight)
        return (logits, *route(logits, k, normalize, execution, chunk_counts))
    chunk = None
    if chunk_counts:
        chunk = lazy.moe_sort.router_chunk(k, x.shape[0] * k, weight.shape[0])
        if chunk is not None and chunk != lazy.router.gate_rows(k) * k:
            chunk = None  # the sort counts itself
    out = _GateRoute.apply(x.contiguous(), weight, k, normalize, chunk)
    return (*out, None) if chunk_counts and chunk is None else out


def route(logits: torch.Tensor, k: int, normalize: bool, execution: Execution = DEFAULT,
          chunk_counts: bool = False):
    """logits [T, E] -> (weights [T, k] in logits.dtype, ids [T, k] int64, largest first). With
    `chunk_counts`, a third output: the per-chunk expert counts the counting sort starts from where
    the kernel can count them in its launch (`minite.kernels.moe_sort.router_chunk`), else None."""
    if execution.elementwise_kernels(logits):
        chunk = lazy.moe_sort.router_chunk(k, logits.shape[0] * k, logits.shape[1]) if chunk_counts else None
        out = _Route.apply(logits.contiguous(), k, normalize, chunk)
        return (*out, None) if chunk_counts and chunk is None else out
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype), ids, None) if chunk_counts else (weights.to(logits.dtype), ids)


class Gate(Linear):
    """The MoE router's gate `[E, H]` (`.weight`, HF's `mlp.gate`), a bf16 `Linear` whose call routes:
    `gate(x [T, H], top_k, normalize, execution) -> (logits [T, E], weights [T, k], ids [T, k],
    counts or None)` (`gate_route`, counting for the sort); forward hooks see the logits first."""

    def __init__(self, hidden_size: int, num_experts: int, dtype=None, device=None):
        super().__init__(hidden_size, num_experts, recipe="bf16", dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, top_k: int, normalize: bool, execution: Execution = DEFAULT):
        if self._calib_amax is not None:  # calibration records the input, as a Linear does
            self._calib_amax = torch.maximum(self._calib_amax, x.detach().abs().amax().float())
        return gate_route(x, self.weight, top_k, normalize, execution, chunk_counts=True)
