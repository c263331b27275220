"""RMSNorm's fast path for 16-bit rows (bf16 or fp16 x and weight, even D, word-aligned), with the
NVFP4 activation quantizer of its output fused in (`QUANT`).

The rows are read as int32 words [rows, blocks, 8] (two elements a word, one 16-element block per 8
words), the layout of the quantizer's pair kernel (`nvfp4.pairs`): a thread owns whole blocks, so the
normalized row, still in registers, is quantized with that kernel's helpers (`_emit_blocks`) and no
layout conversion. Same formula as `norm._rms_norm_kernel` (fp32 statistics, y = x * inv rounded to
x's dtype, out = weight * y rounded once); the sum of squares runs in this layout's order, so its
bits are this kernel's own: every 16-bit row that fits takes this kernel, quantizing or not, so a
row's output is the same whether its norm quantizes (and whatever the batch). With QUANT the values,
block scales, S_dec and amax are bitwise `nvfp4.quantize_unscaled` of the stored output.

With `RESIDUAL` the kernel first adds the residual r to x (h = x + r rounded to the dtype: torch's
16-bit add), stores h and normalizes it: the decoder layer's residual add and its next norm in one
launch, the bits of the add and then the norm.

Why: the norm then the quantizer read the norm's output back (8 bytes an element in all); fused, 6
(x in; out and values out) and one launch fewer. The first fused version, on the general quantizer's
element layout, ran slower than the two kernels apart on the H200.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.nvfp4.blocks import CHAIN_IDS, _max_nan, _row_scales
from minite.kernels.nvfp4.pairs import _bits16, _emit_blocks, _halves
from minite.kernels.rounding import round_to

WORDS = 2048  # int32 words per program (at least one row)
WORDS_PER_THREAD = 16
MAX_WORDS = 8192  # rows of up to 2 * MAX_WORDS elements


@triton.jit
def _norm_pairs_kernel(x_ptr, w_ptr, out_ptr, vals_ptr, scales_ptr, sdec_ptr, amax_ptr, res_ptr, h_ptr,
                       n_rows, stride_xw, stride_rw, eps, D, KW: tl.constexpr, QUANT: tl.constexpr,
                       CHAIN: tl.constexpr, RESIDUAL: tl.constexpr, BF16: tl.constexpr,
                       VALS_BF16: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr, BLOCK_R: tl.constexpr,
                       NB: tl.constexpr):
    """x, out (, r, h): int32 words [n_rows, KW] (out, vals, h contiguous); w: int32 words [KW]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    cols = tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # [1, NB, 8] words
    r64 = rows.to(tl.int64)[:, None, None]
    m = None if EVEN else row_ok[:, None, None] & (cols < KW)
    if EVEN:
        xw = tl.load(x_ptr + r64 * stride_xw + cols)
        ww = tl.load(w_ptr + cols)
    else:
        xw = tl.load(x_ptr + r64 * stride_xw + cols, mask=m, other=0)
        ww = tl.load(w_ptr + cols, mask=cols < KW, other=0)
    x_lo, x_hi = _halves(xw, BF16)
    w_lo, w_hi = _halves(ww, BF16)
    dt: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    if RESIDUAL:
        if EVEN:
            rw = tl.load(res_ptr + r64 * stride_rw + cols)
        else:
            rw = tl.load(res_ptr + r64 * stride_rw + cols, mask=m, other=0)
        r_lo, r_hi = _halves(rw, BF16)
        x_lo = round_to(x_lo + r_lo, dt)
        x_hi = round_to(x_hi + r_hi, dt)
        tl.store(h_ptr + r64 * KW + cols, _bits16(x_lo, BF16) | (_bits16(x_hi, BF16) << 16), mask=m)
    ss = tl.sum(tl.sum(x_lo * x_lo + x_hi * x_hi, axis=2), axis=1)
    ms = tl.div_rn(ss, tl.zeros([BLOCK_R], tl.float32) + D)
    inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(ms + eps))[:, None, None]
    # y rounded to x's dtype, then weight * y (both exact in fp32) rounded once (on the bits for bf16)
    o_lo = round_to(w_lo * round_to(x_lo * inv, dt), dt)
    o_hi = round_to(w_hi * round_to(x_hi * inv, dt), dt)
    word = _bits16(o_lo, BF16) | (_bits16(o_hi, BF16) << 16)
    tl.store(out_ptr + r64 * KW + cols, word, mask=m)
    if QUANT:
        bamax = tl.reduce(_max_nan(tl.abs(o_lo), tl.abs(o_hi)), 2, _max_nan)  # [BLOCK_R, NB]
        s_enc, s_dec = _row_scales(tl.reduce(bamax, 1, _max_nan), rows, row_ok, sdec_ptr, amax_ptr, CHAIN)
        _emit_blocks(o_lo, o_hi, word & -2147450880, cols, bamax, s_enc, s_dec, rows, row_ok, 0, vals_ptr,
                     scales_ptr, vals_ptr, KW, CHAIN, False, True, VALS_BF16, HW, EVEN, BLOCK_R, NB)


def applies(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x2 [R, D] and weight [D] take this kernel: both bf16 or both fp16, D even and at most
    2 * MAX_WORDS, unit column stride, words aligned."""
    d = x2.shape[-1]
    return (x2.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x2.dtype
            and d % 2 == 0 and d // 2 <= MAX_WORDS and x2.stride(-1) == 1 and x2.stride(0) % 2 == 0
            and x2.data_ptr() % 4 == 0 and weight.is_contiguous() and weight.data_ptr() % 4 == 0)


def launch(x2: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, quant=None,
           chain: str = "te", residual: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """out [R, D] (contiguous, x2's dtype) = rms_norm(x2); with quant = (values [R, D] bf16 / fp16,
    block scale bytes uint8 [R, D // 16], S_dec fp32 [R], amax fp32 [R]) (D % 16 == 0) also the
    row-scaled quantization of out; with residual = (r [R, D] as `applies` takes x2, h [R, D]
    contiguous) h = x2 + r is stored and normalized instead of x2."""
    r, d = x2.shape
    kw = d // 2
    block_w = max(8, next_power_of_2(kw))
    block_r = max(1, WORDS // block_w)
    warps = min(16, max(1, block_r * block_w // (32 * WORDS_PER_THREAD)))
    vals, scales, sdec, amx = quant if quant is not None else (out, out, out, out)
    res, h = residual if residual is not None else (x2, out)
    if r:
        launch_kernel(_norm_pairs_kernel, (cdiv(r, block_r),), (
            x2.view(torch.int32), weight.view(torch.int32), out.view(torch.int32), vals.view(torch.int32),
            scales, sdec, amx, res.view(torch.int32), h.view(torch.int32), r, x2.stride(0) // 2,
            res.stride(0) // 2, eps, d), KW=kw, QUANT=quant is not None, CHAIN=CHAIN_IDS[chain],
            RESIDUAL=residual is not None, BF16=x2.dtype == torch.bfloat16,
            VALS_BF16=vals.dtype == torch.bfloat16,
            HW=not interpreted(), EVEN=r % block_r == 0 and kw == block_w, BLOCK_R=block_r,
            NB=block_w // 8, num_warps=warps)
