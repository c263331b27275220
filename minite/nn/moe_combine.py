"""The MoE combine as an autograd op: out[t] = sum_j ys[inverse[t * k + j]] * w[t, j]
(`minite.ref.moe_combine`).

Where the execution runs the element-wise kernels (on CUDA by default) the forward is one
launch (`minite.kernels.moe_combine`), for learner and sampler alike, so both get its bits; elsewhere
torch's gather, multiply and sum over k. The backward is torch's, the gradients autograd gives the
torch form: d ys[inverse[t * k + j]] = g[t] * w[t, j] (bf16 products), d w[t, j] = sum_h g[t, h] *
ys[inverse[t * k + j], h]. With `residual` the decoder layer's residual add runs in the same launch
(`residual + out`, its bits); its gradient is g.
"""

from __future__ import annotations

import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ys, inverse, weights, residual):
        ctx.save_for_backward(ys, inverse, weights)
        return lazy.moe_combine.combine(ys, inverse, weights, residual)

    @staticmethod
    def backward(ctx, g):
        ys, inverse, weights = ctx.saved_tensors
        t, k = weights.shape
        d_residual = g if ctx.needs_input_grad[3] else None
        g = g.contiguous().unsqueeze(1)  # [T, 1, H]
        d_ys = d_w = None
        if ctx.needs_input_grad[0]:
            d_ys = torch.empty_like(ys)
            d_ys[inverse] = (g * weights.unsqueeze(-1)).reshape(t * k, -1)
        if ctx.needs_input_grad[2]:
            d_w = (g * ys[inverse].reshape(t, k, -1)).sum(-1)
        return d_ys, None, d_w, d_residual


def combine(ys: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
            execution: Execution = DEFAULT, residual: torch.Tensor | None = None) -> torch.Tensor:
    """ys [R, H] expert outputs in sorted order, inverse [R], weights [T, k] -> [T, H], added to
    `residual` [T, H] where given."""
    if execution.elementwise_kernels(ys):
        return _Combine.apply(ys, inverse, weights, residual)
    t, k = weights.shape
    out = (ys[inverse].reshape(t, k, -1) * weights.unsqueeze(-1)).sum(dim=1)
    return out if residual is None else residual + out
