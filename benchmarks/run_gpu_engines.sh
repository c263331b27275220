#!/usr/bin/env bash
# The engines' GPU work in one device call: GPU tests, rollout and learner benchmarks, agreement on the
# benchmark model, the GPU training preset. Usage (repo root): bash benchmarks/run_gpu_engines.sh PART
# PART 1: GPU tests, rollout and learner benchmarks, agreement, te/vllm report; PART 2: the GPU training
# preset and the aligned report.
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
if [ "$part" = 1 ]; then
  step 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests
  step 170 python3 benchmarks/bench_rollout.py --models dense --backend triton --out "$OUT/rollout_dense.json"
  step 90 python3 benchmarks/bench_rollout.py --models moe --moe-layers 4 --new-tokens 256 --backend triton \
    --out "$OUT/rollout_moe.json"
  step 50 python3 benchmarks/bench_learner.py --out "$OUT/learner.json"
  for pair in "bf16 bf16 triton" "aligned aligned triton" "te vllm ref"; do
    read -r lr sr backend <<< "$pair"
    step 30 python3 -m minite.cli agreement --preset qwen3-1.7b --learner-recipe "$lr" --sampler-recipe "$sr" \
      --backend "$backend" --num-prompts 16 --n 4 --max-tokens 64 --json
    cp "$OUT/extra/step.txt" "$OUT/extra/agreement_${lr}_$sr.txt"
  done
  step 50 python3 -m minite.cli diagnose --preset qwen3-1.7b --layers 8 --learner-recipe te \
    --sampler-recipe vllm --n-prompts 16 --max-tokens 48 --out "$OUT/extra/diagnose_te_vllm"
else
  step 150 python3 -m minite.cli train --config configs/gpu_arith.toml --rl.steps=15 \
    --recipe.overrides.backend=triton --run_dir="$OUT/extra/train"
  step 50 python3 -m minite.cli diagnose --preset qwen3-1.7b --layers 8 --learner-recipe aligned \
    --sampler-recipe aligned --n-prompts 16 --max-tokens 48 --out "$OUT/extra/diagnose_aligned_aligned"
fi
tar czf "$OUT/extra_part$part.tgz" -C "$OUT" extra && rm -rf "$OUT/extra"
