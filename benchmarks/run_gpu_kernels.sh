#!/usr/bin/env bash
# Kernel GPU tests and all kernel benchmarks in one call; outputs under $OUT (default benchmarks/results).
# Usage (repo root): bash benchmarks/run_gpu_kernels.sh [--quick]
set -o pipefail
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/kernels_log.txt"
python3 -m pytest -q -m gpu tests/kernels -x -p no:cacheprovider 2>&1 | tail -40 | tee -a "$OUT/kernels_log.txt"
for b in quantize decode_gemm gemm grouped_gemm; do
  python3 benchmarks/bench_$b.py --out "$OUT/kernels_$b.json" "$@" 2>&1 | tee -a "$OUT/kernels_log.txt"
done
# the quantize kernel's launch configurations (bitwise-checked), when asked for: SWEEP=1
if [ "${SWEEP:-0}" = 1 ]; then
  timeout 240 python3 benchmarks/sweep_quantize.py --out "$OUT/kernels_quantize_sweep.json" 2>&1 | tail -30 \
    | tee -a "$OUT/kernels_log.txt"
fi
