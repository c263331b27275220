"""Model shape and hyper-parameters for Qwen3 (dense) and Qwen3-MoE, read from a Hugging Face config.json.

`ModelConfig.from_hf(dict)` accepts the fields written by transformers 4.x and 5.x for
`Qwen3ForCausalLM` and `Qwen3MoeForCausalLM` and rejects what the models here do not implement
(rope scaling, sliding-window attention, attention bias, activations other than SiLU) with an error
naming the field. `to_hf()` writes a config.json that both transformers generations read back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DENSE = "Qwen3ForCausalLM"
MOE = "Qwen3MoeForCausalLM"
MODEL_TYPES = {DENSE: "qwen3", MOE: "qwen3_moe"}


class UnsupportedConfigError(ValueError):
    """A config.json field names an architecture or option these models do not implement."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str = DENSE
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in MODEL_TYPES:
            raise UnsupportedConfigError(
                f"architectures={self.architecture!r} is not supported; choose one of {list(MODEL_TYPES)}")
        positive = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim"]
        if self.is_moe:
            positive += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"]
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise UnsupportedConfigError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.is_moe and self.num_experts_per_tok > self.num_experts:
            raise UnsupportedConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        for layer in self.mlp_only_layers:
            if not 0 <= layer < self.num_hidden_layers:
                raise UnsupportedConfigError(f"mlp_only_layers contains {layer}, outside the model's layers")

    @property
    def is_moe(self) -> bool:
        return self.architecture == MOE

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse MoE block (else a dense SwiGLU MLP)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Parse a Hugging Face config.json dict; raises `UnsupportedConfigError` naming the field."""
        arch = _architecture(hf)
        _reject_unsupported(hf)
        heads = _required(hf, "num_attention_heads")
        fields = dict(
            architecture=arch,
            vocab_size=_required(hf, "vocab_size"),
            hidden_size=_required(hf, "hidden_size"),
            intermediate_size=_required(hf, "intermediate_size"),
            num_hidden_layers=_required(hf, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or _default_head_dim(hf, heads),
            rope_theta=_number("rope_theta", _rope_theta(hf)),
            rms_norm_eps=_number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_ids(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
        )
        if arch == MOE:
            experts = hf.get("num_experts", hf.get("num_local_experts"))
            if experts is None:
                raise UnsupportedConfigError("config.json lacks num_experts (or num_local_experts)")
            fields.update(
                num_experts=experts,
                num_experts_per_tok=_required(hf, "num_experts_per_tok"),
                moe_intermediate_size=_required(hf, "moe_intermediate_size"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            )
        return cls(**fields)

    def to_hf(self, dtype: torch.dtype | None = None) -> dict:
        """A config.json dict in the legacy field names that transformers 4.x and 5.x both read."""
        hf = dict(
            architectures=[self.architecture],
            model_type=MODEL_TYPES[self.architecture],
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            rope_theta=self.rope_theta,
            rope_scaling=None,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            attention_bias=False,
            attention_dropout=0.0,
            use_sliding_window=False,
            sliding_window=None,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(eos) if isinstance(eos := self.eos_token_id, tuple) else eos,
            pad_token_id=self.pad_token_id,
        )
        if self.is_moe:
            hf.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                      moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                      decoder_sparse_step=self.decoder_sparse_step,
                      mlp_only_layers=list(self.mlp_only_layers))
        if dtype is not None:
            hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        return hf


def tiny_qwen3(**changes) -> ModelConfig:
    """A 2-layer dense Qwen3 for CPU tests (GQA ratio 2, untied head)."""
    base = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                       max_position_embeddings=256, eos_token_id=1)
    return base.replace(**changes)


def tiny_qwen3_moe(**changes) -> ModelConfig:
    """A 2-layer Qwen3-MoE for CPU tests (4 experts, top-2, GQA ratio 2)."""
    base = tiny_qwen3(architecture=MOE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return base.replace(**changes)


def _architecture(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in MODEL_TYPES:
            return arch
    if archs:
        raise UnsupportedConfigError(
            f"architectures={archs!r} is not supported; choose one of {list(MODEL_TYPES)}")
    by_type = {v: k for k, v in MODEL_TYPES.items()}
    if hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise UnsupportedConfigError(
        f"model_type={hf.get('model_type')!r} (no architectures field) is not supported; "
        f"choose one of {list(by_type)}")


def _reject_unsupported(hf: dict) -> None:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfigError(f"hidden_act={hf['hidden_act']!r} is not supported; only 'silu'")
    if hf.get("attention_bias", False):
        raise UnsupportedConfigError("attention_bias=true is not supported")
    if hf.get("use_sliding_window", False):
        raise UnsupportedConfigError("use_sliding_window=true is not supported")
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedConfigError(f"layer_types={layer_types!r}: only 'full_attention' is supported")
    if hf.get("rope_scaling"):
        raise UnsupportedConfigError(f"rope_scaling={hf['rope_scaling']!r} is not supported")
    params = hf.get("rope_parameters") or {}
    if params.get("rope_type", "default") != "default":
        raise UnsupportedConfigError(f"rope_parameters.rope_type={params['rope_type']!r} is not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError("rope_parameters.partial_rotary_factor != 1 is not supported")


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise UnsupportedConfigError("config.json lacks rope_theta (or rope_parameters.rope_theta)")
    return theta


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UnsupportedConfigError(f"{name}={value!r} must be a number")
    return float(value)


def _default_head_dim(hf: dict, heads):
    """hidden_size // num_attention_heads, left to the field checks when either is not an integer."""
    hidden = _required(hf, "hidden_size")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None


def _required(hf: dict, name: str):
    if name not in hf or hf[name] is None:
        raise UnsupportedConfigError(f"config.json lacks the required field {name!r}")
    return hf[name]


def _ids(value):
    return tuple(value) if isinstance(value, list) else value
