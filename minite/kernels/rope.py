"""Triton RoPE ("rotate half" layout), the kernel counterpart of `minite.nn.rope.apply_rope`: one launch
instead of five torch kernels, bitwise equal to the reference.

Per (token, head) row of x [N, H, D] with the token's cos/sin [N, D], halves 1 = [:D/2], 2 = [D/2:]:
out1 = r(r(x1 * cos1) + r(-x2 * sin1)), out2 = r(r(x2 * cos2) + r(x1 * sin2)), r() rounding to x's dtype.
That is the reference's arithmetic (`x * cos + rotate_half(x) * sin` in x's dtype, which torch also
computes in fp32 and rounds per op; products of two bf16/fp16 values are exact in fp32), so the
outputs are the same bits. bf16 is rounded on the bits (`minite.kernels.rounding`), so the CPU
interpreter checks bf16 too.

Backward (`backward=True`, x the output's gradient g): the reference's autograd gives
dx1 = r(r(g1 * cos1) + r(g2 * sin2)), dx2 = r(r(g2 * cos2) + r(-g1 * sin1)) (each path's product
rounded, the two paths summed once: the zero halves of the slices' gradients add exactly), which is
the forward with sin1, sin2 replaced by -sin2, -sin1: the same bits again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.rounding import round_to

ELEMS = 4096  # elements per program


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, H, stride_x, stride_c, stride_o,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr, BACKWARD: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (rows < n_rows)[:, None]
    tok = (rows // H).to(tl.int64)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    c = tl.arange(0, HALF)[None, :]
    x1 = tl.load(x_ptr + r64 * stride_x + c, mask=ok, other=0.0)
    x2 = tl.load(x_ptr + r64 * stride_x + HALF + c, mask=ok, other=0.0)
    cos1 = tl.load(cos_ptr + tok * stride_c + c, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + tok * stride_c + HALF + c, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + tok * stride_c + c, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + tok * stride_c + HALF + c, mask=ok, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation: sin halves swapped and negated (module docstring)
        sin1, sin2 = -sin2, -sin1
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = round_to(round_to(a1 * cos1, x1.dtype) + round_to(-a2 * sin1, x1.dtype), x1.dtype).to(x1.dtype)
    out2 = round_to(round_to(a2 * cos2, x1.dtype) + round_to(a1 * sin2, x1.dtype), x1.dtype).to(x1.dtype)
    tl.store(out_ptr + r64 * stride_o + c, out1, mask=ok)
    tl.store(out_ptr + r64 * stride_o + HALF + c, out2, mask=ok)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False) -> torch.Tensor:
    """x [..., T, H, D], cos/sin [..., T, D] (x's dtype) -> rotated x, same shape and dtype; backward:
    x is the output's gradient, the result the input's (the reference's autograd bits)."""
    *lead, h, d = x.shape
    if d % 2 or d & (d - 1):
        raise ValueError(f"rope kernel: head_dim={d} must be a power of two")
    if cos.shape != sin.shape or tuple(cos.shape) != (*lead, d) or cos.dtype != x.dtype:
        raise ValueError(f"rope kernel: cos/sin {tuple(cos.shape)} ({cos.dtype}) do not fit x "
                         f"{tuple(x.shape)} ({x.dtype})")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    c2, s2 = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block_r = max(1, ELEMS // d)
    if x2.shape[0]:
        launch_kernel(_rope_kernel, (cdiv(x2.shape[0], block_r),), (
            x2, c2, s2, out, x2.shape[0], h, x2.stride(0), c2.stride(0), out.stride(0)),
            HALF=d // 2, BLOCK_R=block_r, BACKWARD=backward, num_warps=4)
    return out.reshape(x.shape)
