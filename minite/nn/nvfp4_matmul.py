"""Batched W4A4 matmul `y[b] = x[b] @ W[b]^T` as an autograd Function: the core of Linear and MoE.

Shapes: x [B, M, K] (B = 1 for a Linear, B = active experts for MoE, M padded per expert), weights
[E, N, K] with `experts` [B] picking W[b] = W[experts[b]] (None: B == E, or a 2D [N, K] weight).

Forward (the contract of `minite.ref.gemm`): activations quantized with `recipe.activation` ('row':
one call; 'tensor'/'static': one global scale per batch entry, like one tensor per expert), weights
from the shared `QuantizedWeight`; acc = unscaled_x @ unscaled_w^T in fp32, then `recipe.epilogue`.

Backward (see `minite.nn.linear` for the three GEMMs): 'dequantized' uses dY as is and the
dequantized forward operands; 'nvfp4' quantizes dY for dgrad (1x16 along N, stochastic rounding,
per-tensor scale) and dY^T, X^T for wgrad (1x16 along the tokens M, zero-padded to 16, RHT on both,
stochastic rounding on dY^T, RNE on X^T). Backward GEMMs run in fp32 on dequantized values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from minite.nn.quantized_weight import QuantizedWeight
from minite.nvfp4 import quantize
from minite.recipe import QuantSpec, Recipe
from minite.ref.gemm import apply_epilogue, epilogue_scale

DGRAD_DY_SPEC = QuantSpec(scaling="tensor", block=(1, 16), rounding="stochastic")
WGRAD_DY_SPEC = QuantSpec(scaling="tensor", block=(1, 16), rounding="stochastic", hadamard=True)
WGRAD_X_SPEC = QuantSpec(scaling="tensor", block=(1, 16), rounding="rne", hadamard=True)


class Operand(NamedTuple):
    """A quantized batched operand, as much of it as the GEMM needs."""

    unscaled: torch.Tensor  # [B, R, C] fp32, e2m1 * s_b (exact in bf16)
    global_scale: torch.Tensor  # [B, R, 1] (row) or [B, 1, 1] fp32, S_dec
    amax: torch.Tensor  # same shape as global_scale

    def dequantize(self) -> torch.Tensor:
        return self.unscaled * self.global_scale  # [B, R, C] fp32


def quantize_operand(x: torch.Tensor, spec: QuantSpec, static_scale: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> Operand:
    """x [B, R, C] quantized along C; 'tensor'/'static' scaling gets one global scale per b
    (static_scale [B] holds the decode scales)."""
    kw = spec.kwargs()
    if spec.scaling == "row":
        q = quantize(x, generator=generator, **kw)
        return Operand(q.unscaled(), q.global_scale, q.amax)
    if spec.scaling == "static" and static_scale is None:
        raise RuntimeError("static activation scaling needs a calibrated input scale")
    qs = [quantize(x[b], generator=generator, static_scale=None if static_scale is None else static_scale[b],
                   **kw) for b in range(x.shape[0])]
    return Operand(torch.stack([q.unscaled() for q in qs]),
                   torch.stack([q.global_scale for q in qs]).reshape(-1, 1, 1),
                   torch.stack([q.amax for q in qs]).reshape(-1, 1, 1))


def matmul_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b[B, N, K]^T in fp32 -> [B, M, N]; B == 1 runs one 2D mm (as `ref.gemm` does)."""
    if a.shape[0] == 1:
        return (a[0].float() @ b[0].float().T).unsqueeze(0)
    return torch.bmm(a.float(), b.float().transpose(1, 2))


class _Scales(NamedTuple):
    global_scale: torch.Tensor
    amax: torch.Tensor


class NVFP4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, qweight: QuantizedWeight, recipe: Recipe, static_scale, experts):
        wu, ws, wa = qweight.batched()  # [E, N, K] bf16, [E, 1, 1], [E, 1, 1]
        if experts is not None:
            wu, ws, wa = wu[experts], ws[experts], wa[experts]
        xo = quantize_operand(x, recipe.activation, static_scale)
        acc = matmul_t(xo.unscaled, wu)  # [B, M, N] fp32
        scale = epilogue_scale(xo, _Scales(ws, wa), recipe.epilogue)  # [B, M | 1, 1]
        out = apply_epilogue(acc, scale, recipe.epilogue, x.dtype)
        ctx.mode, ctx.experts, ctx.weight_meta = recipe.backward, experts, (weight.shape, weight.dtype)
        ctx.w, ctx.x_dtype = (wu, ws), x.dtype
        if recipe.backward == "dequantized":
            ctx.save_for_backward(xo.unscaled.to(torch.bfloat16), xo.global_scale)
        else:
            ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, dy):
        wu, ws = ctx.w
        w_dq = wu.float() * ws  # [B, N, K]
        dyf = dy.float()  # [B, M, N]
        if ctx.mode == "dequantized":
            xu, xs = ctx.saved_tensors
            dx = dyf @ w_dq if ctx.needs_input_grad[0] else None
            dw = dyf.transpose(1, 2) @ (xu.float() * xs) if ctx.needs_input_grad[1] else None
        else:
            (x,) = ctx.saved_tensors
            dx = quantize_operand(dyf, DGRAD_DY_SPEC).dequantize() @ w_dq if ctx.needs_input_grad[0] else None
            dw = _wgrad_nvfp4(dyf, x) if ctx.needs_input_grad[1] else None
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        if dw is not None:
            dw = _scatter_experts(dw, ctx.experts, ctx.weight_meta[0]).to(ctx.weight_meta[1])
        return dx, dw, None, None, None, None


def _wgrad_nvfp4(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW [B, N, K] = Q_sr(RHT(dY^T)) @ Q_rne(RHT(X^T))^T, both along the token dimension."""
    pad = -x.shape[1] % 16
    dyt = F.pad(dy.transpose(1, 2), (0, pad))  # [B, N, Mp]
    xt = F.pad(x.float().transpose(1, 2), (0, pad))  # [B, K, Mp]
    a = quantize_operand(dyt, WGRAD_DY_SPEC).dequantize()
    b = quantize_operand(xt, WGRAD_X_SPEC).dequantize()
    return a @ b.transpose(1, 2)


def _scatter_experts(dw: torch.Tensor, experts: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if experts is None:
        return dw.reshape(shape)
    return dw.new_zeros(shape).index_copy_(0, experts, dw)


def nvfp4_matmul(x: torch.Tensor, weight: torch.Tensor, qweight: QuantizedWeight, recipe: Recipe,
                 static_scale: torch.Tensor | None = None,
                 experts: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, M, K], weight [N, K] or [E, N, K] (the parameter, for its gradient) -> [B, M, N] in x.dtype."""
    if x.ndim != 3:
        raise ValueError(f"nvfp4_matmul expects x [B, M, K]; got shape {tuple(x.shape)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"in_features mismatch: x has {x.shape[-1]}, weight has {weight.shape[-1]}")
    return NVFP4Matmul.apply(x, weight, qweight, recipe, static_scale, experts)
