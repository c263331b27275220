"""Weight sync: one quantization per update shared by learner and colocated sampler (same objects);
export/load of codes and scales installs weights without quantizing and gives bitwise-equal forwards."""

from functools import partial

import pytest
import torch

import minite.nn.linear
import minite.nn.moe
from minite.learner import Learner, export_quantized_weights, load_quantized_weights, quantized_weights
from minite.models import Qwen3
from minite.rl.losses import LossConfig, policy_loss
from minite.sampler import Sampler
from minite.sampling import SamplingParams
from tests.learner.helpers import random_batch, tiny_model


@pytest.fixture
def quantize_calls(monkeypatch):
    """Counts calls of quantize_weight from Linear and MoEExperts."""
    calls = []
    for mod in (minite.nn.linear, minite.nn.moe):
        original = mod.quantize_weight
        monkeypatch.setattr(mod, "quantize_weight", lambda w, s, f=original: calls.append(1) or f(w, s))
    return calls


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_colocated_sampler_uses_the_step_s_quantized_weights(moe, quantize_calls):
    model = tiny_model(moe, "aligned")
    learner = Learner(model, lr=1e-2)
    batch = random_batch()
    before = quantized_weights(model)
    quantize_calls.clear()
    learner.step(batch, partial(policy_loss, cfg=LossConfig()))
    after = quantized_weights(model)
    assert len(quantize_calls) == len(after)  # each NVFP4 weight quantized exactly once by the step
    assert all(after[k] is not before[k] for k in after)
    assert any(not torch.equal(after[k].q.codes, before[k].q.codes) for k in after)
    quantize_calls.clear()
    Sampler(model, kv_cache_tokens=256).generate([[3, 4, 5]], SamplingParams(n=2, max_tokens=4, seed=0))
    learner.logprobs(batch)
    assert quantize_calls == []  # neither the sampler nor the learner's next forward re-quantizes
    assert all(quantized_weights(model)[k] is after[k] for k in after)


@pytest.mark.parametrize("moe,recipe", [(False, "aligned"), (True, "aligned"), (False, "te")])
def test_export_load_installs_without_quantizing_and_matches_bitwise(moe, recipe, quantize_calls):
    source = tiny_model(moe, recipe, seed=3)
    payload = export_quantized_weights(source)
    target = Qwen3(source.config, recipe)
    quantize_calls.clear()
    load_quantized_weights(target, payload)
    ids = torch.randint(0, source.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(target(ids), source(ids))
    assert quantize_calls == []
    for name, p in target.named_parameters():
        if name not in payload["quantized"]:
            assert torch.equal(p, dict(source.named_parameters())[name]), name


def test_export_load_ships_calibrated_static_scales():
    source = tiny_model(False, "vllm", seed=3)
    with minite.nn.calibrate(source):
        source(torch.randint(0, 128, (2, 8)))
    target = Qwen3(source.config, "vllm")
    load_quantized_weights(target, export_quantized_weights(source))
    ids = torch.randint(0, 128, (1, 7))
    with torch.no_grad():
        assert torch.equal(target(ids), source(ids))


def test_load_rejects_a_model_under_another_recipe():
    payload = export_quantized_weights(tiny_model(False, "aligned"))
    with pytest.raises(ValueError, match="does not match|do not match"):
        load_quantized_weights(Qwen3(tiny_model().config, "te"), payload)
    with pytest.raises(ValueError, match="do not match"):
        load_quantized_weights(Qwen3(tiny_model().config, "bf16"), payload)
