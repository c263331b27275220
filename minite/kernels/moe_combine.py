"""The MoE combine in one launch (`minite.ref.moe_combine.combine`, same arguments and bits): gathers
each token's k expert rows by `inverse`, weights them and sums them in fp32 in top-k order.

torch runs it as a gather, a broadcast multiply and a sum over k: three [T, k, H] passes and a non-vectorized
broadcast kernel (H200, MoE decode step, 512 tokens x 8 x 2048: ~37 us a layer;
benchmarks/tools/profile_rollout.py at 1117cc3). Here a program reads its token's k rows once and writes one
row. One program per (token, column block): a token's result never depends on the batch. With a
residual the program also adds the decoder layer's residual to its row (the rounded sum plus the
residual, rounded again: torch's add after the combine), one launch and a [T, H] round trip less.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.rounding import round_to

CONFIG = dict(BLOCK_H=1024, num_warps=4)


@triton.jit
def _combine_kernel(ys_ptr, inverse_ptr, w_ptr, res_ptr, out_ptr, H, stride_y, stride_r, stride_o,
                    K: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        row = tl.load(inverse_ptr + t * K + j).to(tl.int64)
        w = tl.load(w_ptr + t * K + j)
        y = tl.load(ys_ptr + row * stride_y + offs, mask=mask, other=0.0)
        # the product rounded to the input dtype first (exact in fp32 for 16-bit inputs, so this is the
        # 16-bit multiply's rounding; the interpreter has no bf16 arithmetic)
        acc += (y.to(tl.float32) * w.to(tl.float32)).to(y.dtype).to(tl.float32)
    if RESIDUAL:
        # both roundings on the bits (the interpreter's bf16 cast truncates)
        dt: tl.constexpr = out_ptr.dtype.element_ty
        r = tl.load(res_ptr + t.to(tl.int64) * stride_r + offs, mask=mask, other=0.0)
        acc = round_to(round_to(acc, dt) + r.to(tl.float32), dt)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def combine(ys: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """ys [R, H] (unit stride along H), inverse [R] int, weights [T, k] (R = T * k, ys's dtype),
    residual [T, H] (ys's dtype, unit stride along H) or None -> out [T, H] in ys's dtype."""
    if ys.ndim != 2 or ys.stride(1) != 1:
        raise ValueError(f"ys must be [R, H] with unit stride along H, got {tuple(ys.shape)} {ys.stride()}")
    if weights.ndim != 2 or weights.dtype != ys.dtype:
        raise ValueError(f"weights must be [T, k] in {ys.dtype}, got {weights.dtype} {tuple(weights.shape)}")
    t, k = weights.shape
    if inverse.dtype not in (torch.int32, torch.int64) or tuple(inverse.shape) != (t * k,) or \
            ys.shape[0] != t * k:
        raise ValueError(f"inverse must be int [T * k = {t * k}] and ys [{t * k}, H]; got inverse "
                         f"{inverse.dtype} {tuple(inverse.shape)}, ys {tuple(ys.shape)}")
    if residual is not None and (tuple(residual.shape) != (t, ys.shape[1]) or residual.dtype != ys.dtype
                                 or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{t}, {ys.shape[1]}] in {ys.dtype} with unit stride along H, "
                         f"got {residual.dtype} {tuple(residual.shape)} {residual.stride()}")
    if ys.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {ys.device}")
    h = ys.shape[1]
    out = torch.empty(t, h, dtype=ys.dtype, device=ys.device)
    if t == 0:
        return out
    block = min(CONFIG["BLOCK_H"], next_power_of_2(h))
    res = out if residual is None else residual
    args = (ys, inverse.contiguous(), weights.contiguous(), res, out, h, ys.stride(0), res.stride(0),
            out.stride(0))
    # no FMA contraction: fp32 products are rounded before the sum, as the reference's are
    launch_kernel(_combine_kernel, (t, cdiv(h, block)), args, K=k, RESIDUAL=residual is not None,
                  BLOCK_H=block,
                  num_warps=CONFIG["num_warps"], enable_fp_fusion=False)
    return out
