"""The sampler's counter-based uniforms in one launch: bitwise `minite.ref.rng.uniforms` (the same
hash in uint32 arithmetic, whose products wrap mod 2^32), instead of the reference's ~30 element-wise
int64 kernels a decode step."""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel
from minite.ref.rng import MUL1, MUL2

BLOCK = 1024
_MUL1, _MUL2 = tl.constexpr(MUL1), tl.constexpr(MUL2)  # jit code reads constexpr globals only


@triton.jit
def _mix32(x):
    """`ref.rng.mix32` on uint32 x (the multipliers uint32 too: the products wrap mod 2^32)."""
    x = x ^ (x >> 16)
    x = x * tl.full((), _MUL1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), _MUL2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _uniforms_kernel(keys_ptr, steps_ptr, out_ptr, B, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < B
    key = tl.load(keys_ptr + offs, mask=ok, other=0)
    step = tl.load(steps_ptr + offs, mask=ok, other=0)
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _mix32(lo + _mix32((step & 0xFFFFFFFF).to(tl.uint32) ^ hi))
    tl.store(out_ptr + offs, (h >> 8).to(tl.float32) * 5.9604644775390625e-08, mask=ok)  # 2^-24


def uniforms(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """keys [B] int64 (64-bit keys stored as signed), steps [B] int64 -> fp32 [B] in [0, 1)."""
    if keys.dtype != torch.int64 or steps.dtype != torch.int64 or keys.shape != steps.shape or keys.ndim != 1:
        raise ValueError(f"keys and steps must be int64 [B], got {keys.dtype} {tuple(keys.shape)} and "
                         f"{steps.dtype} {tuple(steps.shape)}")
    if keys.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {keys.device}")
    b = keys.numel()
    out = torch.empty(b, dtype=torch.float32, device=keys.device)
    if b:
        launch_kernel(_uniforms_kernel, (cdiv(b, BLOCK),), (keys.contiguous(), steps.contiguous(), out, b),
                      BLOCK=BLOCK)
    return out
