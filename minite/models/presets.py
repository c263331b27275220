"""Named model shapes with random weights: tiny ones for CPU tests, real shapes for GPU benchmarks.

`model_preset(name, layers=None, **changes)`; `layers` shortens a model (stated in every benchmark
that does it). The real shapes follow the published Qwen3 configs.
"""

from __future__ import annotations

from minite.models.config import MOE, ModelConfig, tiny_qwen3, tiny_qwen3_moe


def qwen3_1_7b(**changes) -> ModelConfig:
    """Qwen3-1.7B: hidden 2048, 28 layers, 16 q / 8 kv heads of 128, FFN 6144, tied embeddings."""
    return ModelConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, eos_token_id=151645).replace(**changes)


def qwen3_30b_a3b(**changes) -> ModelConfig:
    """Qwen3-30B-A3B: hidden 2048, 48 layers, 32 q / 4 kv heads of 128, 128 experts top-8 of FFN 768."""
    return ModelConfig(architecture=MOE, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       norm_topk_prob=True, eos_token_id=151645).replace(**changes)


def tiny_char(**changes) -> ModelConfig:
    """~0.3M-parameter dense Qwen3 for the char tokenizer (its 100 ids; bos 1, eos 2, pad 0): the
    embedded `minite train` default."""
    return tiny_qwen3(vocab_size=100, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      eos_token_id=2, pad_token_id=0, bos_token_id=1).replace(**changes)


MODEL_PRESETS = {
    "tiny-char": tiny_char,
    "tiny-qwen3": tiny_qwen3,
    "tiny-qwen3-moe": tiny_qwen3_moe,
    "qwen3-1.7b": qwen3_1_7b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
}


def model_preset(name: str, layers: int | None = None, **changes) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    if layers is not None:
        changes["num_hidden_layers"] = layers
    return MODEL_PRESETS[name](**changes)
