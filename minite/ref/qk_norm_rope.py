"""Qwen3's per-head q/k RMSNorm followed by RoPE: `rope(rms_norm(q, w_q))`, `rope(rms_norm(k, w_k))`
(`minite.ref.norm`, `minite.ref.rope`: fp32 statistics, the rotation in x's dtype).
`minite.kernels.qk_norm_rope` computes both in one launch: the rotation's bits given the normed
values, the norm's sum of squares in its own order (close, not bitwise).
"""

import torch

from minite.ref.norm import rms_norm
from minite.ref.rope import apply_rope


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[..., T, Hq, D]`, k `[..., T, Hkv, D]`, weights `[D]`, cos / sin `[..., T, D]` -> q, k normed
    per head and rotated."""
    return apply_rope(rms_norm(q, wq, eps), cos, sin), apply_rope(rms_norm(k, wk, eps), cos, sin)
