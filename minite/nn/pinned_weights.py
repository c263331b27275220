"""Quantized weights read from an NVFP4 checkpoint, kept with their parameter and used as they are.

`pin(param, q)` attaches the checkpoint's container (codes, block scales, global scales, amax) to the
parameter tensor itself (which holds the dequantized values). Every module that quantizes that
parameter later (the model's own, a second view of it under another recipe sharing the tensor, the
sampler's) then takes the container instead of quantizing: `pinned(param, spec)`. The pin holds while
the parameter is not updated in place (its autograd version: an optimizer step, `copy_`) and for
specs of the checkpoint's block shape; `model.to(dtype)` keeps it (the same parameter object). A
recipe with another block shape (`te`'s 16x16 on a 1x16 checkpoint) quantizes the dequantized values.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minite.nvfp4 import NVFP4Tensor
from minite.recipe import QuantSpec

_ATTR = "_minite_pinned"


def pin(param: torch.Tensor, q: NVFP4Tensor) -> None:
    """Attach `q` ([N, K] or experts [E, N, K], global [] or [E, 1, 1]) to `param` (same shape)."""
    if tuple(q.shape) != tuple(param.shape):
        raise ValueError(f"pinned container {tuple(q.shape)} does not fit parameter {tuple(param.shape)}")
    setattr(param, _ATTR, (param._version, q))


def pinned(param: torch.Tensor, spec: QuantSpec) -> NVFP4Tensor | None:
    """The pinned container, on the parameter's device, if it still holds for `spec`; else None."""
    entry = getattr(param, _ATTR, None)
    if entry is None:
        return None
    version, q = entry
    if version != param._version or tuple(q.block) != tuple(spec.block) or spec.hadamard:
        return None
    if q.codes.device != param.device:
        q = q.to(param.device)
        setattr(param, _ATTR, (version, q))
    return q if q.chain == spec.chain else replace(q, chain=spec.chain)
