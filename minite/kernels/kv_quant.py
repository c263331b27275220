"""Triton quantizer of attention keys and values, bitwise equal to `minite.ref.kv_quant`.

One program quantizes BLOCK_R (token, kv head) rows, each a whole row of D values in registers (one
read of x), and stores payload, block scales and row scale straight into the rows `slots` of the
destination (the sampler's cache blocks, or a fresh contiguous `QuantizedKV` for the learner).
fp8: s = amax / 448 (IEEE division), the row divided by s, E4M3 RNE on the GPU's cvt (HW) or on the
fp32 bits (interpreter), the sign bit put back. nvfp4: the NVFP4 quantizer's building blocks
(`minite.kernels.nvfp4.blocks`: row global scales, 1x16 block scales, E2M1 RNE) on the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.nvfp4.blocks import _global_scales, _quantize_chunk, _to_e4m3
from minite.ref.kv_quant import QuantizedKV, check_input, zeros

ELEMS = 4096  # values per program (BLOCK_R = ELEMS // D rows)


@triton.jit
def _quantize_rows(x, pay_ptr, bs_ptr, sc_ptr, pay_row, bs_row, sc_row, ok, D: tl.constexpr,
                   NVFP4: tl.constexpr, HW: tl.constexpr, BLOCK_R: tl.constexpr):
    """Whole rows x [BLOCK_R, D] (fp32) quantized and stored: payload at byte offsets pay_row [BLOCK_R],
    block scales at bs_row (nvfp4), the fp32 row scale at sc_row. Every step but the row amax is per
    element and the amax is exact, so the bits do not depend on the layout the compiler gives x."""
    cols = tl.arange(0, D)
    amax = tl.max(tl.abs(x), axis=1)
    if NVFP4:
        s_enc, scale = _global_scales(amax, 0)
        codes, sb_byte, _ = _quantize_chunk(x, s_enc[:, None], scale[:, None], pay_row, cols, 0, D, 0, False,
                                            False, HW, BLOCK_R, D)
        even, odd = tl.split(tl.reshape(codes, [BLOCK_R, D // 2, 2]))
        tl.store(pay_ptr + pay_row[:, None] + tl.arange(0, D // 2)[None, :], (even | (odd << 4)).to(tl.uint8),
                 mask=ok[:, None])
        tl.store(bs_ptr + bs_row[:, None] + tl.arange(0, D // 16)[None, :], sb_byte.to(tl.uint8),
                 mask=ok[:, None])
    else:
        scale = tl.where(amax == 0.0, 1.0, tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        v = tl.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        byte, _ = _to_e4m3(tl.abs(v), HW)  # saturates at 448: the reference's clamp
        byte = byte | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)
        tl.store(pay_ptr + pay_row[:, None] + cols[None, :], byte.to(tl.uint8), mask=ok[:, None])
    tl.store(sc_ptr + sc_row, scale, mask=ok)


@triton.jit
def _kv_quant_kernel(x_ptr, slots_ptr, pay_ptr, bs_ptr, sc_ptr, R, H, stride_xn, stride_xh, stride_pn,
                     stride_ph, stride_bn, stride_bh, stride_sn, stride_sh, D: tl.constexpr,
                     NVFP4: tl.constexpr, HW: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (token, head) pairs
    ok = rows < R
    n = tl.where(ok, rows // H, 0).to(tl.int64)
    h = rows % H
    cols = tl.arange(0, D)
    x = tl.load(x_ptr + n[:, None] * stride_xn + h[:, None] * stride_xh + cols[None, :], mask=ok[:, None],
                other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + n, mask=ok, other=0).to(tl.int64)
    _quantize_rows(x, pay_ptr, bs_ptr, sc_ptr, slot * stride_pn + h * stride_ph,
                   slot * stride_bn + h * stride_bh, slot * stride_sn + h * stride_sh, ok, D, NVFP4, HW,
                   BLOCK_R)


def quantize_kv(x: torch.Tensor, kv_format: str, out: QuantizedKV | None = None,
                slots: torch.Tensor | None = None) -> QuantizedKV:
    """x `[N, H, D]` -> its `QuantizedKV` (`minite.ref.kv_quant`'s bits). With `out` (`[M, H, ...]`, of
    `kv_format`) and `slots` `[N]`: row n is stored at out[slots[n]] and `out` is returned."""
    check_input(x, kv_format)
    if x.ndim != 3 or x.stride(-1) != 1:
        raise ValueError(f"quantize_kv (kernel) needs x [N, H, D] with unit stride along D, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    N, H, D = x.shape
    if D & (D - 1):
        raise ValueError(f"quantize_kv (kernel) needs a power-of-two head dim, got {D}")
    if out is None:
        out = zeros(kv_format, (N,), H, D, x.device)
        slots = torch.arange(N, device=x.device)
    elif slots is None or slots.shape != (N,) or out.format != kv_format or out.shape[-2:] != (H, D):
        raise ValueError(f"quantize_kv: out {out.format} {out.shape} and slots must match x {tuple(x.shape)}")
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {x.device}")
    if N == 0:
        return out
    pay = out.payload.view(torch.uint8)
    bs = pay if out.block_scales is None else out.block_scales.view(torch.uint8)
    sc = out.scale
    block_r = max(ELEMS // D, 1)
    launch_kernel(_kv_quant_kernel, (cdiv(N * H, block_r),), (
        x, slots, pay, bs, sc, N * H, H, x.stride(0), x.stride(1), pay.stride(0), pay.stride(1),
        bs.stride(0), bs.stride(1), sc.stride(0), sc.stride(1)),
        D=D, NVFP4=kv_format == "nvfp4", HW=not interpreted(), BLOCK_R=block_r, num_warps=4)
    return out
