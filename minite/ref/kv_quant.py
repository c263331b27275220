"""Reference quantizer of attention keys and values (the KV cache formats), in plain PyTorch: the
numerics contract of `minite.kernels.kv_quant` and of the attention kernels that read it.

Every (token, kv head) row of D values (k after RoPE, or v) is quantized on its own, so a token's
stored bits never depend on its batch, and the sampler's cache and the learner's forward hold the
same numbers. All arithmetic is fp32, IEEE round-to-nearest-even, one rounding per step.

- `fp8`: s = fl32(amax / 448) (s = 1 where amax = 0); payload = E4M3 RNE of fl32(x / s), clamped to
  +-448 first. Stored: payload `[..., Hkv, D]` float8_e4m3fn and scale `[..., Hkv]` fp32 (= s).
- `nvfp4`: the row is one NVFP4 row of `minite.ref.nvfp4` (row scaling, 1x16 blocks, RNE, the `te`
  chain): E2M1 codes packed two per byte (even element in the low nibble), one E4M3 block scale per
  16 values, and the row's fp32 decode scale S_dec. Stored: payload `[..., Hkv, D // 2]` uint8,
  block_scales `[..., Hkv, D // 16]` float8_e4m3fn, scale `[..., Hkv]` fp32 (= S_dec).

Each row is `exact * scale`: `exact` (fp8: the E4M3 value; nvfp4: e2m1 * s_b) is exact in bf16 and
fp16 (at most 6 significant bits, magnitudes in [2^-10, 2688]), so attention can run its bf16 MMA on
it and fold the fp32 `scale` into the scores and probabilities (`minite.ref.attention`).
`dequantize` is fl(exact * scale) in the requested dtype: what a path that cannot fold reads.

Bytes per token, per layer (keys and values): bf16 `4 * Hkv * D`; fp8 `2 * Hkv * (D + 4)`; nvfp4
`2 * Hkv * (D / 2 + D / 16 + 4)`. At D = 128: 512, 264, 152 bytes per kv head (1.94x, 3.37x).

Non-finite inputs are outside the contract (attention keys and values are finite).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from minite.nvfp4_format import BLOCK, e2m1_decode, pack, unpack
from minite.ref.nvfp4 import E4M3_MAX, quantize_ref

KV_FORMATS = ("bf16", "fp8", "nvfp4")  # bf16: unquantized, the model dtype
SCALE_BYTES = 4


@dataclass(frozen=True)
class QuantizedKV:
    """Quantized keys or values: `payload`, per-row `scale` and (nvfp4) `block_scales`, all indexed
    alike over the leading dimensions (`kv[layer]`, `kv[slots]` index every field)."""

    format: str
    payload: torch.Tensor  # [..., H, D] float8_e4m3fn (fp8) or [..., H, D // 2] uint8 (nvfp4)
    scale: torch.Tensor  # [..., H] float32
    block_scales: torch.Tensor | None = None  # [..., H, D // 16] float8_e4m3fn (nvfp4)

    @property
    def head_dim(self) -> int:
        return self.payload.shape[-1] * (2 if self.format == "nvfp4" else 1)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the values it stands for: `[..., H, D]`."""
        return (*self.payload.shape[:-1], self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.payload.device

    def fields(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.payload, self.scale, self.block_scales) if t is not None)

    def __getitem__(self, index) -> QuantizedKV:
        bs = None if self.block_scales is None else self.block_scales[index]
        return replace(self, payload=self.payload[index], scale=self.scale[index], block_scales=bs)

    def flatten(self, start: int, end: int) -> QuantizedKV:
        """The leading dimensions start..end (non-negative, before the head dimension) merged."""
        bs = None if self.block_scales is None else self.block_scales.flatten(start, end)
        return replace(self, payload=self.payload.flatten(start, end), scale=self.scale.flatten(start, end),
                       block_scales=bs)

    def store(self, index: torch.Tensor, src: QuantizedKV) -> None:
        """self[index] = src, field by field (an index into the first dimension)."""
        for dst, s in zip(self.fields(), src.fields()):
            dst[index] = s

    def exact(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The unscaled values `[..., H, D]` (fp8: the E4M3 values; nvfp4: e2m1 * s_b), exact in `dtype`
        (bf16, fp16 or fp32)."""
        if self.format == "fp8":
            return self.payload.to(dtype)
        v = e2m1_decode(unpack(self.payload))  # [..., H, D] fp32
        lead = v.shape[:-1]
        sb = self.block_scales.float().unsqueeze(-1)
        return (v.reshape(*lead, -1, BLOCK) * sb).reshape(v.shape).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """fl(exact * scale) `[..., H, D]` in `dtype`."""
        return (self.exact() * self.scale.unsqueeze(-1)).to(dtype)


def check_format(kv_format: str) -> None:
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_cache={kv_format!r} is not supported; choose one of {list(KV_FORMATS)}")


def check_input(x: torch.Tensor, kv_format: str) -> None:
    """ValueError / TypeError, naming the value, for what `quantize_kv` cannot take."""
    check_format(kv_format)
    if kv_format == "bf16":
        raise ValueError("kv_cache='bf16' keeps keys and values unquantized: there is nothing to quantize")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_kv takes fp32/bf16/fp16 keys or values, got {x.dtype}")
    D = x.shape[-1] if x.ndim else 0
    if x.ndim < 2 or D < 16 or D % 16:
        raise ValueError(f"quantize_kv needs [..., H, D] with D a multiple of 16, got {tuple(x.shape)}")


def quantize_kv(x: torch.Tensor, kv_format: str) -> QuantizedKV:
    """x `[..., H, D]` (fp32 / bf16 / fp16) -> its `QuantizedKV` (the module docstring's contract)."""
    check_input(x, kv_format)
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # [..., H]
    if kv_format == "fp8":
        # a divisor of amax's shape: torch on CUDA multiplies by the reciprocal of a 0-d CPU divisor
        s = torch.where(amax == 0, 1.0, amax / torch.full_like(amax, E4M3_MAX))
        payload = torch.clamp(xf / s.unsqueeze(-1), -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return QuantizedKV("fp8", payload, s)
    codes, sb, s_dec, _ = quantize_ref(xf, "row", (1, 16), "rne", "te", None, False, None)
    return QuantizedKV("nvfp4", pack(codes), s_dec.squeeze(-1), sb)


def zeros(kv_format: str, lead: tuple[int, ...], num_heads: int, head_dim: int, device) -> QuantizedKV:
    """A zeroed `QuantizedKV` `[*lead, num_heads, head_dim]` of `kv_format` (fp8 / nvfp4)."""
    shape = (*lead, num_heads)
    scale = torch.zeros(shape, device=device)
    if kv_format == "fp8":
        payload = torch.zeros((*shape, head_dim), dtype=torch.float8_e4m3fn, device=device)
        return QuantizedKV("fp8", payload, scale)
    return QuantizedKV("nvfp4", torch.zeros((*shape, head_dim // 2), dtype=torch.uint8, device=device), scale,
                       torch.zeros((*shape, head_dim // BLOCK), dtype=torch.float8_e4m3fn, device=device))


def bytes_per_token(kv_format: str, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's keys and values take in one layer's cache."""
    check_format(kv_format)
    if kv_format == "bf16":
        per_row = head_dim * torch.empty((), dtype=dtype).element_size()
    elif kv_format == "fp8":
        per_row = head_dim + SCALE_BYTES
    else:
        per_row = head_dim // 2 + head_dim // BLOCK + SCALE_BYTES
    return 2 * num_kv_heads * per_row
