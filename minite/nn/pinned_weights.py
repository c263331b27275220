"""Quantized weights read from an NVFP4 checkpoint, kept with their parameter and used as they are.

`pin(param, containers)` attaches the checkpoint's containers (codes, block scales, global scales,
amax) to the parameter tensor itself, which holds the dequantized values: one container for a
`Linear`'s weight or an MoE layer's experts, one per segment (in row order) for a `SegmentedLinear`.
Every module that quantizes that parameter later (the model's own, a second view of the model under
another recipe sharing the tensor, the sampler's) takes them instead of quantizing: `pinned(param,
spec)`. A pin holds while the parameter is not updated in place (its autograd version: an optimizer
step, `copy_`) and for specs of the checkpoint's block shape without RHT; `model.to(dtype)` keeps it
(the same parameter object). A recipe with another block shape (`te`'s 16x16 on a 1x16 checkpoint)
quantizes the dequantized values.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from minite.nvfp4 import NVFP4Tensor
from minite.recipe import QuantSpec

_ATTR = "_minite_pinned"


def pin(param: torch.Tensor, containers: list[NVFP4Tensor]) -> None:
    """Attach `containers` (their rows, stacked, are `param`'s: [N, K] or experts [E, N, K])."""
    rows = sum(q.shape[-2] for q in containers)
    if tuple(containers[0].shape[:-2]) + (rows, containers[0].shape[-1]) != tuple(param.shape):
        raise ValueError(f"pinned containers {[tuple(q.shape) for q in containers]} do not fit parameter "
                         f"{tuple(param.shape)}")
    setattr(param, _ATTR, (param._version, list(containers)))


def pinned(param: torch.Tensor, spec: QuantSpec) -> list[NVFP4Tensor] | None:
    """The pinned containers, on the parameter's device, if they still hold for `spec`; else None."""
    entry = getattr(param, _ATTR, None)
    if entry is None:
        return None
    version, qs = entry
    if version != param._version or tuple(qs[0].block) != tuple(spec.block) or spec.hadamard:
        return None
    if qs[0].codes.device != param.device:
        qs = [q.to(param.device) for q in qs]
        setattr(param, _ATTR, (version, qs))
    return [q if q.chain == spec.chain else replace(q, chain=spec.chain) for q in qs]
