"""The learner benchmark's CPU smoke mode runs and reports tokens/s per model and recipe."""

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_learner.py"


def test_bench_learner_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_learner", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "learner.json"
    rows = bench.main(["--tiny", "--models", "moe", "--recipes", "bf16,aligned", "--out", str(out)])
    assert [(r["model"], r["recipe"]) for r in rows] == [("moe", "bf16"), ("moe", "aligned")]
    assert all(r["tokens_per_s"] > 0 and r["micro_batches"] > 1 for r in rows)
    doc = json.loads(out.read_text())
    assert {"gpu", "date", "commit"} <= set(doc["env"]) and len(doc["rows"]) == 2
    assert "tokens_per_s" in capsys.readouterr().out
