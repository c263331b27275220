"""Triton RMSNorm, the kernel counterpart of `minite.nn.norm.rms_norm` (Qwen3's formula): one launch
instead of the reference's eight element-wise torch kernels.

Per row of x [..., D]: ms = sum(x^2) / D in fp32 (one tree reduction over the whole row, held in
registers), inv = 1 / sqrt(ms + eps) (correctly rounded division and square root), y = x * inv cast to
x's dtype, out = weight * y in the output dtype (`torch.result_type(weight, y)`). A row's result
depends on that row alone and on D, never on the number of rows or on which program holds it: batch
invariant by construction. Against the reference: the same formula, another summation order (close,
not bitwise).

Rows of bf16 / fp16 x and weight (even D, word-aligned) take `norm_pairs` instead: the same formula,
the sum of squares in its own order. `rms_norm_quantize` adds the fused activation quantizer of the
output (in the same launch on that path, after it otherwise), for the NVFP4 GEMMs that read it.
`add_rms_norm` adds a residual first (h = x + r, torch's add's bits), stores h and normalizes it, in
the same launch on that path (a forward without autograd: the sampler's decoder layers).

`rms_norm` is differentiable, with a one-launch backward (`_rms_norm_bwd_kernel`, plus a sum of
per-program dW partials) instead of the reference's ~20 torch kernels under autograd. With
gy = r(dy * w) (r: rounding to x's dtype, as autograd's product does) and c = sum(gy * x) / D / rms^3:
dx = r(gy / rms - c * x), and dW = sum over rows of dy * r(x / rms) in fp32, rounded once to W's
dtype (autograd rounds each product first). The same formula as the reference's autograd, other
summation orders: close, not bitwise; deterministic for a given shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels import norm_pairs
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.nvfp4 import check_fused_output
from minite.kernels.rounding import round_to

MAX_D = 16384
ELEMS = 4096  # elements per program: ELEMS // D rows (at least one)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_rows, D, stride_x, stride_o, eps,
                     BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    m = (rows < n_rows)[:, None] & col_ok[None, :]
    x_in = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
    x = x_in.to(tl.float32)
    ms = tl.div_rn(tl.sum(x * x, axis=1), tl.zeros([BLOCK_R], tl.float32) + D)
    inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    y = (x * inv[:, None]).to(x_in.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    out = w[None, :] * y  # both values exact in fp32: one rounding to the output dtype below
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_part_ptr, n_rows, D, stride_x, stride_dy,
                         stride_dx, eps, programs, ITERS: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """Row blocks pid, pid + programs, ... (ITERS of them): dx of their rows, their dW summed into
    dw_part[pid]."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(0, ITERS):
        rows = (pid + i * programs) * BLOCK_R + tl.arange(0, BLOCK_R)
        m = (rows < n_rows)[:, None] & col_ok[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x_in = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=m, other=0.0)
        x = x_in.to(tl.float32)
        dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ms = tl.div_rn(tl.sum(x * x, axis=1), tl.zeros([BLOCK_R], tl.float32) + D)
        inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(ms + eps))
        gy = round_to(dy * w[None, :], x_in.dtype)
        c = tl.sum(gy * x, axis=1) * (inv * inv * inv) / D
        dx = gy * inv[:, None] - c[:, None] * x
        tl.store(dx_ptr + r64 * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw += tl.sum(dy * round_to(x * inv[:, None], x_in.dtype), axis=0)
    tl.store(dw_part_ptr + pid * BLOCK_D + cols, dw, mask=col_ok)


MAX_BWD_PROGRAMS = 264  # dW partials [programs, D] fp32: about two programs per H200 SM


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, eps: float):
    """dx, dW of `rms_norm` for the output gradient dy (the one-launch backward, module docstring)."""
    d = x.shape[-1]
    x2, dy2 = x.reshape(-1, d), dy.reshape(-1, d)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    dy2 = dy2 if dy2.stride(-1) == 1 else dy2.contiguous()
    block_d = next_power_of_2(d)
    block_r = max(1, ELEMS // block_d)
    blocks = cdiv(x2.shape[0], block_r)
    # a power of two row blocks per program (a compile-time loop: few variants, interpreter-safe)
    iters = next_power_of_2(cdiv(blocks, MAX_BWD_PROGRAMS))
    programs = max(1, cdiv(blocks, iters))
    dx = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    part = torch.empty(programs, block_d, dtype=torch.float32, device=x.device)
    if x2.shape[0]:
        launch_kernel(_rms_norm_bwd_kernel, (programs,),
                      (x2, weight, dy2, dx, part, x2.shape[0], d, x2.stride(0), dy2.stride(0), dx.stride(0),
                       eps, programs),
                      ITERS=iters, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=8 if block_d >= 4096 else 4)
    else:
        part.zero_()
    return dx.reshape(x.shape), part[:, :d].sum(0).to(weight.dtype)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype=None, chain: str = "te",
            h: tuple[torch.Tensor, torch.Tensor] | None = None):
    """out (and with quant_dtype: (values [..., D] quant_dtype, S_dec fp32 [..., 1], amax fp32 [..., 1])).
    16-bit rows take `norm_pairs` (quantizing in the same launch); others this file's kernel (and the
    quantizer after it). `h` = (r [R, D], h [R, D]): norm_pairs normalizes x + r and stores it in h
    (the caller checked that r takes norm_pairs)."""
    from minite.kernels import nvfp4

    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    out_dtype = torch.result_type(weight, torch.empty((), dtype=x.dtype))
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    lead = x.shape[:-1]
    if norm_pairs.applies(x2, weight):
        quant = None
        if quant_dtype is not None:
            quant = (torch.empty(x2.shape, dtype=quant_dtype, device=x.device),
                     torch.empty(r, d // 16, dtype=torch.uint8, device=x.device),
                     torch.empty(r, 1, dtype=torch.float32, device=x.device),
                     torch.empty(r, 1, dtype=torch.float32, device=x.device))
        norm_pairs.launch(x2, weight, eps, out, quant, chain, h)
        if quant is None:
            return out.reshape(x.shape)
        return out.reshape(x.shape), quant[0].reshape(x.shape), quant[2].reshape(*lead, 1), \
            quant[3].reshape(*lead, 1)
    block_d = next_power_of_2(d)
    block_r = max(1, ELEMS // block_d)
    if r:
        launch_kernel(_rms_norm_kernel, (cdiv(r, block_r),),
                      (x2, weight, out, r, d, x2.stride(0), out.stride(0), eps),
                      BLOCK_D=block_d, BLOCK_R=block_r, num_warps=8 if block_d >= 4096 else 4)
    out = out.reshape(x.shape)
    if quant_dtype is None:
        return out
    vals, sdec, _, _, amx = nvfp4.quantize_unscaled(out, quant_dtype, chain, return_codes=True)
    return out, vals, sdec, amx


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, quant_dtype=None, chain="te"):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        outs = _launch(x, weight, eps, quant_dtype, chain)
        if quant_dtype is not None:
            ctx.mark_non_differentiable(*outs[1:])
            # no zero-filled gradients for the quantized outputs (a memset of the values each backward)
            ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, grad, *_):
        if grad is None:  # the output itself took no part in the loss
            return None, None, None, None, None
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(x, weight, grad, ctx.eps)
        return (dx if ctx.needs_input_grad[0] else None, dw if ctx.needs_input_grad[1] else None, None, None,
                None)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has last dimension {x.shape[-1]}, weight has {weight.shape[0]}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"rms_norm kernel: D={x.shape[-1]} > MAX_D={MAX_D}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalize x [..., D] (D <= MAX_D) over its last dimension and scale by weight [D]."""
    _check(x, weight)
    return _RMSNorm.apply(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype=None,
                 chain: str = "te"):
    """h = x + residual (x's shape and dtype), then `rms_norm(h)` (`rms_norm_quantize(h, ...)` with
    quant_dtype) -> (h, *what that returns): bitwise torch's add and then those functions, in one
    launch where the rows take `norm_pairs`. No autograd (the learner adds and norms apart)."""
    _check(x, weight)
    if quant_dtype is not None:
        check_fused_output("add_rms_norm", x.shape[-1], quant_dtype, chain)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} must match x "
                         f"{x.dtype} {tuple(x.shape)}")
    d = x.shape[-1]
    x2, r2 = x.reshape(-1, d), residual.reshape(-1, d)
    if norm_pairs.applies(x2, weight) and norm_pairs.applies(r2, weight):
        h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        outs = _launch(x2, weight, eps, quant_dtype, chain, (r2, h))
        outs = (outs,) if quant_dtype is None else outs
        lead = x.shape[:-1]
        return (h.reshape(x.shape), outs[0].reshape(x.shape), *(
            o.reshape(*lead, o.shape[-1]) for o in outs[1:]))
    h = x + residual
    outs = _launch(h, weight, eps, quant_dtype, chain)
    return (h, outs) if quant_dtype is None else (h, *outs)


def rms_norm_quantize(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype=torch.bfloat16,
                      chain: str = "te"):
    """`rms_norm` and the fused activation quantizer of its output in one launch: x [..., D] ->
    (out [..., D] as `rms_norm`, values e2m1 * s_b [..., D] in out_dtype, S_dec fp32 [..., 1], amax fp32
    [..., 1]), bitwise `rms_norm(x)` and `kernels.nvfp4.quantize_unscaled(out, out_dtype, chain,
    return_codes=True)`'s values, S_dec and amax. D must be a multiple of 16. Differentiable in out."""
    _check(x, weight)
    check_fused_output("rms_norm_quantize", x.shape[-1], out_dtype, chain)
    return _RMSNorm.apply(x, weight, eps, out_dtype, chain)
