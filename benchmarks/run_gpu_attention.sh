#!/usr/bin/env bash
# Attention kernel GPU tests (kernel, sampler graphs) and bench_attention.py in one call; outputs under
# $OUT (default benchmarks/results): attention_log.txt, attention.json.
# Usage (repo root): bash benchmarks/run_gpu_attention.sh [--quick]   (T_TEST, T_BENCH: time limits in s)
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
LOG="$OUT/attention_log.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$LOG"
timeout "${T_TEST:-300}" python3 -m pytest -q -m gpu tests/kernels/test_attention.py tests/sampler/test_gpu.py -p no:cacheprovider \
  -rA 2>&1 | tail -60 | tee -a "$LOG"
timeout "${T_BENCH:-300}" python3 benchmarks/bench_attention.py --out "$OUT/attention.json" "$@" 2>&1 | tee -a "$LOG"
