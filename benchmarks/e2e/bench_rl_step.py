"""One RL step of a training preset (rollout, learner log-probs, updates, weight sync) under several
learner / sampler settings, each a short `minite train` run in its own process, one after another.

    python -m benchmarks.e2e.bench_rl_step [--config configs/gpu_arith.toml] [--steps 12] [--out F]

Settings: aligned (backend auto, the preset as shipped), aligned with an explicit backend "triton",
naive (te learner, vllm sampler with its own model), bf16, aligned keeping its KV cache through the
learner phase (`sampler.release_kv_cache = false`). Each run warm-starts briefly, then runs
`--steps` RL steps; the step time is the median over the steps after the first two (kernel compiles,
graph captures). Reports each setting's step time, its ratio to aligned, and the rollout, learner and
weight-sync times within the step, the time to re-make the released KV cache, and the peak device
memory of the rollout and of the learner phase (the largest over the steps).

    python -m benchmarks.e2e.bench_rl_step --config configs/gpu_rl_qwen3_1p7b_shape.toml \
        --settings aligned,aligned_keep_kv --steps 4
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import report

SETTINGS = {
    "aligned": [],
    "aligned_triton": ["--recipe.overrides={execution={backend=\"triton\"}}"],
    "naive": ["--recipe.name=te", "--sampler.recipe=vllm"],
    "bf16": ["--recipe.name=bf16"],
    "aligned_keep_kv": ["--sampler.release_kv_cache=false"],
}
PHASE_MEMORY = ("memory/rollout_peak_gb", "memory/learner_peak_gb")
SHORT = ["--warmup.steps=10", "--eval.every=0", "--eval.size=16", "--eval.samples=0", "--checkpoint.every=0",
         "--logging.progress=false", "--logging.tensorboard=false"]
SKIP = 2  # first steps: compiles and graph captures


def run_setting(config: str, overrides: list[str], steps: int, folder: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "minite.cli", "train", "--config", config, *SHORT, *overrides,
           f"--rl.steps={steps}", f"--run_dir={folder}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("kind") == "rl"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/gpu_arith.toml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated subset of SETTINGS")
    p.add_argument("--out", help="JSON file to write")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(args.settings.split(",")):  # a setting named twice: a second reading
            rl = run_setting(args.config, SETTINGS[name], args.steps, Path(tmp) / f"{i}_{name}")[SKIP:]
            med = {k: statistics.median(r[k] for r in rl) for k in
                   ("time/step_s", "time/rollout_s", "time/update_s", "time/weight_sync_s")}
            rows.append({"setting": name, "step_s": med["time/step_s"], "rollout_s": med["time/rollout_s"],
                         "update_s": med["time/update_s"], "weight_sync_s": med["time/weight_sync_s"],
                         "kv_remake_s": statistics.median(r["time/kv_remake_s"] for r in rl),
                         **{k.split("/")[1]: max(r.get(k, 0.0) for r in rl) for k in PHASE_MEMORY},
                         "k3_kl": statistics.fmean(r["mismatch/k3_kl"] for r in rl), "steps": len(rl)})
            print(json.dumps(rows[-1]), flush=True)
    base = next((r["step_s"] for r in rows if r["setting"] == "aligned"), None)
    for r in rows:
        r["vs_aligned"] = r["step_s"] / base if base else None
    report("rl_step", rows, args.out, {"config": args.config})


if __name__ == "__main__":
    main()
