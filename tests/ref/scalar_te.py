"""An independent, scalar (numpy float32) implementation of Transformer Engine's NVFP4 chain.

Written from the chain in docs/facts.md without sharing code with minite.ref: E4M3 and E2M1
rounding are done by
enumerating the representable values and picking the nearest (ties to the even mantissa), not by
casts or thresholds. Slow; for tests on small inputs.
"""

import bisect

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _e4m3_values():
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            vals.append((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals  # sorted ascending, index parity == mantissa parity


E4M3 = _e4m3_values()


def nearest_even(grid, v: float) -> int:
    """Index of the grid value nearest to v >= 0, ties to the even index; saturates at the top."""
    if v >= grid[-1]:
        return len(grid) - 1
    hi = bisect.bisect_left(grid, v)
    if grid[hi] == v:
        return hi
    lo = hi - 1
    dlo, dhi = v - grid[lo], grid[hi] - v
    if dlo < dhi:
        return lo
    if dhi < dlo:
        return hi
    return lo if lo % 2 == 0 else hi


def e4m3_rne(v) -> float:
    return E4M3[nearest_even(E4M3, float(min(F32(v), F32(448.0))))]


def e2m1_code(v) -> int:
    v = F32(v)
    idx = nearest_even(E2M1, abs(float(v)))
    return idx | (8 if np.signbit(v) else 0)


def global_scales(amax):
    amax = F32(amax)
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = F32(2688.0) / amax
    if np.isinf(s_enc):
        s_enc = FLT_MAX
    if amax == 0 or s_enc == 0:
        s_enc = F32(1.0)
    return s_enc, F32(1.0) / s_enc


def quantize_rows(x: np.ndarray, row_scaled: bool):
    """x [R, K] float32 -> (codes [R, K] ints, block scales [R, K // 16] floats, S_dec per row)."""
    x = x.astype(np.float32)
    rows, k = x.shape
    codes = np.zeros((rows, k), dtype=np.int64)
    scales = np.zeros((rows, k // 16))
    s_decs = []
    tensor_amax = F32(np.abs(x).max())
    r6 = F32(1.0) / F32(6.0)
    for r in range(rows):
        amax = F32(np.abs(x[r]).max()) if row_scaled else tensor_amax
        s_enc, s_dec = global_scales(amax)
        s_decs.append(s_dec)
        for b in range(k // 16):
            blk = x[r, 16 * b: 16 * b + 16]
            sb = e4m3_rne(F32(np.abs(blk).max()) * F32(s_enc * r6))
            scales[r, b] = sb
            with np.errstate(divide="ignore", over="ignore"):
                e = F32(1.0) / F32(F32(sb) * s_dec)
            e = min(e, FLT_MAX)
            for j, xv in enumerate(blk):
                with np.errstate(over="ignore"):
                    codes[r, 16 * b + j] = e2m1_code(F32(xv * e))
    return codes, scales, np.array(s_decs, dtype=np.float32)
