"""RMSNorm, the Qwen3 way: `weight * (x / sqrt(mean(x^2) + eps))`.

The statistics run in fp32 whatever the input dtype; the normalized row is cast back to x's dtype and
only then scaled by the weight (in the weight's dtype), as transformers' Qwen3RMSNorm does. A row's
result depends on that row alone. `minite.kernels.norm.rms_norm` computes the same formula in another
summation order: close to this (not bitwise), batch invariant, and bitwise the same in every engine.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]: eight torch ops, fp32 statistics."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has last dimension {x.shape[-1]}, weight has {weight.shape[0]}")
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
    return weight * (xf * inv_rms).to(x.dtype)
