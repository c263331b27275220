"""The learner benchmark's CPU smoke mode runs and reports tokens/s per model and recipe."""

import json

from benchmarks.e2e import bench_learner as bench


def test_bench_learner_tiny(tmp_path, capsys):
    out = tmp_path / "learner.json"
    rows = bench.main(["--tiny", "--models", "moe", "--recipes", "bf16,aligned", "--out", str(out)])
    assert [(r["model"], r["recipe"]) for r in rows] == [("moe", "bf16"), ("moe", "aligned")]
    assert all(r["tokens_per_s"] > 0 and r["micro_batches"] > 1 for r in rows)
    doc = json.loads(out.read_text())
    assert {"gpu", "date", "commit"} <= set(doc["env"]) and len(doc["rows"]) == 2
    assert "tokens_per_s" in capsys.readouterr().out
