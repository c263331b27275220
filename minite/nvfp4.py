"""NVFP4's public API: `quantize` / `dequantize` and the container (from `minite.nvfp4_format`).

```python
q = quantize(x, scaling="tensor"|"row"|"static", block=(1, 16)|(16, 16), rounding="rne"|"stochastic",
             chain="te"|"vllm"|"torchao", static_scale=None, hadamard=False, generator=None,
             check_finite=True, pad=False, backend="auto"|"ref"|"triton")
q.codes          # uint8 [..., K // 2]; low nibble = even element; bit 3 = sign
q.block_scales   # float8_e4m3fn [..., K // 16]; for 16x16 blocks the 16 rows of a tile repeat
q.global_scale   # float32 decode scale S_dec: [] (tensor/static) or [..., 1] (row)
q.amax           # float32 amax the global scale came from (for TE's GEMM alpha), same shape
dequantize(q)    # float32, the original (unpadded) shape
```
The formulas and the bit-exact contract live in `minite.ref.nvfp4`. Bad input raises before anything
is computed: non-finite values (ValueError with their count and first index), a last dimension (or,
for 16x16 blocks, a row count) not divisible by 16 without `pad=True`, unsupported dtypes (TypeError).

Backends: `ref` runs `minite.ref.nvfp4` (plain PyTorch, any device); `triton` runs
`minite.kernels.nvfp4.quantize_packed` (CUDA, or CPU tensors under TRITON_INTERPRET=1); `auto` (the
default) picks the kernels for CUDA tensors when they are available and the reference otherwise, so
CPU behaviour never changes. RNE codes, block scales and global scales are bitwise equal on both
backends, with or without the RHT; stochastic rounding (different random streams) agrees in
distribution only.

`check_finite=True` counts the non-finite values on the host, which synchronizes with a CUDA device.
Code on the hot path (`minite.nn`) passes `check_finite=False` for CUDA tensors and marks the rows of a
non-finite input with a NaN global scale instead (see `minite.nn.nvfp4_matmul`).
"""

from __future__ import annotations

import torch

from minite.nvfp4_format import (
    BLOCK,
    E2M1_VALUES,
    SUPPORTED_DTYPES,
    NVFP4Tensor,
    check_quantize_args,
    dequantize,
    pack,
    pad_to_blocks,
    require_finite,
    unpack,
)
from minite.ref import nvfp4 as ref

__all__ = ["BACKENDS", "BLOCK", "E2M1_VALUES", "SUPPORTED_DTYPES", "NVFP4Tensor", "dequantize", "pack",
           "quantize", "unpack", "use_kernels"]

BACKENDS = ("auto", "ref", "triton")

# `minite.nn` calls the checks by these names (and tests patch `_check_finite` here)
_check_args = check_quantize_args
_check_finite = require_finite
_pad_or_raise = pad_to_blocks


def quantize(x: torch.Tensor, scaling: str = "tensor", block=(1, 16), rounding: str = "rne",
             chain: str = "te", static_scale=None, hadamard: bool = False,
             generator: torch.Generator | None = None, check_finite: bool = True,
             pad: bool = False, backend: str = "auto") -> NVFP4Tensor:
    """Quantize x [..., K] to NVFP4 along its last dimension (see the module docstring)."""
    block = tuple(block)
    _check_args(x, scaling, block, rounding, chain, static_scale)
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; choose one of {list(BACKENDS)}")
    if check_finite:
        _check_finite(x)
    xp = _pad_or_raise(x, block, pad)
    x2 = xp if xp.ndim >= 2 else xp.unsqueeze(0)
    if use_kernels(x, backend):
        from minite.kernels import nvfp4 as kernel

        codes, sb, s_dec, amax = kernel.quantize_packed(x2, scaling, block, rounding, chain, static_scale,
                                                        hadamard, generator)
    else:
        codes, sb, s_dec, amax = ref.quantize_ref(x2, scaling, block, rounding, chain, static_scale,
                                                  hadamard, generator)
        codes = pack(codes)
    if xp.ndim == 1:
        codes, sb = codes[0], sb[0]
        if scaling == "row":
            s_dec, amax = s_dec[0], amax[0]
    return NVFP4Tensor(codes, sb, s_dec, amax, tuple(x.shape), block, scaling, chain, hadamard)


def use_kernels(x: torch.Tensor, backend: str) -> bool:
    """Whether `backend` runs the Triton kernels for x: 'triton' always (the kernel launcher raises a
    clear error when it cannot run), 'auto' for CUDA tensors when Triton is available, 'ref' never."""
    if backend == "ref":
        return False
    if backend == "triton":
        return True
    from minite import kernels

    return x.device.type == "cuda" and kernels.available()
