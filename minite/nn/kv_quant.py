"""Keys and values as the recipe's KV format (`Recipe.kv_cache`) stores them: one quantizer
(`minite.ref.kv_quant`, or its kernel `minite.kernels.kv_quant` with the same bits) for the sampler's
cache writes and the learner's forward.

`quantize_kv` picks the kernel where the execution runs element-wise kernels, else the reference.
`fake_quantize_kv` is the learner's reference path: k or v replaced by the values it dequantizes to
(in its dtype), the gradient passed straight through (as if the quantization were the identity).
"""

from __future__ import annotations

import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.ref import kv_quant as ref
from minite.ref.kv_quant import QuantizedKV


def quantize_kv(x: torch.Tensor, kv_format: str, execution: Execution = DEFAULT,
                out: QuantizedKV | None = None, slots: torch.Tensor | None = None) -> QuantizedKV:
    """x `[N, H, D]` -> its `QuantizedKV`; with `out` and `slots` `[N]`, row n stored at out[slots[n]]."""
    if execution.elementwise_kernels(x) and x.shape[-1] & (x.shape[-1] - 1) == 0:
        return lazy.kv_quant.quantize_kv(x, kv_format, out, slots)
    q = ref.quantize_kv(x, kv_format)
    if out is None:
        return q
    out.store(slots, q)
    return out


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kv_format, execution):
        flat = x.reshape(-1, *x.shape[-2:])
        return quantize_kv(flat, kv_format, execution).dequantize(x.dtype).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def fake_quantize_kv(x: torch.Tensor, kv_format: str, execution: Execution = DEFAULT) -> torch.Tensor:
    """x `[..., H, D]` -> the values its `kv_format` stores, dequantized to x's dtype (x itself for
    bf16); straight-through gradient."""
    if kv_format == "bf16":
        return x
    return _FakeQuantize.apply(x, kv_format, execution)
