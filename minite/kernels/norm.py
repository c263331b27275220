"""Triton RMSNorm, the kernel counterpart of `minite.nn.norm.rms_norm` (Qwen3's formula): one launch
instead of the reference's eight element-wise torch kernels.

Per row of x [..., D]: ms = sum(x^2) / D in fp32 (one tree reduction over the whole row, held in
registers), inv = 1 / sqrt(ms + eps) (correctly rounded division and square root), y = x * inv cast to
x's dtype, out = weight * y in the output dtype (`torch.result_type(weight, y)`). A row's result
depends on that row alone and on D, never on the number of rows or on which program holds it: batch
invariant by construction. Against the reference: the same formula, another summation order (close,
not bitwise).

`rms_norm` is differentiable: the backward recomputes the reference formula under autograd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.result_type(weight, torch.empty((), dtype=x.dtype))
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    block_d = triton.next_power_of_2(d)
    block_r = max(1, ELEMS // block_d)
    grid = (triton.cdiv(x2.shape[0], block_r),)
    if x2.shape[0]:
        _rms_norm_kernel[grid](x2, weight, out, x2.shape[0], d, x2.stride(0), out.stride(0), eps,
                               BLOCK_D=block_d, BLOCK_R=block_r, num_warps=8 if block_d >= 4096 else 4)
    return out.reshape(x.shape)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _launch(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        from minite.nn.norm import rms_norm_reference

        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xr = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wr = weight.detach().requires_grad_(ctx.needs_input_grad[1])
            y = rms_norm_reference(xr, wr, ctx.eps)
            inputs = [t for t in (xr, wr) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, inputs, grad))
        return (next(grads) if ctx.needs_input_grad[0] else None,
                next(grads) if ctx.needs_input_grad[1] else None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalize x [..., D] (D <= MAX_D) over its last dimension and scale by weight [D]."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has last dimension {x.shape[-1]}, weight has {weight.shape[0]}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"rms_norm kernel: D={x.shape[-1]} > MAX_D={MAX_D}")
    return _RMSNorm.apply(x, weight, eps)
