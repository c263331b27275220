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
