"""The NVFP4 quantizer's Triton building blocks, shared by the package's kernels (`minite.kernels.nvfp4`
general kernel, `pairs` fast path) and the fused norm / SwiGLU quantizers: E4M3 and E2M1 rounding, the
scale chains' global and block scales, per-row and given scales. Their contract is the reference's
(`minite.ref.nvfp4`), step by step in its order.
"""

import triton
import triton.language as tl

CHAIN_IDS = {"te": 0, "vllm": 1, "torchao": 2}
FLT_MAX = 3.4028234663852886e38


@triton.jit
def _to_e4m3(v, HW: tl.constexpr):
    """fp32 >= 0 -> (E4M3 byte as int32, its exact fp32 value): RNE, saturating at 448. HW: the GPU's
    cvt.rn.satfinite (one instruction for two values; the GPU tests check its bits); else on the bits."""
    v = tl.minimum(v, 448.0)
    if HW:
        f8 = v.to(tl.float8e4nv)
        return f8.to(tl.uint8, bitcast=True).to(tl.int32), f8.to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # RNE to 3 mantissa bits
    normal_byte = ((((r >> 23) & 0xFF) - 120) << 3) | ((r >> 20) & 7)
    # subnormal range: multiples of 2^-9; u < 8 so u + 2^23 rounds it to an integer (RNE) exactly once
    k = ((v * 512.0) + 8388608.0) - 8388608.0
    sub = v < 0.015625
    byte = tl.where(sub, k.to(tl.int32), normal_byte)
    value = tl.where(sub, k * 0.001953125, r.to(tl.float32, bitcast=True))
    return byte, value


@triton.jit
def _global_scales(amax, CHAIN: tl.constexpr):
    """Row amax (fp32) -> (S_enc, S_dec), the reference's `global_scales` (dynamic scaling)."""
    safe = tl.where(amax == 0.0, 1.0, amax)
    if CHAIN == 0:
        s_enc = tl.div_rn(tl.full(amax.shape, 2688.0, tl.float32), safe)
        s_enc = tl.where(s_enc > 3.4028234663852886e38, 3.4028234663852886e38, s_enc)
        s_enc = tl.where((amax == 0.0) | (s_enc == 0.0), 1.0, s_enc)
        s_dec = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
    else:
        s_dec = tl.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32))
        s_enc = tl.div_rn(tl.full(amax.shape, 1.0, tl.float32), tl.where(s_dec == 0.0, 1.0, s_dec))
        s_enc = tl.where(s_enc > 3.4028234663852886e38, 3.4028234663852886e38, s_enc)
        bad = (amax == 0.0) | (s_enc == 0.0) | (s_dec == 0.0)
        s_enc = tl.where(bad, 1.0, s_enc)
        s_dec = tl.where(bad, 1.0, s_dec)
    return s_enc, s_dec


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e2m1_value(idx):
    """Magnitude code 0..7 -> fp32 value 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    big = tl.where(idx == 5, 3.0, tl.where(idx == 6, 4.0, 6.0))
    return tl.where(idx < 5, idx.to(tl.float32) * 0.5, big)


@triton.jit
def _block_scales(bamax, s_enc, s_dec, CHAIN: tl.constexpr, HW: tl.constexpr):
    """Block amax [R, NB] fp32 and S_enc/S_dec [R, 1] -> (E4M3 byte int32, its value s_b fp32, the
    factor e each element of the block is multiplied by), all [R, NB]: the reference's chains."""
    if CHAIN == 0:
        raw = bamax * (s_enc * 0.16666666666666666)
    elif CHAIN == 1:
        raw = s_enc * (bamax * 0.16666666666666666)
    else:
        raw = tl.div_rn(tl.div_rn(bamax, tl.full(bamax.shape, 6.0, tl.float32)),
                        tl.broadcast_to(s_dec, bamax.shape))
        raw = tl.maximum(raw, 0.015625)
    sb_byte, sb = _to_e4m3(raw, HW)
    one = tl.full(sb.shape, 1.0, tl.float32)
    if CHAIN == 0:
        d = sb * s_dec
        e = tl.div_rn(one, tl.where(d == 0.0, 1.0, d))
        e = tl.where(d == 0.0, 3.4028234663852886e38, tl.minimum(e, 3.4028234663852886e38))
    elif CHAIN == 1:
        d = sb * tl.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
        e = tl.where(sb == 0.0, 0.0, tl.div_rn(one, tl.where(d == 0.0, 1.0, d)))
        e = tl.where((sb != 0.0) & (d == 0.0), float("inf"), e)
    else:
        e = tl.div_rn(tl.broadcast_to(tl.div_rn(tl.full(s_dec.shape, 1.0, tl.float32), s_dec), sb.shape),
                      sb)
    return sb_byte, sb, e


@triton.jit
def _e2m1_rint(a, HW: tl.constexpr):
    """|v| (fp32 >= 0) -> 2^23 + its E2M1 magnitude code (0..7) as fp32 (the code is in the low bits):
    RNE, saturating at 6, the reference's thresholds in three fmas and three mins. The code is rint(g(a))
    with g(a) = min(2a, a + 2, a / 2 + 4, 7), piecewise linear through the grid (0.5 -> 1, 2 -> 4,
    4 -> 6, 6 -> 7); ties to even on the code are ties to even on E2M1's mantissa. Each piece is one
    fma with 2^23 added (a single rounding, to an integer) and rint is monotone, so the min of the
    rounded pieces is rint(g). Checked against the thresholds for every fp32 in [0, 8]
    (tests/kernels/test_nvfp4.py); NaN saturates to 7, as in the reference."""
    if not HW:  # the interpreter's min propagates NaN; the GPU's returns the other operand (-> 7)
        a = tl.where(a == a, a, 6.0)
    return tl.minimum(tl.minimum(tl.fma(a, 2.0, 8388608.0), tl.fma(a, 1.0, 8388610.0)),
                      tl.minimum(tl.fma(a, 0.5, 8388612.0), 8388615.0))


@triton.jit
def _e2m1_rne(v, x, HW: tl.constexpr):
    """v = x * e (fp32) -> E2M1 code 0..15 (int32, bit 3 the sign of x), RNE, saturating at 6."""
    code = _e2m1_rint(tl.abs(v), HW).to(tl.int32, bitcast=True) & 7
    return code | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _quantize_chunk(x, s_enc, s_dec, rows, cols, seed, K,
                    CHAIN: tl.constexpr, TILE16: tl.constexpr, STOCHASTIC: tl.constexpr, HW: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_R, BLOCK_K] fp32 and broadcastable S_enc/S_dec [BLOCK_R, 1] ->
    (codes int32 [BLOCK_R, BLOCK_K], scale bytes int32 [BLOCK_R, NB], scale values fp32 [BLOCK_R, NB])."""
    NB: tl.constexpr = BLOCK_K // 16
    blocks = tl.reshape(x, [BLOCK_R, NB, 16])
    bamax = tl.max(tl.abs(blocks), axis=2)  # [BLOCK_R, NB]
    if TILE16:
        bamax = tl.broadcast_to(tl.max(bamax, axis=0)[None, :], [BLOCK_R, NB])
    sb_byte, sb, e = _block_scales(bamax, s_enc, s_dec, CHAIN, HW)
    v = tl.reshape(blocks * e[:, :, None], [BLOCK_R, BLOCK_K])
    if STOCHASTIC:
        a = tl.minimum(tl.abs(v), 6.0)
        lo = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
              + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
              + (a >= 6.0).to(tl.int32))
        hi = tl.minimum(lo + 1, 7)
        lo_v = _e2m1_value(lo)
        gap = _e2m1_value(hi) - lo_v
        p = tl.where(gap > 0.0, tl.div_rn(a - lo_v, tl.where(gap > 0.0, gap, 1.0)), 0.0)
        u = tl.rand(seed, rows[:, None] * K + cols[None, :])
        idx = tl.where(u < p, hi, lo)
        codes = idx | ((x.to(tl.int32, bitcast=True) >> 28) & 8)
    else:
        codes = _e2m1_rne(v, x, HW)
    return codes, sb_byte, sb


@triton.jit
def _emit_chunk(x, s_enc, s_dec, rows, row_ok, k0, seed, codes_ptr, scales_ptr, vals_ptr,
                K: tl.constexpr, CHAIN: tl.constexpr, TILE16: tl.constexpr, STOCHASTIC: tl.constexpr,
                WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, HW: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantize one [BLOCK_R, BLOCK_K] chunk starting at column k0 and store its outputs."""
    NB: tl.constexpr = BLOCK_K // 16
    cols = k0 + tl.arange(0, BLOCK_K)
    codes, sb_byte, sb = _quantize_chunk(x, s_enc, s_dec, rows, cols, seed, K, CHAIN, TILE16,
                                         STOCHASTIC, HW, BLOCK_R, BLOCK_K)
    bcols = k0 // 16 + tl.arange(0, NB)
    bm = row_ok[:, None] & (bcols < K // 16)[None, :]
    tl.store(scales_ptr + rows.to(tl.int64)[:, None] * (K // 16) + bcols[None, :],
             sb_byte.to(tl.uint8), mask=bm)
    if WRITE_CODES:
        even, odd = tl.split(tl.reshape(codes, [BLOCK_R, BLOCK_K // 2, 2]))
        pcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        pm = row_ok[:, None] & (pcols < K // 2)[None, :]
        tl.store(codes_ptr + rows.to(tl.int64)[:, None] * (K // 2) + pcols[None, :],
                 (even | (odd << 4)).to(tl.uint8), mask=pm)
    if WRITE_VALUES:
        mag = _e2m1_value(codes & 7)
        mag = tl.where((codes & 8) != 0, -mag, mag)
        vals = tl.reshape(tl.reshape(mag, [BLOCK_R, NB, 16]) * sb[:, :, None], [BLOCK_R, BLOCK_K])
        m = row_ok[:, None] & (cols < K)[None, :]
        tl.store(vals_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :],
                 vals.to(vals_ptr.dtype.element_ty), mask=m)


@triton.jit
def _row_scales(amax, rows, row_ok, sdec_out_ptr, amax_out_ptr, CHAIN: tl.constexpr):
    """Row amax [R] -> (S_enc, S_dec) [R, 1]; stores S_dec and amax. A row holding inf or NaN (amax inf
    or NaN) gets S_dec = amax = NaN: its GEMM outputs are NaN."""
    s_enc, s_dec = _global_scales(amax, CHAIN)
    finite = amax < float("inf")
    tl.store(sdec_out_ptr + rows, tl.where(finite, s_dec, float("nan")), mask=row_ok)
    tl.store(amax_out_ptr + rows, tl.where(finite, amax, float("nan")), mask=row_ok)
    return s_enc[:, None], s_dec[:, None]


@triton.jit
def _given_scales(gs_ptr, rows, row_ok, sdec_out_ptr, amax_out_ptr, rows_per_gs, GS: tl.constexpr,
                  CHAIN: tl.constexpr, BLOCK_R: tl.constexpr):
    """(S_enc, S_dec) [R, 1] for GS 1 (tensor scaling: the amax of the tensor of `rows_per_gs`
    consecutive rows at gs_ptr; stores its S_dec from the tensor's first row) or 2 (static: S_enc, S_dec
    at gs_ptr). GS 3 and 4 are 1 and 2 with every row's S_dec and amax stored (the GEMM epilogue's row
    factors): with 3 an amax of inf or NaN stores NaN; 4 reads the amax at gs_ptr + 2."""
    if GS == 1 or GS == 3:
        g = rows // rows_per_gs
        amax = tl.load(gs_ptr + g, mask=row_ok, other=0.0)
        s_enc, s_dec = _global_scales(amax, CHAIN)
        if GS == 3:
            finite = amax < float("inf")
            tl.store(sdec_out_ptr + rows, tl.where(finite, s_dec, float("nan")), mask=row_ok)
            tl.store(amax_out_ptr + rows, tl.where(finite, amax, float("nan")), mask=row_ok)
        else:
            tl.store(sdec_out_ptr + g, s_dec, mask=row_ok & (rows % rows_per_gs == 0))
        s_enc = s_enc[:, None]
        s_dec = s_dec[:, None]
    else:
        s_enc = tl.load(gs_ptr + tl.zeros([BLOCK_R, 1], dtype=tl.int32))
        s_dec = tl.load(gs_ptr + 1 + tl.zeros([BLOCK_R, 1], dtype=tl.int32))
        if GS == 4:
            zeros = tl.zeros([BLOCK_R], dtype=tl.int32)
            tl.store(sdec_out_ptr + rows, tl.load(gs_ptr + 1 + zeros), mask=row_ok)
            tl.store(amax_out_ptr + rows, tl.load(gs_ptr + 2 + zeros), mask=row_ok)
    return s_enc, s_dec
