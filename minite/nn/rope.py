"""Rotary position embeddings (RoPE) in the "rotate half" layout used by Qwen3.

For head dimension D and base theta: `inv_freq[i] = theta^(-2i/D)` for i < D/2, angle
`a[p, i] = p * inv_freq[i]` (fp32), `cos`/`sin` of `[a, a]` (length D), and
`rope(x) = x * cos + rotate_half(x) * sin` with `rotate_half([x1, x2]) = [-x2, x1]`.
The angles are computed in fp32 from integer positions and cast to the activation dtype, so a token's
rotation depends only on its own position (the same for a cached key and a fresh one).
"""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """Inverse frequencies `theta^(-2i/D)` in fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim  # [D/2]
    return 1.0 / (theta ** exponents)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for integer `positions [...]`, each `[..., D]` in `dtype`."""
    inv_freq = rope_inv_freq(head_dim, theta, device=positions.device)  # [D/2]
    angles = positions[..., None].float() * inv_freq  # [..., D/2] fp32
    angles = torch.cat((angles, angles), dim=-1)  # [..., D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [..., T, H, D]` by `cos`/`sin [..., T, D]` (broadcast over the heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
