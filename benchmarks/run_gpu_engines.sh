#!/usr/bin/env bash
# The engines' GPU work in one device call: GPU tests, rollout and learner benchmarks, agreement on the
# benchmark model, the GPU training preset. Usage (repo root): bash benchmarks/run_gpu_engines.sh PART
# PART tests: the GPU tests; PART engines: rollout and learner benchmarks, agreement, diagnose reports, the
# GPU training preset.
# Outputs under $OUT (default benchmarks/results/gpu); each step has a time cap so the call ends in time.
set -o pipefail
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT/extra"
export PYTHONPATH=. PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown}
part=$1
log="$OUT/log_part$part.txt"
step() {
  local cap=$1; shift
  echo "== [$(date +%T)] $* (cap ${cap}s)" | tee -a "$log"
  timeout "$cap" "$@" > "$OUT/extra/step.txt" 2>&1
  echo "rc=$?" >> "$OUT/extra/step.txt"
  tail -n 45 "$OUT/extra/step.txt" | tee -a "$log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$log"
if [ "$part" = tests ]; then
  step 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests
else
  step 150 python3 benchmarks/bench_rollout.py --models dense --backend triton --out "$OUT/rollout_dense.json"
  step 80 python3 benchmarks/bench_rollout.py --models moe --moe-layers 4 --new-tokens 256 --backend triton \
    --out "$OUT/rollout_moe.json"
  step 60 python3 benchmarks/bench_learner.py --out "$OUT/learner.json"
  for pair in "bf16 bf16 triton" "aligned aligned triton" "te vllm ref"; do
    read -r lr sr backend <<< "$pair"
    step 40 python3 -m minite.cli agreement --preset qwen3-1.7b --learner-recipe "$lr" --sampler-recipe "$sr" \
      --backend "$backend" --num-prompts 16 --n 4 --max-tokens 64 --json
    cp "$OUT/extra/step.txt" "$OUT/extra/agreement_${lr}_$sr.txt"
  done
  for pair in "te vllm" "aligned aligned"; do
    read -r lr sr <<< "$pair"
    step 40 python3 -m minite.cli diagnose --preset qwen3-1.7b --layers 8 --learner-recipe "$lr" \
      --sampler-recipe "$sr" --n-prompts 16 --max-tokens 48 --out "$OUT/extra/diagnose_${lr}_$sr"
  done
  step 100 python3 -m minite.cli train --config configs/gpu_arith.toml --rl.steps=10 \
    --recipe.overrides.backend=triton --run_dir="$OUT/extra/train"
fi
tar czf "$OUT/extra_part$part.tgz" -C "$OUT" extra && rm -rf "$OUT/extra"
