"""Inverse-CDF draw of one token per row: the reference of `minite.kernels.sample.draw`.

    cdf = cumsum(exp(logp))            fp32, in token-id order
    target = min(u * cdf[-1], nextafter(cdf[-1], 0))
    token = the first index whose cdf exceeds target

Only tokens with nonzero probability can be picked (the cdf rises only at them), and u = 0 picks the
first of them. The kernel sums in another order (blocks of token ids), so it gives the same token
except where the target lies within fp32 rounding of a cdf step: not bitwise, closely.
"""

import torch


def draw(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logp [B, V] fp32 (-inf where dropped), u [B] in [0, 1) -> tokens [B] int64."""
    cdf = torch.cumsum(logp.exp(), dim=-1)  # [B, V]
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=logp.shape[-1] - 1)
