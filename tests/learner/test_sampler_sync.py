"""The naive deployment's sampler-only model: the sync quantizes the learner's weights straight into
its containers, calibration runs through the learner's forward; the same numbers as a full sampler
model fed by copying the weights."""

import pytest
import torch

from minite.learner.weight_sync import sync_sampler_model
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.models.sampler_model import build_sampler_model, state_fill
from minite.nn.calibrate import calibrate, calibrate_through, static_scales
from minite.nn.memory import quantized_weights_held
from minite.nn.quantized_weight import is_released

CONFIGS = {"dense": tiny_qwen3, "moe": tiny_qwen3_moe}


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("sampler_recipe", ["vllm", "aligned"])
def test_sync_into_a_sampler_only_model_matches_a_full_sampler(kind, sampler_recipe):
    learner = Qwen3(CONFIGS[kind](), "te").to(torch.bfloat16)
    learner.init_weights(generator=torch.Generator().manual_seed(0))
    full = Qwen3(learner.config, sampler_recipe).to(torch.bfloat16)
    sync_sampler_model(full, learner)
    lean = build_sampler_model(learner.config, sampler_recipe, state_fill(dict(learner.named_parameters())))
    ids = torch.randint(0, learner.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with calibrate(full):
            full(ids)
        with calibrate_through(lean, learner):
            learner(ids)
        assert static_scales(learner) == {}  # the learner's own scales are left as they were
        scales = static_scales(full)
        assert scales.keys() == static_scales(lean).keys()
        assert all(torch.equal(scales[k], v) for k, v in static_scales(lean).items())
        assert torch.equal(lean(ids), full(ids))
        for p in learner.parameters():  # an update
            p.mul_(1.5)
        sync_sampler_model(full, learner)
        sync_sampler_model(lean, learner)
        assert torch.equal(lean(ids), full(ids))
    released = [n for n, p in lean.named_parameters() if is_released(p)]
    assert released and all("norm" not in n and "embed" not in n for n in released)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_codes_and_scales_payload_into_a_sampler_only_model(kind):
    """`load_quantized_weights` (the sharded learner's sync) installs the containers alone."""
    from minite.learner.weight_sync import export_quantized_weights, load_quantized_weights
    from minite.models.sampler_model import random_fill

    full = Qwen3(CONFIGS[kind](), "aligned").to(torch.bfloat16)
    full.init_weights(generator=torch.Generator().manual_seed(2))
    lean = build_sampler_model(full.config, "aligned", random_fill(7))
    load_quantized_weights(lean, export_quantized_weights(full))
    ids = torch.randint(0, full.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(lean(ids), full(ids))
    assert all(qw.unscaled is None for qw in quantized_weights_held(lean))
