"""Smoke test of the rollout benchmark's `--tiny` mode (CPU, tiny models, a few tokens)."""

import json

import pytest
import torch

from benchmarks.e2e import bench_rollout as bench


@pytest.mark.slow
def test_bench_rollout_tiny_writes_json(tmp_path):
    out = tmp_path / "rollout.json"
    bench.main(["--tiny", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"gpu", "date", "commit"} <= doc["env"].keys()
    rows = doc["rows"]
    assert {(r["model"], r["engine"], r["recipe"]) for r in rows} == {
        (m, e, r) for m in ("dense", "moe")
        for e, r in (("minite", "bf16"), ("minite", "aligned"), ("hf_generate", "bf16"))}
    for r in rows:
        assert r["gen_tokens"] == 3 * 2 * 6 and r["tokens_per_s"] > 0
        if r["engine"] == "hf_generate":
            assert r["hf_logit_max_abs_diff"] < 1e-4  # same weights reached transformers


def test_bench_rollout_sampler_only_runs_build_models_weights(tmp_path):
    """`--sampler-only`: the NVFP4 recipe samples on a model built layer by layer with build_model's
    weights (the same logits as build_model's under that recipe)."""
    config = bench.model_config("moe", bench.parse_args(["--tiny"]))
    full = bench.build_model(config, torch.device("cpu"), torch.float32, 0)
    full.set_recipe("aligned")
    lean = bench.build_sampler_only(config, "aligned", torch.device("cpu"), torch.float32, 0, "auto")
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(lean(ids), full(ids))
    args = ["--tiny", "--no-hf", "--models", "moe", "--recipes", "aligned"]
    full = bench.main(args + ["--out", str(tmp_path / "full.json")])
    lean = bench.main(args + ["--sampler-only", "--out", str(tmp_path / "lean.json")])
    assert [r["sampler_only"] for r in full + lean] == [False, True]
    assert lean[0]["gen_tokens"] == full[0]["gen_tokens"] == 3 * 2 * 6
