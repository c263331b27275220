"""Rotary position embeddings (RoPE) in the "rotate half" layout used by Qwen3.

For head dimension D and base theta: `inv_freq[i] = theta^(-2i/D)` for i < D/2, angle
`a[p, i] = p * inv_freq[i]` (fp32), `cos`/`sin` of `[a, a]` (length D), and
`rope(x) = x * cos + rotate_half(x) * sin` with `rotate_half([x1, x2]) = [-x2, x1]`.
The angles are computed in fp32 from integer positions and cast to the activation dtype, so a token's
rotation depends only on its own position (the same for a cached key and a fresh one).

Inside one model forward (`minite.nn.forward_scope`), every layer asking for the tables of the same
positions tensor gets the ones the first layer computed: the same values, about a dozen kernel
launches fewer per layer (a decode step is launch-bound in its small ops). Where the execution runs
the element-wise kernels (on CUDA by default), `apply_rope` runs the one-launch Triton kernel
`minite.kernels.rope.apply_rope` (bitwise the same values).
"""

from __future__ import annotations

import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn.forward_scope import scope_memo
from minite.ref.rope import apply_rope as apply_rope_reference


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Inverse frequencies `theta^(-2i/D)` in fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim  # [D/2]
    return 1.0 / (theta ** exponents)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer `positions [...]`, each `[..., D]` in `dtype` (computed once per
    positions tensor within a forward scope)."""
    memo = scope_memo("rope")
    if memo is None:
        return _rope_cos_sin(positions, head_dim, theta, dtype)
    key = (id(positions), head_dim, theta, dtype)
    hit = memo.get(key)
    if hit is not None and hit[0] is positions:
        return hit[1]
    tables = _rope_cos_sin(positions, head_dim, theta, dtype)
    memo[key] = (positions, tables)  # the reference keeps id(positions) from being reused
    return tables


def _rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = rope_inv_freq(head_dim, theta, device=positions.device)  # [D/2]
    angles = positions[..., None].float() * inv_freq  # [..., D/2] fp32
    angles = torch.cat((angles, angles), dim=-1)  # [..., D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               execution: Execution = DEFAULT) -> torch.Tensor:
    """Rotate `x [..., T, H, D]` by `cos`/`sin [..., T, D]` (broadcast over the heads)."""
    d = x.shape[-1]
    if (execution.elementwise_kernels(x) and d & (d - 1) == 0 and cos.shape == (*x.shape[:-2], d)
            and cos.dtype == x.dtype):
        return _RoPE.apply(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


class _RoPE(torch.autograd.Function):
    """The kernel forward and backward (the reference's autograd bits, `minite.kernels.rope`)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return lazy.rope.apply_rope(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return lazy.rope.apply_rope(grad, cos, sin, backward=True), None, None
