"""The sampler's counter-based uniforms: one fp32 in [0, 1) per (64-bit sample key, token index).

    u = mix32((key_lo + mix32((t mod 2^32) ^ key_hi)) mod 2^32) >> 8, times 2^-24

with `mix32` a bijective 32-bit finalizer (xor-shift / multiply; every product mod 2^32). Here it is
int64 tensor arithmetic that never overflows (32-bit products formed from 16-bit halves), so the same
bits come out on CPU and GPU; `minite.kernels.rng` computes it in one launch, bitwise equal.
Resolution 2^-24 (fp32's 24-bit mantissa).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for int64 x in [0, 2^32) without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * m + (((hi * m) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MUL2)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """keys [B] int64 (64-bit keys stored as signed), steps [B] int64 -> fp32 [B] in [0, 1)."""
    lo, hi = keys & MASK32, (keys >> 32) & MASK32
    h = mix32((lo + mix32((steps & MASK32) ^ hi)) & MASK32)
    return (h >> 8).float() * 2.0 ** -24
