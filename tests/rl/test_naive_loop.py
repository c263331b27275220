"""The naive deployment in the RL loop: a `te` learner and a separately quantized `vllm` sampler with
its own model, fed by a weight sync after every update (CPU, tiny char model)."""

import json

import pytest
import torch

from minite.config import ConfigError, load_config
from minite.nn import Linear
from minite.nn.linear import SegmentedLinear
from minite.nvfp4 import quantize
from minite.rl.trainer import Trainer
from tests.rl.test_trainer import TINY, parity_reward

NAIVE = ["--recipe.name=te", "--sampler.recipe=vllm", "--rl.correction.name=triage"]


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _naive(tmp_path, *overrides):
    cfg = load_config(None, TINY + NAIVE + list(overrides))
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.task.reward = parity_reward
    return trainer


def test_naive_run_logs_the_gap_triage_and_the_sync(tmp_path):
    trainer = _naive(tmp_path, "--rl.steps=2", "--checkpoint.every=1")
    assert trainer.sampler_model is not trainer.model
    assert trainer.sampler_model.recipe.name == "vllm" and trainer.model.recipe.name == "te"
    trainer.run()
    rl = [r for r in _records(tmp_path / "run") if r["kind"] == "rl"]
    assert len(rl) == 2
    for r in rl:
        assert r["mismatch/logprob_abs_diff_mean"] > 1e-4  # two engines: a real gap
        assert r["mismatch/bitwise_equal_frac"] < 1
        assert r["time/weight_sync_s"] > 0
        assert any(k.startswith("triage/") for k in r)
    # the sampler's calibrated scales travel with the checkpoint and come back on resume
    scales = {n: b.clone() for n, b in trainer.sampler_model.named_buffers() if n.endswith("input_scale")}
    assert scales
    resumed = Trainer(load_config(None, TINY + NAIVE + ["--rl.steps=2", "--checkpoint.every=1"]),
                      tmp_path / "run", resume=True)
    for name, b in resumed.sampler_model.named_buffers():
        if name in scales:
            assert torch.equal(b, scales[name]), name


def test_the_shared_sampler_runs_the_learners_model(tmp_path):
    cfg = load_config(None, TINY + ["--rl.steps=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.sampler_model is trainer.model and trainer.sync_sampler() == 0.0


def test_sync_gives_the_sampler_an_independent_quantization_under_its_chain(tmp_path):
    trainer = _naive(tmp_path, "--rl.steps=1", "--warmup.steps=1")
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # an update
    trainer.sync_sampler()
    learner = dict(trainer.model.named_modules())
    n = 0
    for name, lin in trainer.sampler_model.named_modules():
        if not isinstance(lin, Linear) or not lin.recipe.fp4:
            continue
        segmented = isinstance(lin, SegmentedLinear)
        qws = lin.quantized_weights() if segmented else [lin.quantized_weight()]
        weights = learner[name].segments() if segmented else [learner[name].weight]
        for qw, w in zip(qws, weights, strict=True):
            want = quantize(w.detach(), **trainer.sampler_recipe.weight.kwargs())
            assert torch.equal(qw.q.codes, want.codes), name
            assert torch.equal(qw.q.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8)), name
            assert torch.equal(qw.q.global_scale, want.global_scale), name
            n += 1
    assert n == 7  # q, k, v, o, gate, up, down of the one layer


def test_every_sync_recalibrates_the_sampler(tmp_path):
    trainer = _naive(tmp_path, "--rl.steps=1", "--warmup.steps=1", "--sampler.calibration=every_sync")
    trainer.sync_sampler(calibrate=True)
    before = trainer.sampler_model.layers[0].self_attn.qkv_proj.input_scale.clone()
    with torch.no_grad():
        trainer.model.layers[0].input_layernorm.weight.mul_(3)
    trainer.sync_sampler()
    assert not torch.equal(trainer.sampler_model.layers[0].self_attn.qkv_proj.input_scale, before)


@pytest.mark.parametrize("override,match", [
    ("--sampler.recipe=fp8", "sampler.recipe"),
    ("--sampler.calibration=never", "calibration"),
    ("--sampler.recipe_overrides={execution={backend=\"ref\"}}", "recipe_overrides need a sampler recipe"),
])
def test_bad_sampler_settings_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_the_fast_bf16_sampler_has_its_own_model_and_a_gap(tmp_path):
    cfg = load_config(None, TINY + ["--recipe.name=bf16", "--sampler.engine=fast", "--rl.steps=1"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.task.reward = parity_reward
    assert trainer.sampler_model is not trainer.model
    assert trainer.sampler_model.recipe.name == "bf16"
    assert trainer.sampler_model.recipe.execution.attention == "sdpa"
    trainer.run()
    (rl,) = [r for r in _records(tmp_path / "run") if r["kind"] == "rl"]
    assert rl["mismatch/bitwise_equal_frac"] < 1  # SDPA's arithmetic, not the learner's


def test_the_fast_engine_refuses_a_quantized_recipe():
    with pytest.raises(ConfigError, match="engine='fast' samples in bf16"):
        load_config(None, TINY + ["--sampler.engine=fast", "--sampler.recipe=vllm"])


@pytest.mark.parametrize("release", [True, False])
def test_the_kv_cache_is_released_between_rollouts_unless_kept(tmp_path, release):
    cfg = load_config(None, TINY + ["--rl.steps=2", f"--sampler.release_kv_cache={str(release).lower()}"])
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.task.reward = parity_reward
    trainer.run()
    assert trainer.sampler.released == release
    rl = [r for r in _records(tmp_path / "run") if r["kind"] == "rl"]
    assert (rl[-1]["time/kv_remake_s"] > 0) == release  # step 2 re-makes the cache step 1 gave back
    assert trainer.sampler.stats["kv_remakes"] >= (len(rl) if release else 0)
