"""Agreement of the learner with the sampler on sampled tokens: the real sampler in fp32 agrees within
1e-5 under bf16 and aligned; the naive te learner + vllm sampler shows a gap; a stub generate_fn."""

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from minite.commands import agreement_cmd
from minite.diagnostics.agreement import measure_agreement, random_prompts, recipe_view
from minite.models import Qwen3
from minite.models.presets import model_preset
from minite.sampling import SamplingParams, processed_logprobs

AGREE_TOL = 1e-5
PARAMS = SamplingParams(n=2, max_tokens=6, temperature=0.9, top_p=0.95, seed=0)


def _model(preset="tiny-qwen3", recipe="aligned"):
    model = Qwen3(model_preset(preset), recipe)
    model.init_weights(0.1, torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("preset,recipe", [("tiny-qwen3", "bf16"), ("tiny-qwen3", "aligned"),
                                           ("tiny-qwen3-moe", "aligned")])
def test_same_recipe_agrees_within_1e5_in_fp32(preset, recipe):
    r = measure_agreement(_model(preset, recipe), random_prompts(3, 5, 128), PARAMS, recipe, recipe)
    assert r["same_model_object"] and r["n_tokens"] == 3 * 2 * 6
    assert r["logprob_abs_diff_max"] <= AGREE_TOL and r["k3_kl"] <= AGREE_TOL**2
    assert r["bitwise_equal_frac"] > 0


def test_naive_te_learner_vllm_sampler_shows_a_gap():
    r = measure_agreement(_model(), random_prompts(3, 5, 128), PARAMS, "te", "vllm")
    assert not r["same_model_object"] and r["calibrated"] == ["sampler"]
    assert r["logprob_abs_diff_max"] > 1e-2 and r["k3_kl"] > 1e-5 and r["bitwise_equal_frac"] < 0.5


def test_views_share_parameters():
    model = _model()
    view = recipe_view(model, "te")
    assert view is not model and view.recipe.name == "te" and recipe_view(model, "aligned") is model
    for (n, p), q in zip(model.named_parameters(), view.parameters()):
        assert p is q or p.data_ptr() == q.data_ptr(), n


def test_stub_generate_fn():
    model = _model(recipe="bf16")

    def stub(m, prompts, params):
        outs = []
        for p in prompts:
            ids = torch.tensor(p + [7, 8, 9])
            with torch.no_grad():
                lp = processed_logprobs(m(ids[None, :-1])[0], params.temperature)
            tokens = [7, 8, 9]
            lps = lp[len(p) - 1:].gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            outs.append(SimpleNamespace(samples=[SimpleNamespace(token_ids=tokens, logprobs=lps)]))
        return outs

    params = SamplingParams(temperature=0.8, max_tokens=3)
    r = measure_agreement(model, random_prompts(2, 4, 128), params, "bf16", generate_fn=stub)
    assert r["n_tokens"] == 6 and r["num_samples"] == 2 and r["logprob_abs_diff_max"] <= 1e-6
    with pytest.raises(ValueError, match="results for"):
        measure_agreement(model, random_prompts(2, 4, 128), params, "bf16", generate_fn=lambda *a: [])


def test_cli_json(capsys):
    parser = argparse.ArgumentParser()
    agreement_cmd.add_parser(parser.add_subparsers(dest="command"), "agreement")
    args = parser.parse_args(["agreement", "--preset", "tiny-qwen3", "--num-prompts", "2", "--n", "1",
                              "--max-tokens", "3", "--prompt-len", "4", "--device", "cpu", "--json"])
    assert agreement_cmd.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["learner_recipe"] == "aligned" and report["n_tokens"] == 6
    assert report["logprob_abs_diff_max"] <= AGREE_TOL
