"""Where a model's NVFP4 weights sit in a Hugging Face checkpoint: one entry per checkpoint module.

A decoder layer's projections (`DecoderLayer.quantizable_modules()`) are Hugging Face linears one to
one (`model.layers.{l}.self_attn.q_proj`, ...). MoE experts are held fused per layer (`gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I], one global scale per expert and tensor) and stored per expert
(`model.layers.{l}.mlp.experts.{e}.gate_proj`, `up_proj`: rows [0, I) and [I, 2I) of expert e's
gate_up; `down_proj`), as in `minite.models.checkpoint`. The export and the import walk these
entries; neither names a parameter by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from minite.models.hf_layout import expert_pieces, hf_name
from minite.nn.linear import Linear
from minite.nn.moe import EXPERT_WEIGHTS, MoEExperts


@dataclass(frozen=True)
class CheckpointModule:
    name: str  # the Hugging Face module, e.g. model.layers.0.mlp.experts.3.up_proj
    module: nn.Module  # our Linear or MoEExperts
    param: str  # our parameter's full name, e.g. layers.0.mlp.gate_up_proj
    leaf: str  # the parameter's attribute on `module`: weight, gate_up_proj, down_proj
    expert: int | None  # the expert (leading index of the parameter) or None
    rows: slice  # the rows of the (expert's) weight this module holds

    @property
    def input_scale_buffer(self) -> str:
        """The module's attribute holding the calibrated static input scale (fp32 [] or None)."""
        return "input_scale" if self.expert is None else f"{self.leaf.removesuffix('_proj')}_input_scale"


def checkpoint_modules(model: nn.Module) -> list[CheckpointModule]:
    """Every projection of every decoder layer, quantized or not under the model's recipe."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for layer in model.layers:
        for module in layer.quantizable_modules():
            prefix = names[id(module)]
            if isinstance(module, Linear):
                n = module.weight.shape[0]
                out.append(CheckpointModule(hf_name(prefix), module, f"{prefix}.weight", "weight", None,
                                            slice(0, n)))
            elif isinstance(module, MoEExperts):
                for leaf in EXPERT_WEIGHTS:
                    param = f"{prefix}.{leaf}"
                    shape = getattr(module, leaf).shape
                    pieces = expert_pieces(param, shape)
                    per_expert = len(pieces) // shape[0]
                    for i, (piece, (rows, _)) in enumerate(pieces):
                        start = (i % per_expert) * rows
                        out.append(CheckpointModule(piece.removesuffix(".weight"), module, param, leaf,
                                                    i // per_expert, slice(start, start + rows)))
    return out


def is_quantized(entry: CheckpointModule) -> bool:
    return getattr(entry.module, "recipe", None) is not None and entry.module.recipe.fp4
