"""The GPU-only sweep scripts' logic, on tiny shapes under the Triton interpreter (a broken script would
otherwise be found only on the device, where time is short)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minite import kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not kernels.available(), reason="Triton is not installed")
def test_aligned_gemm_sweep_smoke(tmp_path):
    out = tmp_path / "sweep.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "benchmarks.tools.sweep_gemm_tiles", "--smoke", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    assert len(doc["contract"]) == 2 and all(r["batch_invariant"] for r in doc["contract"])
    assert all(r["grouped_equals_dense"] and r["same_bits_as_current"] == 1.0 for r in doc["contract"])
    assert {t["kind"] for t in doc["timings"]} == {"dense", "grouped"}


SCRIPTS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks").rglob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_imports(script):
    """Each benchmark module at least imports (a benchmark that imported a name that had moved went
    unseen until a GPU call failed on it)."""
    code = f"import runpy; runpy.run_path({str(ROOT / script)!r}, run_name='not_main')"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_prefill_profile_smoke(tmp_path):
    """`profile_prefill --tiny`: a prefill step per recipe on the CPU, timed and profiled."""
    out = tmp_path / "prefill.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "benchmarks.tools.profile_prefill", "--tiny", "--reps", "1",
                    "--out", str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "aligned"]
    for r in rows:
        assert r["tokens"] == 16 * 128 and len(r["steps"]) == 1 and r["steps"][0]["step_ms"] > 0
        assert r["tottime"] and r["cumtime"] and r["host_ops"]
