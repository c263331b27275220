"""A sampler-only model built part by part (`minite.models.sampler_model`): the same model as the
full one turned into its sampler form, from random init, a state, a Hugging Face directory."""

import pytest
import torch

from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.models.checkpoint import save_pretrained
from minite.models.sampler_model import (
    build_sampler_model,
    load_sampler_model,
    random_fill,
    sampler_model_from,
    state_fill,
)
from minite.nn.sampler_weights import is_sampler_only, to_sampler_weights

CONFIGS = {"dense": tiny_qwen3, "moe": tiny_qwen3_moe}


def full_model(kind: str, seed: int) -> Qwen3:
    model = Qwen3(CONFIGS[kind](), "aligned").to(torch.bfloat16)
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_source_gives_the_full_models_logits(kind, tmp_path):
    full = full_model(kind, 3)
    ids = torch.randint(0, full.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    save_pretrained(full, tmp_path / "hf")
    seen = []
    models = {
        "random": build_sampler_model(full.config, "aligned", random_fill(3), progress=seen.append),
        "state": build_sampler_model(full.config, "aligned", state_fill(full.state_dict())),
        "checkpoint": load_sampler_model(tmp_path / "hf", "aligned"),
    }
    with torch.no_grad():
        want = full(ids)
        models["moved"] = sampler_model_from(full_model(kind, 3), "cpu")
        for name, model in models.items():
            assert is_sampler_only(model), name
            assert torch.equal(model(ids), want), name
        assert torch.equal(to_sampler_weights(full)(ids), want)
    assert len(seen) == full.config.num_hidden_layers + 3 and seen[-1].endswith(f"({len(seen)}/{len(seen)})")


def test_a_state_that_does_not_fit_is_named():
    full = full_model("dense", 0)
    state = dict(full.state_dict())
    state.pop("layers.1.mlp.down_proj.weight")
    with pytest.raises(KeyError, match="layers.1.mlp.down_proj.weight"):
        build_sampler_model(full.config, "aligned", state_fill(state))
    state["layers.1.mlp.down_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj.weight"):
        build_sampler_model(full.config, "aligned", state_fill(state))


def test_a_sampler_only_model_is_not_saved_as_weights(tmp_path):
    from minite.models.hf_layout import CheckpointError

    with pytest.raises(CheckpointError, match="sampler-only"):
        save_pretrained(to_sampler_weights(full_model("dense", 0)), tmp_path / "m")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_peak_is_the_sampler_form_plus_one_layer():
    """Qwen3-30B-A3B layers (8 of 48) built part by part: the allocator's peak stays within one
    decoder layer's bf16 weights (plus the quantizer's transients: its bf16 values of the layer, two
    more layers' worth at most; 2.84 layers measured on the H200) of
    what the finished model holds."""
    from minite.models.presets import qwen3_30b_a3b
    from minite.nn.memory import memory_by_kind

    config = qwen3_30b_a3b(num_hidden_layers=8)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = build_sampler_model(config, "aligned", random_fill(0, device="cuda"), device="cuda")
    held = torch.cuda.memory_allocated() - base
    with torch.device("meta"):
        layer = sum(p.numel() * 2 for p in Qwen3(config.replace(num_hidden_layers=1)).layers[0].parameters())
    assert torch.cuda.max_memory_allocated() - base <= held + 3 * layer
    assert abs(memory_by_kind(model)["total"] - held) < 0.02 * held
