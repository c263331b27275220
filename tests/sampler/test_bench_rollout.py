"""Smoke test of the rollout benchmark's `--tiny` mode (CPU, tiny models, a few tokens)."""

import json

import pytest

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
