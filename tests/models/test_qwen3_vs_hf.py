"""Our Qwen3 / Qwen3-MoE logits against transformers' on the same random tiny weights (fp32, bf16 recipe)."""

import pytest
import torch

from minite.models import load_pretrained, tiny_qwen3, tiny_qwen3_moe
from tests.models.hf_helpers import random_hf_model, rel_err

MAX_REL_ERR = 1e-5

CONFIGS = {
    "dense_gqa2_untied": tiny_qwen3(),
    "dense_gqa4_tied": tiny_qwen3(num_key_value_heads=1, tie_word_embeddings=True),
    "moe_normtopk": tiny_qwen3_moe(),
    "moe_no_norm_tied_gqa4": tiny_qwen3_moe(norm_topk_prob=False, tie_word_embeddings=True,
                                            num_key_value_heads=1),
    "moe_sparse_step_mlp_only": tiny_qwen3_moe(num_hidden_layers=3, decoder_sparse_step=2,
                                               mlp_only_layers=(2,)),
}


def _pair(config, tmp_path):
    ref = random_hf_model(config)
    ref.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, recipe="bf16", dtype=torch.float32)
    return ref, ours


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    config = CONFIGS[name]
    ref, ours = _pair(config, tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 11))
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == (2, 11, config.vocab_size) and got.dtype == torch.float32
    assert rel_err(got, expected) < MAX_REL_ERR


def test_position_ids_match_transformers(tmp_path):
    config = tiny_qwen3()
    ref, ours = _pair(config, tmp_path)
    ids = torch.randint(0, config.vocab_size, (1, 7))
    pos = torch.arange(5, 12)[None]
    with torch.no_grad():
        assert rel_err(ours(ids, position_ids=pos), ref(input_ids=ids, position_ids=pos).logits) < MAX_REL_ERR


@pytest.mark.parametrize("config", [tiny_qwen3(), tiny_qwen3_moe()], ids=["dense", "moe"])
def test_packed_sequences_equal_separate(config, tmp_path):
    _, ours = _pair(config, tmp_path)
    lengths = [5, 1, 8]
    seqs = [torch.randint(0, config.vocab_size, (1, n)) for n in lengths]
    cu_seqlens = torch.tensor([0, 5, 6, 14])
    with torch.no_grad():
        packed = ours(torch.cat(seqs, dim=1), cu_seqlens=cu_seqlens)
        separate = torch.cat([ours(s) for s in seqs], dim=1)
    assert rel_err(packed, separate) < MAX_REL_ERR


def test_bf16_model_runs_close_to_fp32(tmp_path):
    config = tiny_qwen3_moe()
    _, ours = _pair(config, tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 6))
    with torch.no_grad():
        ref = ours(ids)
        got = ours.to(torch.bfloat16)(ids)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, ref) < 0.05
