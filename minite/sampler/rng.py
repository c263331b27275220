"""Counter-based random numbers: one uniform per (sample key, token index), whatever the batch.

Each sample (seed, request index, sample index) gets a 64-bit key (`sample_key`, from BLAKE2b). The
uniform that decides its token t is `u = mix32(key_lo + mix32(t ^ key_hi)) >> 8` scaled by 2^-24,
with `mix32` a 32-bit integer finalizer (xor-shift / multiply). It is a pure function of the key and
t, evaluated with int64 tensor ops that never overflow (32-bit products are formed from 16-bit
halves), so it gives the same bits on CPU and GPU, inside a CUDA graph, in any batch, and after a
preemption recomputes the sequence. Resolution is 2^-24 (fp32 has 24 bits of mantissa).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
MUL1, MUL2 = 0x7FEB352D, 0x846CA68B


def sample_key(seed: int, request: int, sample: int) -> int:
    """A 64-bit key for sample `sample` of request `request` under `seed`."""
    digest = hashlib.blake2b(f"{seed}/{request}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


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


def key_tensor(keys: list[int], device=None) -> torch.Tensor:
    """64-bit unsigned keys (or small non-negative ints) -> int64 tensor [B] holding the same bits,
    copied to `device` without synchronizing it (`runner.to_device`)."""
    from minite.sampler.runner import to_device

    bits = np.fromiter((k & 0xFFFFFFFFFFFFFFFF for k in keys), dtype=np.uint64, count=len(keys))
    return to_device(bits.view(np.int64), device if device is not None else "cpu")
