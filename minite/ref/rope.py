"""Rotary position embeddings in the "rotate half" layout: `rope(x) = x * cos + rotate_half(x) * sin`
with `rotate_half([x1, x2]) = [-x2, x1]`, each op in x's dtype (five torch ops). `minite.kernels.rope`
gives these bits, forward and (`backward=True`) this function's autograd gradient.
"""

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, H, D] by cos / sin [..., T, D] (broadcast over the heads), in x's dtype."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., T, 1, D]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
