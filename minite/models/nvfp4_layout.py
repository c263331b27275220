"""Where a model's NVFP4 weights sit in a Hugging Face checkpoint: one entry per checkpoint module.

A decoder layer's projections (`DecoderLayer.quantizable_modules()`) map through
`minite.models.hf_layout.hf_pieces`: a `Linear` is one Hugging Face linear, a `SegmentedLinear`
(q|k|v, gate|up) one per segment (each segment is its own quantized weight), and MoE experts, held
fused per layer (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I], one global scale per expert and
tensor), one per expert and projection (`model.layers.{l}.mlp.experts.{e}.gate_proj`, `up_proj`: rows
[0, I) and [I, 2I) of expert e's gate_up; `down_proj`). The export and the import walk these entries;
neither names a parameter by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from minite.models.hf_layout import hf_pieces
from minite.nn.linear import SegmentedLinear
from minite.nn.moe import EXPERT_WEIGHTS, MoEExperts


@dataclass(frozen=True)
class CheckpointModule:
    name: str  # the Hugging Face module, e.g. model.layers.0.mlp.experts.3.up_proj
    module: nn.Module  # our Linear, SegmentedLinear or MoEExperts
    param: str  # our parameter's full name, e.g. layers.0.mlp.gate_up_proj
    leaf: str  # the parameter's attribute on `module`: weight, gate_up_proj, down_proj
    part: int | None  # the segment (SegmentedLinear) or expert (MoE) it belongs to; None for a Linear
    rows: slice  # its rows of that quantized weight (a segment's, an expert's, the Linear's)

    @property
    def input_scale_buffer(self) -> str:
        """The module's attribute holding the calibrated static input scale (fp32 [] or None)."""
        if isinstance(self.module, MoEExperts):
            return f"{self.leaf.removesuffix('_proj')}_input_scale"
        return "input_scale"

    def quantized_weight(self):
        """The `QuantizedWeight` this entry's rows belong to (the module's cache: quantized if stale)."""
        if isinstance(self.module, SegmentedLinear):
            return self.module.quantized_weights()[self.part]
        if isinstance(self.module, MoEExperts):
            return self.module.quantized_weight(self.leaf)
        return self.module.quantized_weight()


def checkpoint_modules(model: nn.Module) -> list[CheckpointModule]:
    """Every projection of every decoder layer, quantized or not under the model's recipe."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for layer in model.layers:
        for module in layer.quantizable_modules():
            prefix = names[id(module)]
            leaves = EXPERT_WEIGHTS if isinstance(module, MoEExperts) else ("weight",)
            for leaf in leaves:
                param = f"{prefix}.{leaf}"
                shape = getattr(module, leaf).shape
                pieces = hf_pieces(param, shape, model.config)
                per_part = len(pieces) // shape[0] if isinstance(module, MoEExperts) else 1
                for i, (piece, (rows, _)) in enumerate(pieces):
                    start = (i % per_part) * rows
                    part = None if len(pieces) == 1 and not isinstance(module, MoEExperts) else i // per_part
                    out.append(CheckpointModule(piece.removesuffix(".weight"), module, param, leaf, part,
                                                slice(start, start + rows)))
    return out


def is_quantized(entry: CheckpointModule) -> bool:
    return getattr(entry.module, "recipe", None) is not None and entry.module.recipe.fp4
