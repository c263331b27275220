"""Reference NVFP4 quantizer in plain PyTorch (CPU or GPU, no Triton): the numerics contract.

Format: E2M1 codes (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign), one unsigned E4M3 block
scale s_b per 16 elements along K (or per 16x16 tile), and an fp32 global decode scale S_dec
(per tensor, or per row). Decode: x ~= e2m1 * s_b * S_dec. All arithmetic below is fp32, IEEE
round-to-nearest-even, each step one rounding, in the order written.

Scale chains, with amax the max |x| of the scaling group, r6 = fl32(1/6):

- te (default, Transformer Engine):
  S_enc = 2688/amax, S_dec = 1/S_enc; s_b = e4m3(bamax * (S_enc * r6)); e = min(1/(s_b * S_dec), FLT_MAX)
- vllm (FlashInfer):
  S_dec = amax/2688, S_enc = 1/S_dec; s_b = e4m3(S_enc * (bamax * r6)); e = s_b ? 1/(s_b * (1/S_enc)) : 0
- torchao:
  S_dec = amax/2688, S_enc = 1/S_dec; s_b = e4m3(max((bamax/6)/S_dec, 2^-6)); e = (1/S_dec)/s_b

Guards (all chains): S_enc overflowing to inf becomes FLT_MAX; amax == 0 (or S_enc == 0) gives
S_enc = S_dec = 1. Block scales saturate at 448 (clamped before the RNE cast, since torch's e4m3 cast
overflows to NaN) and underflow to E4M3 subnormals or 0 (no floor, except torchao's 2^-6).
With `scaling="static"`, the given decode scale s replaces amax: te uses S_enc = 1/s, S_dec = 1/S_enc;
vllm and torchao use S_dec = s, S_enc = 1/s. vllm's hardware reciprocals are approximate (MUFU.RCP);
we emulate them with IEEE reciprocals, so `vllm` reproduces its association order and its zero-scale
rule, not MUFU's last-ulp behaviour.

Element rounding: E2M1 RNE with saturation at 6 (ties 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
3.5->4, 5->4), or stochastic rounding between the two neighbouring grid points (unbiased below 6).
The sign bit is the sign of x (that of x * e, e >= 0), so small negatives give the code -0 (8), as the
hardware cvt does. A NaN x * e (0 * inf, where a vllm/torchao element scale overflows in a row of
subnormals; or a NaN input) saturates to magnitude 7, as the GPU's min and the cvt's satfinite do.

RHT (`hadamard=True`): x is rotated first (`minite.ref.hadamard`: TE's transform, rounded to x's
dtype as TE rounds it), then quantized as above.

Bit-exact contract for kernels: codes, block scales and global scales of RNE quantization equal this
reference bit for bit, with or without the RHT (the kernels rotate with the same function).
Stochastic rounding (a different random stream) is matched in distribution, not bitwise.
"""

import torch

from minite.nvfp4_format import E2M1_VALUES
from minite.ref.hadamard import apply_rht

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
FLT_MAX = torch.finfo(torch.float32).max
TE_AMAX_TO_SCALE = 2688.0  # 6 * 448

# Thresholds on |v| for E2M1 round-to-nearest-even: strict ">" where the tie goes down to an even
# mantissa, ">=" where it goes up.
_RNE_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_RNE_UP_INCL = (0.75, 1.75, 3.5)


def _f32(v: float, device) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=device)


def global_scales(amax: torch.Tensor, chain: str, static: bool = False):
    """(S_enc, S_dec), fp32, same shape as amax. With static=True, `amax` holds the decode scale."""
    one = _f32(1.0, amax.device)
    if chain == "te":
        s_enc = one / amax if static else _f32(TE_AMAX_TO_SCALE, amax.device) / amax
        s_enc = torch.where(torch.isinf(s_enc), _f32(FLT_MAX, amax.device), s_enc)
        s_enc = torch.where((amax == 0) | (s_enc == 0), one, s_enc)
        return s_enc, one / s_enc
    s_dec = amax if static else amax / _f32(TE_AMAX_TO_SCALE, amax.device)
    s_enc = one / s_dec
    s_enc = torch.where(torch.isinf(s_enc), _f32(FLT_MAX, amax.device), s_enc)
    bad = (amax == 0) | (s_enc == 0) | (s_dec == 0)
    return torch.where(bad, one, s_enc), torch.where(bad, one, s_dec)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 >= 0 -> float8_e4m3fn, RNE, saturating at 448 (subnormals kept, underflow to 0)."""
    return torch.clamp(v, max=E4M3_MAX).to(torch.float8_e4m3fn)


def block_scales(bamax: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor, chain: str):
    """Block amax [..., nb] fp32 and broadcastable global scales -> E4M3 block scales [..., nb]."""
    r6 = _f32(1.0 / 6.0, bamax.device)
    if chain == "te":
        return to_e4m3(bamax * (s_enc * r6))
    if chain == "vllm":
        return to_e4m3(s_enc * (bamax * r6))
    raw = (bamax / _f32(6.0, bamax.device)) / s_dec
    return to_e4m3(torch.clamp(raw, min=E4M3_MIN_NORMAL))


def element_scales(sb: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor, chain: str):
    """E4M3 block scales -> the fp32 factor each element of the block is multiplied by."""
    sb = sb.float()
    one = _f32(1.0, sb.device)
    if chain == "te":
        return torch.clamp(one / (sb * s_dec), max=FLT_MAX)
    if chain == "vllm":
        return torch.where(sb == 0, _f32(0.0, sb.device), one / (sb * (one / s_enc)))
    return (one / s_dec) / sb


def e2m1_rne(v: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 v = x * e -> E2M1 codes (uint8, 0..15), round-to-nearest-even, saturating at +-6 (NaN too),
    the sign bit that of x (of v when x is not given)."""
    a = v.abs()
    idx = torch.zeros_like(a, dtype=torch.uint8)
    for t in _RNE_UP_STRICT:
        idx += (a > t).to(torch.uint8)
    for t in _RNE_UP_INCL:
        idx += (a >= t).to(torch.uint8)
    idx = torch.where(torch.isnan(a), 7, idx).to(torch.uint8)
    return idx | (torch.signbit(v if x is None else x).to(torch.uint8) << 3)


def e2m1_stochastic(v: torch.Tensor, generator: torch.Generator | None, x: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """fp32 -> E2M1 codes rounding |v| up with probability (|v| - lo) / (hi - lo); saturates at 6."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    a = v.abs().clamp(max=6.0)
    lo = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)
    hi = (lo + 1).clamp(max=7)
    gap = grid[hi] - grid[lo]
    p = torch.where(gap > 0, (a - grid[lo]) / torch.where(gap > 0, gap, 1.0), 0.0)
    u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
    idx = torch.where(u < p, hi, lo).to(torch.uint8)
    return idx | (torch.signbit(v if x is None else x).to(torch.uint8) << 3)


def quantize_ref(x: torch.Tensor, scaling: str, block: tuple[int, int], rounding: str, chain: str,
                 static_scale, hadamard: bool, generator):
    """Validated, padded x [..., R, K] -> (codes [..., K] unpacked uint8, block scales e4m3
    [..., K // 16] (16x16 tiles: repeated over the tile's 16 rows), S_dec, amax).

    S_dec and amax are fp32 [] (tensor, static) or [..., R, 1] (row).
    """
    xf = (apply_rht(x) if hadamard else x).float()
    if scaling == "static":
        s = torch.as_tensor(static_scale, dtype=torch.float32, device=x.device)
        amax = s * _f32(TE_AMAX_TO_SCALE, x.device)
        s_enc, s_dec = global_scales(s, chain, static=True)
    else:
        amax = xf.abs().amax(dim=-1, keepdim=True) if scaling == "row" else xf.abs().amax()
        s_enc, s_dec = global_scales(amax, chain)
    *lead, rows, k = xf.shape
    if block == (16, 16):
        tiles = xf.reshape(*lead, rows // 16, 16, k // 16, 16)
        bamax = tiles.abs().amax(dim=(-3, -1))  # [..., R // 16, K // 16]
        sb = block_scales(bamax, s_enc, s_dec, chain)
        sb = sb.unsqueeze(-2).expand(*lead, rows // 16, 16, k // 16).reshape(*lead, rows, k // 16)
    else:
        bamax = xf.reshape(*lead, rows, k // 16, 16).abs().amax(dim=-1)
        sb = block_scales(bamax, s_enc, s_dec, chain)
    e = element_scales(sb, s_enc, s_dec, chain)  # [..., R, K // 16]
    v = (xf.reshape(*lead, rows, k // 16, 16) * e.unsqueeze(-1)).reshape(xf.shape)
    codes = e2m1_rne(v, xf) if rounding == "rne" else e2m1_stochastic(v, generator, xf)
    return codes, sb, s_dec, amax
