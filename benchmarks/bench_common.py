"""Shared by the kernel benchmarks: timing, environment record, table and JSON output."""

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch

# FACTS.md section 1, measured on our H200 (2026-11-30)
HBM_COPY_TBPS = 4.25
CUBLAS_BF16_TFLOPS = 743.0
DECODE_CEILING = 2.0 / (0.5 + 1.0 / 16.0)  # bf16 bytes / NVFP4 bytes per weight = 3.56


def parse_args(default_out: str):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=default_out, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    return p.parse_args()


def bench_ms(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of fn() (CUDA events; L2 flushed between runs by triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def env_info() -> dict:
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
            commit = out.stdout.strip() if out.returncode == 0 else "unknown (no git; set GIT_COMMIT)"
        except OSError:
            commit = "unknown (no git; set GIT_COMMIT)"
    import triton

    return dict(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=commit, torch=torch.__version__, triton=triton.__version__,
                argv=" ".join(sys.argv))


def report(name: str, rows: list[dict], out: str | None, extra: dict | None = None) -> None:
    """Print rows as a table and, with out, write {env, rows, extra} as JSON (and a JSON line)."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    width = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(f"\n== {name}")
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(width[c]) for c in cols))
    if out is None:
        return
    doc = dict(benchmark=name, env=env_info(), rows=rows, **(extra or {}))
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(dict(benchmark=name, out=out, n_rows=len(rows))))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
