"""How our parameters map onto Hugging Face checkpoint tensors, and the error for one that does not.

Our names are Hugging Face's without the `model.` prefix (`lm_head.weight` as is), except the MoE
experts: we hold `layers.{l}.mlp.gate_up_proj` [E, 2I, H] (gate rows, then up) and `down_proj`
[E, H, I]; Hugging Face stores `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` per
expert (transformers 5 holds the fused `model.layers.{l}.mlp.experts.gate_up_proj` in memory).
"""

from __future__ import annotations

import re

import torch

EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.mlp\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config.json describes."""


def hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face tensor name (for non-expert tensors)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def expert_pieces(name: str, shape: torch.Size) -> list[tuple[str, tuple[int, ...]]]:
    """The per-expert Hugging Face tensors `(name, shape)` that make up our fused expert tensor `name`."""
    layer, kind = EXPERT_PARAM.match(name).groups()
    prefix = f"model.layers.{layer}.mlp.experts"
    if kind == "gate_up_proj":
        E, I2, H = shape
        return [(f"{prefix}.{e}.{proj}.weight", (I2 // 2, H))
                for e in range(E) for proj in ("gate_proj", "up_proj")]
    E, H, I = shape
    return [(f"{prefix}.{e}.down_proj.weight", (H, I)) for e in range(E)]


def fused_expert_name(name: str) -> str:
    """Our fused expert tensor name -> transformers 5's in-memory name for it."""
    layer, kind = EXPERT_PARAM.match(name).groups()
    return f"model.layers.{layer}.mlp.experts.{kind}"
