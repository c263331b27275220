"""What a user wants to know about one NVFP4 quantization: error, code usage, scale extremes."""

import math

import torch

from minite.nvfp4 import NVFP4Tensor, dequantize, quantize, unpack
from minite.recipe import QuantSpec
from minite.ref.nvfp4 import E2M1_VALUES, E4M3_MAX


def quantize_with_spec(x: torch.Tensor, spec: QuantSpec) -> NVFP4Tensor:
    """Quantize under a recipe operand spec; a static spec is calibrated on x itself (amax / 2688)."""
    kwargs = spec.kwargs()
    if x.ndim < 2:
        kwargs["block"] = (1, 16)  # vectors (biases, norms) have no 16x16 tiles
    if spec.scaling == "static":
        amax = float(x.float().abs().max())
        kwargs["static_scale"] = amax / 2688.0 if amax > 0 else 1.0
    pad = x.shape[-1] % 16 != 0 or (kwargs["block"] == (16, 16) and x.shape[-2] % 16 != 0)
    return quantize(x, pad=pad, **kwargs)


def quant_stats(x: torch.Tensor, q: NVFP4Tensor) -> dict:
    """SQNR (dB), relative error, E2M1 magnitude histogram, share of blocks at scale 0 and at 448."""
    xf = x.float()
    xd = dequantize(q, undo_hadamard=True)
    err = (xd - xf).pow(2).sum().item()
    sig = xf.pow(2).sum().item()
    return {
        "shape": list(x.shape),
        "sqnr_db": 10 * math.log10(sig / err) if err > 0 else math.inf,
        "rel_error": math.sqrt(err / sig) if sig > 0 else 0.0,
        **code_stats(q),
        "bytes_bf16": 2 * x.numel(),
    }


def code_stats(q: NVFP4Tensor) -> dict:
    """What the codes and scales alone say (a stored quantization has no original to compare with):
    E2M1 magnitude histogram, share of blocks at scale 0 and at 448, the global decode scale's range."""
    mags = (unpack(q.codes) & 7).reshape(-1)
    hist = torch.bincount(mags.long(), minlength=8).double()
    sb = q.block_scales.float()
    return {
        "code_histogram": {str(v): float(c) for v, c in zip(E2M1_VALUES, hist / hist.sum())},
        "blocks_at_scale_0": float((sb == 0).float().mean()),
        "blocks_at_scale_448": float((sb == E4M3_MAX).float().mean()),
        "global_scale": [float(q.global_scale.min()), float(q.global_scale.max())],
        "bytes_nvfp4": q.nbytes(),
    }
