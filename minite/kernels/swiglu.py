"""Triton SwiGLU, `h = silu(gate) * up` on 16-bit rows, with the NVFP4 activation quantizer of h fused
in (`swiglu_quantize`): the MLP's down projection reads h quantized, so the quantizer's pass over h
(a read of h and a launch) goes.

Per element, torch's formula for bf16 / fp16 tensors: s = gate / (1 + exp(-gate)) in fp32 (IEEE
division; exp: libdevice's expf on the GPU, numpy's in the interpreter) rounded to the dtype, then
h = s * up in fp32 rounded to the dtype (`rounding.round_to`: on the bits for bf16). Rows are read as
int32 words [rows, blocks, 8], the layout of the quantizer's pair kernel (`nvfp4.pairs`), whose
helpers quantize h: the values, S_dec and amax are bitwise `nvfp4.quantize_unscaled` of the stored
h. In a batch of few rows (a decode step's), rows of up to CHUNK_WORDS words are quantized from the
registers that computed them (one pass, as the norm kernel does); otherwise a program walks its rows
twice, h and its amax, then h read back (faster with many rows: 16384 x 768 on the H100).
Element-wise, so batch invariant. The backward recomputes silu(gate) and runs autograd's own ops
(mul, mul, silu_backward): the gradients are bitwise those of `F.silu(gate) * up` given the same s.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from minite.kernels import interpreted
from minite.kernels.launch import MIN_ROW_PROGRAMS, cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.nvfp4 import check_fused_output
from minite.kernels.nvfp4.blocks import CHAIN_IDS, _max_nan, _row_scales
from minite.kernels.nvfp4.pairs import _bits16, _emit_blocks, _halves, _load_blocks
from minite.kernels.rounding import round_to

# a program covers WORDS int32 words of h: BLOCK_R rows x one chunk of up to CHUNK_WORDS (8 words a thread).
# H200 at eb67cb1 (benchmarks/ops/bench_norm.py): whole rows in registers (16 words a thread, 12288-wide rows
# padded to 16384) ran at 0.58 of the copy bandwidth, slower than torch's two kernels, and 0.45 with the
# quantizer. H100 (benchmarks/results/h100/swiglu_norm_one_pass_7a14430.json), MoE expert rows (768):
# one pass 5.7 against 7.0 us at 1024 rows, 8.5 / 8.7 at 2048, 51.8 against 43.5 at 16384
WORDS = 1024
CHUNK_WORDS = 1024
WORDS_PER_THREAD = 8
MAX_WORDS = 1 << 20  # rows of up to 2 * MAX_WORDS elements; wider ones take torch's ops


@triton.jit
def _silu_mul(g, u, BF16: tl.constexpr, HW: tl.constexpr):
    dt: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    if HW:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return round_to(round_to(tl.div_rn(g, 1.0 + e), dt) * u, dt)


@triton.jit
def _swiglu_chunk(g_ptr, u_ptr, h_ptr, r64, row_ok, w0, stride_gw, stride_uw, KW: tl.constexpr,
                  BF16: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr, NB: tl.constexpr):
    """h of words [w0, w0 + 8 NB) of the rows r64 [BLOCK_R, 1, 1], stored; returned as (even, odd) fp32
    and the stored words."""
    cols = w0 + tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]  # [1, NB, 8] words
    m = None if EVEN else row_ok[:, None, None] & (cols < KW)
    if EVEN:
        gw = tl.load(g_ptr + r64 * stride_gw + cols)
        uw = tl.load(u_ptr + r64 * stride_uw + cols)
    else:
        gw = tl.load(g_ptr + r64 * stride_gw + cols, mask=m, other=0)
        uw = tl.load(u_ptr + r64 * stride_uw + cols, mask=m, other=0)
    g_lo, g_hi = _halves(gw, BF16)
    u_lo, u_hi = _halves(uw, BF16)
    h_lo = _silu_mul(g_lo, u_lo, BF16, HW)
    h_hi = _silu_mul(g_hi, u_hi, BF16, HW)
    word = _bits16(h_lo, BF16) | (_bits16(h_hi, BF16) << 16)
    tl.store(h_ptr + r64 * KW + cols, word, mask=m)
    return h_lo, h_hi, word


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, h_ptr, vals_ptr, scales_ptr, sdec_ptr, amax_ptr, n_rows, stride_gw,
                   stride_uw, KW: tl.constexpr, QUANT: tl.constexpr, CHAIN: tl.constexpr, BF16: tl.constexpr,
                   VALS_BF16: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr, BLOCK_R: tl.constexpr,
                   NB: tl.constexpr):
    """gate, up: int32 words, row strides stride_gw / stride_uw; h, vals: contiguous words [n_rows, KW].
    Without QUANT, program (i, j) does row block i's j-th chunk of 8 NB words. With QUANT, program i
    quantizes its rows from registers where one chunk holds them (8 NB >= KW); otherwise it walks them
    twice: h chunk by chunk (stored) and the row amax, then h read back (the program's own stores, in
    L2) and quantized chunk by chunk."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    r64 = rows.to(tl.int64)[:, None, None]
    if QUANT and 8 * NB >= KW:
        h_lo, h_hi, word = _swiglu_chunk(g_ptr, u_ptr, h_ptr, r64, row_ok, 0, stride_gw, stride_uw, KW, BF16,
                                         HW, EVEN, NB)
        bamax = tl.reduce(_max_nan(tl.abs(h_lo), tl.abs(h_hi)), 2, _max_nan)  # [BLOCK_R, NB]
        s_enc, s_dec = _row_scales(tl.reduce(bamax, 1, _max_nan), rows, row_ok, sdec_ptr, amax_ptr, CHAIN)
        cols = tl.arange(0, NB)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        _emit_blocks(h_lo, h_hi, word & -2147450880, cols, bamax, s_enc, s_dec, rows, row_ok, 0, vals_ptr,
                     scales_ptr, vals_ptr, KW, CHAIN, False, True, VALS_BF16, HW, EVEN, BLOCK_R, NB)
    elif QUANT:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for w0 in range(0, KW, 8 * NB):
            h_lo, h_hi, _ = _swiglu_chunk(g_ptr, u_ptr, h_ptr, r64, row_ok, w0, stride_gw, stride_uw, KW,
                                          BF16, HW, EVEN, NB)
            habs = tl.reduce(_max_nan(tl.abs(h_lo), tl.abs(h_hi)), 2, _max_nan)
            amax = _max_nan(amax, tl.reduce(habs, 1, _max_nan))
        s_enc, s_dec = _row_scales(amax, rows, row_ok, sdec_ptr, amax_ptr, CHAIN)
        tl.debug_barrier()  # every thread's h stores before any read back
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * KW
        for w0 in range(0, KW, 8 * NB):
            lo, hi, signs, cols, bamax = _load_blocks(h_rows, row_ok, w0, KW, BF16, EVEN, BLOCK_R, NB)
            _emit_blocks(lo, hi, signs, cols, bamax, s_enc, s_dec, rows, row_ok, w0, vals_ptr, scales_ptr,
                         vals_ptr, KW, CHAIN, False, True, VALS_BF16, HW, EVEN, BLOCK_R, NB)
    else:
        _swiglu_chunk(g_ptr, u_ptr, h_ptr, r64, row_ok, tl.program_id(1) * 8 * NB, stride_gw, stride_uw, KW,
                      BF16, HW, EVEN, NB)


def applies(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Whether the kernel takes gate / up [..., I]: both bf16 or both fp16, one shape, I even and at most
    2 * MAX_WORDS, unit column stride, rows flattenable, words aligned."""
    i = gate.shape[-1]
    if gate.dtype not in (torch.bfloat16, torch.float16) or up.dtype != gate.dtype or up.shape != gate.shape:
        return False
    if i % 2 or i // 2 > MAX_WORDS or not (gate.is_cuda or interpreted()):
        return False
    return all(_rows_view(t) is not None and t.data_ptr() % 4 == 0 for t in (gate, up))


def _rows_view(t: torch.Tensor):
    """t [..., I] as [R, I] without a copy, with an even row stride and unit column stride (or None)."""
    try:
        t2 = t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
    return t2 if t2.stride(-1) == 1 and (t2.stride(0) % 2 == 0 or t2.shape[0] <= 1) else None


def _chunk_words(kw: int) -> int:
    """Words per chunk: the largest power of two up to CHUNK_WORDS dividing kw (whole 16-element blocks);
    a row narrower than that, or not made of whole blocks, is one masked chunk."""
    chunk = CHUNK_WORDS
    while chunk > 8 and kw % chunk:
        chunk //= 2
    return chunk if kw % chunk == 0 else min(CHUNK_WORDS, max(8, next_power_of_2(kw)))


def _launch(gate: torch.Tensor, up: torch.Tensor, quant_dtype=None, chain: str = "te"):
    i = gate.shape[-1]
    g2, u2 = _rows_view(gate), _rows_view(up)
    r, kw = g2.shape[0], i // 2
    dev, lead = gate.device, gate.shape[:-1]
    h = torch.empty(r, i, dtype=gate.dtype, device=dev)
    quant = quant_dtype is not None
    vals = torch.empty(r, i, dtype=quant_dtype, device=dev) if quant else h
    scales = torch.empty(r, i // 16, dtype=torch.uint8, device=dev) if quant else h
    sdec = torch.empty(r, 1, dtype=torch.float32, device=dev) if quant else h
    amx = torch.empty(r, 1, dtype=torch.float32, device=dev) if quant else h
    chunk = _chunk_words(kw)
    # quantizing few rows (a grid under MIN_ROW_PROGRAMS), a row that fits one chunk is one (padded to a
    # power of two), quantized in one pass; the same bits either way
    if quant and next_power_of_2(kw) <= CHUNK_WORDS and cdiv(r, max(1, WORDS // chunk)) < MIN_ROW_PROGRAMS:
        chunk = next_power_of_2(kw)
    block_r = max(1, WORDS // chunk)
    grid = (cdiv(r, block_r),) if quant else (cdiv(r, block_r), cdiv(kw, chunk))
    if r:
        launch_kernel(_swiglu_kernel, grid, (
            g2.view(torch.int32), u2.view(torch.int32), h.view(torch.int32), vals.view(torch.int32), scales,
            sdec, amx, r, max(g2.stride(0), i) // 2, max(u2.stride(0), i) // 2), KW=kw, QUANT=quant,
            CHAIN=CHAIN_IDS[chain], BF16=gate.dtype == torch.bfloat16, VALS_BF16=vals.dtype == torch.bfloat16,
            HW=not interpreted(), EVEN=r % block_r == 0 and kw % chunk == 0, BLOCK_R=block_r, NB=chunk // 8,
            num_warps=max(1, block_r * chunk // (32 * WORDS_PER_THREAD)))
    h = h.reshape(*lead, i)
    if not quant:
        return h
    return h, vals.reshape(*lead, i), sdec.reshape(*lead, 1), amx.reshape(*lead, 1)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, quant_dtype=None, chain="te"):
        ctx.save_for_backward(gate, up)
        outs = _launch(gate, up, quant_dtype, chain)
        if quant_dtype is not None:
            ctx.mark_non_differentiable(*outs[1:])
            # no zero-filled gradients for the quantized outputs (a memset of the values each backward)
            ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, dh, *_):
        if dh is None:  # h itself took no part in the loss
            return None, None, None, None
        gate, up = ctx.saved_tensors
        s = F.silu(gate)
        dgate = torch.ops.aten.silu_backward(dh * up, gate) if ctx.needs_input_grad[0] else None
        dup = dh * s if ctx.needs_input_grad[1] else None
        return dgate, dup, None, None


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if not applies(gate, up):
        raise ValueError(f"swiglu kernel: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} must be one shape, both bf16 or both fp16, of even width <= "
                         f"{2 * MAX_WORDS}, rows with unit column stride (see `applies`)")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate / up [..., I] (`applies`), differentiable."""
    _check(gate, up)
    return _SwiGLU.apply(gate, up)


def swiglu_quantize(gate: torch.Tensor, up: torch.Tensor, out_dtype=torch.bfloat16, chain: str = "te"):
    """`swiglu` and the fused activation quantizer of h in one launch: (h [..., I], values e2m1 * s_b
    [..., I] in out_dtype, S_dec fp32 [..., 1], amax fp32 [..., 1]), the last three bitwise
    `nvfp4.quantize_unscaled(h, out_dtype, chain, return_codes=True)`'s. I must be a multiple of 16.
    Differentiable in h."""
    _check(gate, up)
    check_fused_output("swiglu_quantize", gate.shape[-1], out_dtype, chain)
    return _SwiGLU.apply(gate, up, out_dtype, chain)
