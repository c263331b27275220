"""The NVFP4 quantizer's fast path for 16-bit input (bf16, fp16), 1x16 blocks, RNE: x read as int32
words, two elements each, loaded as [rows, blocks, 8 words] so that a thread owns whole 16-element
blocks (no shuffles, no layout conversions), holds both nibbles of every code byte it writes, and
widens bf16 to fp32 with a shift and a mask. Whole rows stay in registers (row scaling reads x once).
Same helpers as `nvfp4._quantize_kernel`, so the same bits as `minite.ref.nvfp4`.

Why (SASS counted with benchmarks/tools/sass_kernels.py): the general kernel runs ~25 instructions per
element, 0.40-0.49 of the H200's copy bandwidth; this one 15.5 for packed codes (0.86 of it timed as
CUDA graphs) and 23 for the fused values (0.91 at 16 words a thread); benchmarks/results/h200/quantize.json.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import MIN_ROW_PROGRAMS, cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.nvfp4.blocks import (
    _block_scales,
    _e2m1_rint,
    _given_scales,
    _max_nan,
    _row_scales,
)

# WORDS: int32 words (2 elements) per program (at least one row); whole rows when K / 2 <= MAX_WORDS
# (longer rows: row scaling goes to the general kernel, tensor/static scaling loops over CHUNK_WORDS);
# warps so that each thread holds WORDS_PER_THREAD words (packed codes) or VALUES_WORDS_PER_THREAD
# (fused values). H200 sweep, CUDA-graph timed (benchmarks/results/h200/sweep_quantize.json):
# 16384 x 4096, codes 0.856 of the copy at 32 words a thread (16: 0.835, 8: 0.735), fused values 0.908
# at 16 (32: 0.862, 8: 0.830). A grid under MIN_ROW_PROGRAMS (a decode step's rows) spreads its words
# over more threads, down to SMALL_WORDS_PER_THREAD: first fewer rows a program, then more warps a row.
# A row's amax is a max and its blocks are its own, so the bits do not depend on the split.
CONFIG = dict(WORDS=2048, MAX_WORDS=8192, CHUNK_WORDS=1024, WORDS_PER_THREAD=32, VALUES_WORDS_PER_THREAD=16,
              SMALL_WORDS_PER_THREAD=8)


@triton.jit
def _halves(w, IN_BF16: tl.constexpr):
    """int32 words -> (even, odd) elements as fp32."""
    if IN_BF16:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    else:
        lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _fp16_bits(v):
    """fp32 values >= 0, exact in fp16 -> their fp16 bits in the low half of an int32."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 65535


@triton.jit
def _bits16(v, BF16: tl.constexpr):
    """fp32 values exact in bf16 (BF16) or fp16 -> their bits in the low half of an int32."""
    if BF16:
        return v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 65535
    return _fp16_bits(v)


@triton.jit
def _load_blocks(w_rows, row_ok, w0, KW: tl.constexpr, IN_BF16: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Words [w0, w0 + 8 NB) of BLOCK_R rows as [BLOCK_R, NB, 8] (one 16-element block per row of 8
    words) -> (even elements, odd elements, their sign bits (w & 0x80008000), word offsets in the row,
    block amax [BLOCK_R, NB])."""
    cols = w0 + tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    if EVEN:  # no row or column past the end: unmasked
        w = tl.load(w_rows[:, :, None] + cols)
    else:
        w = tl.load(w_rows[:, :, None] + cols, mask=row_ok[:, None, None] & (cols < KW), other=0)
    lo, hi = _halves(w, IN_BF16)
    # NaN-propagating, so that a row's amax can be taken over its blocks (the layout stays the blocks')
    bamax = tl.reduce(_max_nan(tl.abs(lo), tl.abs(hi)), 2, _max_nan)
    return lo, hi, w & -2147450880, cols, bamax


@triton.jit
def _emit_blocks(lo, hi, signs, cols, bamax, s_enc, s_dec, rows, row_ok, w0, codes_ptr, scales_ptr, vals_ptr,
                 KW: tl.constexpr, CHAIN: tl.constexpr, WRITE_CODES: tl.constexpr,
                 WRITE_VALUES: tl.constexpr, OUT_BF16: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Quantize the blocks from `_load_blocks` with S_enc/S_dec [BLOCK_R, 1] and store them."""
    sb_byte, sb, e = _block_scales(bamax, s_enc, s_dec, CHAIN, HW)
    v_lo = lo * e[:, :, None]
    v_hi = hi * e[:, :, None]
    c_lo = _e2m1_rint(tl.abs(v_lo), HW)
    c_hi = _e2m1_rint(tl.abs(v_hi), HW)
    bcols = w0 // 8 + tl.arange(0, NB)
    tl.store(scales_ptr + rows.to(tl.int64)[:, None] * (KW // 8) + bcols[None, :], sb_byte.to(tl.uint8),
             mask=row_ok[:, None] & (bcols < KW // 8)[None, :])
    m = None if EVEN else row_ok[:, None, None] & (cols < KW)
    offs = rows.to(tl.int64)[:, None, None] * KW + cols
    # the sign bits are x's (the reference's contract): straight from the input words
    if WRITE_CODES:
        # the low byte of (2^23 + code) is the code; umulhi moves sign bits 15 and 31 to 3 and 7 (bits
        # above 7 are dropped by the uint8 store). Multiply-adds: the logic pipe is the busier one
        byte = (c_lo.to(tl.int32, bitcast=True) + c_hi.to(tl.int32, bitcast=True) * 16
                + tl.umulhi(signs.to(tl.uint32, bitcast=True), 0x100100).to(tl.int32, bitcast=True))
        tl.store(codes_ptr + offs, byte.to(tl.uint8), mask=m)
    if WRITE_VALUES:
        # |value| * s_b = max(k s_b / 2, (k - 2) s_b, (2k - 8) s_b) for the magnitude code k (the E2M1 grid
        # 0, .5, 1, 1.5, 2, 3, 4, 6 is convex in k), per-block constants; exact in the 16-bit output
        h, s1, s2 = (sb * 0.5)[:, :, None], sb[:, :, None], (sb * 2.0)[:, :, None]
        m2, m8 = (sb * -2.0)[:, :, None], (sb * -8.0)[:, :, None]
        k_lo = c_lo - 8388608.0
        k_hi = c_hi - 8388608.0
        q_lo = tl.maximum(tl.maximum(k_lo * h, tl.fma(k_lo, s1, m2)), tl.fma(k_lo, s2, m8))
        q_hi = tl.maximum(tl.maximum(k_hi * h, tl.fma(k_hi, s1, m2)), tl.fma(k_hi, s2, m8))
        if OUT_BF16:  # positive and exact in bf16: the high halves are the bf16 bits, the low halves zero
            word = (q_lo.to(tl.int32, bitcast=True) >> 16) | q_hi.to(tl.int32, bitcast=True)
        else:
            word = _fp16_bits(q_lo) | (_fp16_bits(q_hi) << 16)
        tl.store(vals_ptr + offs, word | signs, mask=m)


@triton.jit
def _pairs_kernel(w_ptr, codes_ptr, scales_ptr, vals_ptr, sdec_out_ptr, amax_out_ptr, gs_ptr,
                  R, stride_wr, rows_per_gs, KW: tl.constexpr, GS: tl.constexpr, CHAIN: tl.constexpr,
                  IN_BF16: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr,
                  OUT_BF16: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_W: tl.constexpr):
    """w: x as int32 words [R, KW]. GS as in `nvfp4._quantize_kernel`; row scaling (GS 0) needs
    BLOCK_W >= KW (the row is read once and kept)."""
    NB: tl.constexpr = BLOCK_W // 8
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wr
    if GS == 0:
        lo, hi, signs, cols, bamax = _load_blocks(w_rows, row_ok, 0, KW, IN_BF16, EVEN, BLOCK_R, NB)
        amax = tl.reduce(bamax, 1, _max_nan)
        s_enc, s_dec = _row_scales(amax, rows, row_ok, sdec_out_ptr, amax_out_ptr, CHAIN)
        _emit_blocks(lo, hi, signs, cols, bamax, s_enc, s_dec, rows, row_ok, 0, codes_ptr, scales_ptr,
                     vals_ptr, KW, CHAIN, WRITE_CODES, WRITE_VALUES, OUT_BF16, HW, EVEN, BLOCK_R, NB)
    else:
        s_enc, s_dec = _given_scales(gs_ptr, rows, row_ok, sdec_out_ptr, amax_out_ptr, rows_per_gs, GS, CHAIN,
                                     BLOCK_R)
        for w0 in range(0, KW, BLOCK_W):
            lo, hi, signs, cols, bamax = _load_blocks(w_rows, row_ok, w0, KW, IN_BF16, EVEN, BLOCK_R, NB)
            _emit_blocks(lo, hi, signs, cols, bamax, s_enc, s_dec, rows, row_ok, w0, codes_ptr, scales_ptr,
                         vals_ptr, KW, CHAIN, WRITE_CODES, WRITE_VALUES, OUT_BF16, HW, EVEN, BLOCK_R, NB)


def launch(x2, codes, scales, vals, sdec, amx, gs, gs_mode, chain_id, write_codes, rows_per_gs) -> bool:
    """Run the pair kernel on x2 [R, K] (16-bit, unit column stride) if it applies; False if not (the
    caller runs the general kernel): word-aligned rows and, for row scaling, rows that fit MAX_WORDS."""
    r, k = x2.shape
    kw = k // 2
    aligned = x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0
    out_ok = vals is None or (vals.dtype in (torch.bfloat16, torch.float16) and vals.data_ptr() % 4 == 0)
    if not aligned or not out_ok or x2.dtype not in (torch.bfloat16, torch.float16):
        return False
    w_p2 = max(8, next_power_of_2(kw))
    if w_p2 <= CONFIG["MAX_WORDS"]:
        block_w = w_p2  # whole rows: one load of everything, then the math (no chunk loop)
    elif gs_mode == 0:
        return False
    else:
        block_w = CONFIG["CHUNK_WORDS"]
    block_r = max(1, CONFIG["WORDS"] // block_w)
    per_thread = CONFIG["VALUES_WORDS_PER_THREAD" if vals is not None else "WORDS_PER_THREAD"]
    warps = min(16, max(1, block_r * block_w // (32 * per_thread)))
    least = 32 * CONFIG["SMALL_WORDS_PER_THREAD"]  # words of a warp at the fewest a thread
    while cdiv(r, block_r) < MIN_ROW_PROGRAMS and block_r * block_w > warps * least:
        if block_r > 1:
            block_r //= 2
        elif warps < 16:
            warps *= 2
        else:
            break
    words = x2.view(torch.int32)
    launch_kernel(_pairs_kernel, (cdiv(r, block_r),), (
        words, codes, scales, vals.view(torch.int32) if vals is not None else codes, sdec, amx, gs,
        r, x2.stride(0) // 2, rows_per_gs), KW=kw, GS=gs_mode, CHAIN=chain_id,
        IN_BF16=x2.dtype == torch.bfloat16, WRITE_CODES=write_codes, WRITE_VALUES=vals is not None,
        OUT_BF16=vals is not None and vals.dtype == torch.bfloat16, HW=not interpreted(),
        EVEN=r % block_r == 0 and kw % block_w == 0,
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=warps)
    return True
