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
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_aligned_gemm.py"), "--smoke", "--out",
                    str(out)], check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    doc = json.loads(out.read_text())
    assert len(doc["contract"]) == 2 and all(r["batch_invariant"] for r in doc["contract"])
    assert all(r["grouped_equals_dense"] and r["same_bits_as_current"] == 1.0 for r in doc["contract"])
    assert {t["kind"] for t in doc["timings"]} == {"dense", "grouped"}


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_every_benchmark_imports(script):
    """Each benchmark module at least imports (bench_gemm imported a name that had moved, unseen for
    three sessions: the GPU call is where it failed)."""
    code = f"import runpy; runpy.run_path({str(ROOT / 'benchmarks' / script)!r}, run_name='not_main')"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
