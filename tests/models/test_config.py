"""ModelConfig parsing of transformers config.json dicts and its errors."""

import re

import pytest
import transformers

from minite.models.config import ModelConfig, UnsupportedConfigError, tiny_qwen3, tiny_qwen3_moe
from tests.models.hf_helpers import hf_config

ROUND_TRIP = [tiny_qwen3(tie_word_embeddings=True), tiny_qwen3_moe(mlp_only_layers=(1,))]


@pytest.mark.parametrize("config", ROUND_TRIP, ids=["dense", "moe"])
def test_round_trip_through_transformers_config(config):
    written = hf_config(config).to_dict()
    assert ModelConfig.from_hf(written) == config


def test_reads_transformers_defaults_and_legacy_fields():
    moe = ModelConfig.from_hf(transformers.Qwen3MoeConfig().to_dict())
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (128, 8, False)
    legacy = tiny_qwen3().to_hf() | {"rope_parameters": None, "rope_theta": 5e5}
    assert ModelConfig.from_hf(legacy).rope_theta == 5e5
    no_head_dim = {k: v for k, v in tiny_qwen3().to_hf().items() if k != "head_dim"}
    assert ModelConfig.from_hf(no_head_dim).head_dim == 64 // 4


def test_moe_layer_selection():
    config = tiny_qwen3_moe(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not any(tiny_qwen3().is_moe_layer(i) for i in range(2))


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
    ({"use_sliding_window": True, "sliding_window": 128}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"vocab_size": None}, "vocab_size"),
    ({"head_dim": 15}, "head_dim"),
])
def test_unsupported_fields_are_named(change, field):
    with pytest.raises(UnsupportedConfigError, match=field):
        ModelConfig.from_hf(tiny_qwen3().to_hf() | change)


def test_moe_errors_name_the_field():
    hf = tiny_qwen3_moe().to_hf()
    with pytest.raises(UnsupportedConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf(hf | {"num_experts_per_tok": 9})
    with pytest.raises(UnsupportedConfigError, match="num_experts"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_experts"})
    with pytest.raises(UnsupportedConfigError, match="mlp_only_layers"):
        ModelConfig.from_hf(hf | {"mlp_only_layers": [5]})


@pytest.mark.parametrize("field,value,message", [
    ("rope_theta", "big", "rope_theta='big' must be a number"),
    ("rms_norm_eps", None, "rms_norm_eps=None must be a number"),
    ("hidden_size", "64", "hidden_size='64' must be a positive integer"),
    ("num_attention_heads", 0, "num_attention_heads=0 must be a positive integer"),
])
def test_bad_field_values_are_named(field, value, message):
    hf = {k: v for k, v in tiny_qwen3().to_hf().items() if k != "head_dim"} | {field: value}
    with pytest.raises(UnsupportedConfigError, match=re.escape(message)):
        ModelConfig.from_hf(hf)
