"""NVFP4: the container, packing, and the public `quantize` / `dequantize` entry points.

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
backends; stochastic rounding (different random streams) and the RHT agree in distribution only.

`check_finite=True` counts the non-finite values on the host, which synchronizes with a CUDA device.
Code on the hot path (`minite.nn`) passes `check_finite=False` for CUDA tensors and marks the rows of a
non-finite input with a NaN global scale instead (see `minite.nn.nvfp4_matmul`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minite.ref import nvfp4 as ref
from minite.ref.hadamard import apply_rht

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("auto", "ref", "triton")
E2M1_VALUES = ref.E2M1_VALUES
BLOCK = 16


@dataclass(frozen=True)
class NVFP4Tensor:
    codes: torch.Tensor  # [..., Kp // 2] uint8
    block_scales: torch.Tensor  # [..., Kp // 16] float8_e4m3fn
    global_scale: torch.Tensor  # [] or [..., 1] float32 (S_dec)
    amax: torch.Tensor  # [] or [..., 1] float32
    shape: tuple[int, ...]  # original, unpadded shape
    block: tuple[int, int] = (1, 16)
    scaling: str = "tensor"
    chain: str = "te"
    hadamard: bool = False

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 2)

    def values(self) -> torch.Tensor:
        """The E2M1 values, fp32, padded shape."""
        return ref.e2m1_decode(unpack(self.codes))

    def unscaled(self) -> torch.Tensor:
        """e2m1 * s_b without the global scale: fp32, padded shape; exact in bf16 and fp16."""
        v = self.values()
        lead = v.shape[:-1]
        sb = self.block_scales.float().unsqueeze(-1)
        return (v.reshape(*lead, -1, BLOCK) * sb).reshape(v.shape)

    def dequantize(self, undo_hadamard: bool = False) -> torch.Tensor:
        return dequantize(self, undo_hadamard=undo_hadamard)

    def to(self, device) -> NVFP4Tensor:
        return replace(self, codes=self.codes.to(device), block_scales=self.block_scales.to(device),
                       global_scale=self.global_scale.to(device), amax=self.amax.to(device))

    def nbytes(self) -> int:
        return self.codes.numel() + self.block_scales.numel() + 4 * self.global_scale.numel()


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values 0..15, K even) -> [..., K // 2]; even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> codes [..., K]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


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


def dequantize(q: NVFP4Tensor, undo_hadamard: bool = False) -> torch.Tensor:
    """fp32 values e2m1 * s_b * S_dec in the original shape. With hadamard=True the values stay in
    the rotated domain (what a GEMM consumes) unless undo_hadamard=True."""
    x = q.unscaled() * q.global_scale
    if q.hadamard and undo_hadamard:
        x = apply_rht(x, inverse=True)
    return x[tuple(slice(0, n) for n in q.shape)]


def _check_args(x, scaling, block, rounding, chain, static_scale):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
        raise TypeError(f"quantize supports {names}; got {x.dtype}")
    if x.ndim == 0:
        raise ValueError("quantize needs at least one dimension (the 16-blocks run along the last)")
    for name, value, allowed in (("scaling", scaling, ("tensor", "row", "static")),
                                 ("block", block, ((1, 16), (16, 16))),
                                 ("rounding", rounding, ("rne", "stochastic")),
                                 ("chain", chain, ("te", "vllm", "torchao"))):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not supported; choose one of {list(allowed)}")
    if block == (16, 16) and scaling == "row":
        raise ValueError("16x16 blocks share one scale across 16 rows: use scaling='tensor' or 'static'")
    if block == (16, 16) and x.ndim < 2:
        raise ValueError("16x16 blocks need a tensor with at least 2 dimensions")
    if (scaling == "static") != (static_scale is not None):
        raise ValueError("static_scale (the decode scale, e.g. calibrated amax / 2688) is required "
                         "with scaling='static' and only then")
    if static_scale is not None:
        s = torch.as_tensor(static_scale, dtype=torch.float32)
        if s.numel() != 1 or not torch.isfinite(s) or s <= 0:
            raise ValueError(f"static_scale must be one positive finite number, got {static_scale!r}")


def _check_finite(x: torch.Tensor) -> None:
    bad = ~torch.isfinite(x)
    n = int(bad.sum())
    if n:
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"quantize got {n} non-finite value(s); first at index {first} "
                         f"(value {x[first].item()}); pass check_finite=False to skip this check")


def _pad_or_raise(x: torch.Tensor, block, pad: bool) -> torch.Tensor:
    k = x.shape[-1]
    rows = x.shape[-2] if block == (16, 16) else 0
    pad_k, pad_r = -k % BLOCK, -rows % BLOCK
    if (pad_k or pad_r) and not pad:
        what = f"last dimension {k}" if pad_k else f"row count {rows} (16x16 blocks)"
        raise ValueError(f"NVFP4 blocks need the {what} divisible by 16; pass pad=True to zero-pad "
                         "(dequantize trims back to the original shape)")
    if not (pad_k or pad_r):
        return x
    return torch.nn.functional.pad(x, (0, pad_k, 0, pad_r) if block == (16, 16) else (0, pad_k))
