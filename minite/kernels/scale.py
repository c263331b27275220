"""Row scaling of bf16 GEMM outputs and gradients: `out = bf16(fp32(x) * s[row])` in one pass.

The contract is torch's own `torch.mul(x, s, out=<bf16 tensor>)` for bf16 x and fp32 s (the product in
fp32, rounded once to bf16), bit for bit: that mixed-dtype torch op runs unvectorized, and the NVFP4
backward issues two of these per linear layer (dX times the weight's global scale, dY times the
activations' row scales). Rounding is on the bits (`minite.kernels.rounding`), so the CPU interpreter
checks the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.rounding import round_bf16

ELEMS = 4096  # elements per program
MAX_BLOCK_C = 2048


@triton.jit
def _scale_rows_kernel(x_ptr, s_ptr, out_ptr, R, C, stride_x, stride_o, stride_s,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < R
    m = row_ok[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows * stride_s, mask=row_ok, other=1.0)
    tl.store(out_ptr + r64 * stride_o + cols[None, :], round_bf16(x * s[:, None]).to(tl.bfloat16), mask=m)


def scale_rows(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x bf16 [..., C] times fp32 `scale` ([...] one per row, or a single number) -> bf16 [..., C];
    `out` may be x itself (in place)."""
    if x.dtype != torch.bfloat16 or scale.dtype != torch.float32:
        raise TypeError(f"scale_rows takes bf16 x and fp32 scales, got {x.dtype} and {scale.dtype}")
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    if scale.numel() not in (1, r):
        raise ValueError(f"scale has {scale.numel()} elements; x has {r} rows (or give one number)")
    s = scale.reshape(-1).contiguous()
    if out is None:
        out = torch.empty_like(x2)
    o2 = out.view(r, c)
    if o2.stride(-1) != 1:
        raise ValueError("out needs unit stride along its last dimension")
    scale_rows_2d(x2, s, o2)
    return out.view(x.shape)


def scale_rows_2d(x2: torch.Tensor, s: torch.Tensor, o2: torch.Tensor) -> torch.Tensor:
    """`scale_rows` without its checks, for callers that hold the layout already: x2 / o2 bf16 [R, C]
    with unit column stride, s fp32 contiguous [R] or [1]. -> o2."""
    r, c = x2.shape
    block_c = min(next_power_of_2(max(c, 1)), MAX_BLOCK_C)
    block_r = max(1, ELEMS // block_c)
    if r and c:
        grid = (cdiv(r, block_r), cdiv(c, block_c))
        launch_kernel(_scale_rows_kernel, grid,
                      (x2, s, o2, r, c, x2.stride(0), o2.stride(0), 0 if s.numel() == 1 else 1),
                      BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return o2
