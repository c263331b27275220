"""How our parameters map onto Hugging Face checkpoint tensors (the one place), and the error for a
checkpoint that does not match.

Our names are Hugging Face's without the `model.` prefix (`lm_head.weight` as is), except two kinds:
the segmented projections (`layers.{l}.self_attn.qkv_proj.weight` holds `q_proj`, `k_proj`,
`v_proj`'s rows one after the other, `layers.{l}.mlp.gate_up_proj.weight` `gate_proj`'s and
`up_proj`'s) and the MoE experts (`layers.{l}.mlp.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I];
Hugging Face stores `model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight` per expert, and
transformers 5 holds the fused `model.layers.{l}.mlp.experts.gate_up_proj` in memory).
"""

from __future__ import annotations

import re

import torch

from minite.models.config import ModelConfig

EXPERT_PARAM = re.compile(r"^layers\.(\d+)\.mlp\.(gate_up_proj|down_proj)$")
SEGMENTED_PARAM = re.compile(r"^(layers\.\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")
# our segmented projection -> Hugging Face's projections it holds, in row order
SEGMENTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class CheckpointError(ValueError):
    """A checkpoint does not match the model its config.json describes."""


def hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face tensor name (for tensors that map one to one)."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def segment_widths(name: str, config: ModelConfig) -> tuple[int, ...]:
    """The row counts of segmented projection `name`'s segments under `config`."""
    kind = SEGMENTED_PARAM.match(name).group(2)
    if kind == "self_attn.qkv_proj":
        kv = config.num_key_value_heads * config.head_dim
        return (config.num_attention_heads * config.head_dim, kv, kv)
    return (config.intermediate_size, config.intermediate_size)


def segment_pieces(name: str, shape: torch.Size, config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face tensors `(name, shape)` whose rows make up our segmented projection `name`."""
    layer, kind = SEGMENTED_PARAM.match(name).groups()
    return [(f"model.{layer}.{hf}.weight", (n, shape[-1]))
            for hf, n in zip(SEGMENTS[kind], segment_widths(name, config))]


def hf_pieces(name: str, shape: torch.Size, config: ModelConfig, fused_experts: bool = False
              ) -> list[tuple[str, tuple[int, ...]]]:
    """Our tensor `name` [shape] -> the Hugging Face tensors `(name, shape)` it is made of, in order: a
    segmented projection's segments (rows concatenated), the experts' per-expert tensors (stacked;
    `fused_experts`: transformers 5's one fused tensor instead), else the one tensor of `hf_name`."""
    if SEGMENTED_PARAM.match(name):
        return segment_pieces(name, shape, config)
    if EXPERT_PARAM.match(name):
        return [(fused_expert_name(name), tuple(shape))] if fused_experts else expert_pieces(name, shape)
    return [(hf_name(name), tuple(shape))]


def hf_tensors(name: str, tensor: torch.Tensor, config: ModelConfig, fused_experts: bool = False
               ) -> dict[str, torch.Tensor]:
    """Our tensor `name` as the Hugging Face tensors of `hf_pieces` (views of `tensor`)."""
    pieces = hf_pieces(name, tensor.shape, config, fused_experts)
    if SEGMENTED_PARAM.match(name):
        parts = tensor.split([shape[0] for _, shape in pieces])
    elif len(pieces) > 1:  # per-expert tensors
        split = (lambda t: t.chunk(2, dim=0)) if "gate_up" in name else (lambda t: (t,))
        parts = [t for expert in tensor for t in split(expert)]
    else:
        parts = [tensor]
    return {hf: t for (hf, _), t in zip(pieces, parts, strict=True)}


def from_hf_pieces(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `hf_tensors`: our tensor `name` from its Hugging Face pieces, in order."""
    if len(parts) == 1:
        return parts[0]
    if SEGMENTED_PARAM.match(name):
        return torch.cat(parts)
    per_expert = 2 if name.endswith("gate_up_proj") else 1
    return torch.stack([torch.cat(parts[e:e + per_expert]) for e in range(0, len(parts), per_expert)])


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


