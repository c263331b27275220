"""Rounding to bf16 on the bits, for kernels whose contract is "the same bits as torch's per-op bf16".

A `.to(tl.bfloat16).to(tl.float32)` round trip is not a safe way to round inside a kernel: the CPU
interpreter's bf16 cast truncates, and on the H200 the fused RoPE kernel written that way gave results
one bf16 ulp off torch's (the round trip did not survive compilation as written). Integer arithmetic
on the fp32 bits rounds the same everywhere.
"""

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), as fp32; an overflow rounds to inf, inf stays
    inf, NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def round_to(v, dt: tl.constexpr):
    """fp32 v rounded to dt (bf16 on the bits, others by a cast round trip), as fp32."""
    if dt == tl.bfloat16:
        return round_bf16(v)
    return v.to(dt).to(tl.float32)
