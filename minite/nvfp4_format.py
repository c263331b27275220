"""The NVFP4 format: E2M1 grid, packing, the `NVFP4Tensor` container, decode, and the argument checks.

Codes: 4 bits per element, bit 3 the sign, bits 0-2 an index into `E2M1_VALUES`; two codes per byte,
the even element in the low nibble. One E4M3 block scale s_b per 16 elements along the last dimension
(for 16x16 blocks the 16 rows of a tile repeat it) and an fp32 global decode scale S_dec, so
x ~= e2m1 * s_b * S_dec.

This module sits below `minite.ref` and `minite.kernels`, which build containers and check their
arguments here; `minite.nvfp4` is the public API on top of all three. It imports only the RHT
(`minite.ref.hadamard`, a leaf), which `dequantize` undoes on request.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minite.ref.hadamard import apply_rht

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
BLOCK = 16
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15, unpacked) -> fp32 values, from the code's bits (no table copied to the
    device: this also runs inside a CUDA graph capture): magnitude m * 0.5 below 2, else
    2^(e - 1) * (1 + 0.5 * mantissa) with e = m >> 1."""
    m = (codes & 7).float()
    e = torch.floor(m * 0.5)
    mag = torch.where(m < 2, m * 0.5, torch.exp2(e - 1) * (1 + 0.5 * (m - 2 * e)))
    return torch.where((codes & 8) != 0, -mag, mag)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] (values 0..15, K even) -> [..., K // 2]; even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K // 2] -> codes [..., K]."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


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
        return e2m1_decode(unpack(self.codes))

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


def dequantize(q: NVFP4Tensor, undo_hadamard: bool = False) -> torch.Tensor:
    """fp32 values e2m1 * s_b * S_dec in the original shape. With hadamard=True the values stay in
    the rotated domain (what a GEMM consumes) unless undo_hadamard=True."""
    x = q.unscaled() * q.global_scale
    if q.hadamard and undo_hadamard:
        x = apply_rht(x, inverse=True)
    return x[tuple(slice(0, n) for n in q.shape)]


def check_quantize_args(x, scaling, block, rounding, chain, static_scale) -> None:
    """Raise TypeError / ValueError, naming the offending value, for arguments `quantize` cannot take."""
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


def require_finite(x: torch.Tensor) -> None:
    """Raise ValueError with the count and first index of x's non-finite values (a host sync on CUDA)."""
    bad = ~torch.isfinite(x)
    n = int(bad.sum())
    if n:
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"quantize got {n} non-finite value(s); first at index {first} "
                         f"(value {x[first].item()}); pass check_finite=False to skip this check")


def pad_to_blocks(x: torch.Tensor, block, pad: bool) -> torch.Tensor:
    """x zero-padded to whole blocks (pad=True); without `pad`, ValueError unless it already is."""
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
