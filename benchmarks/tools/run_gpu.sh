#!/usr/bin/env bash
# GPU work batched into one device call. Usage (repository root): bash benchmarks/tools/run_gpu.sh PART...
#   tests            pytest -m gpu tests
#   OP               benchmarks/ops/bench_OP.py: quantize gemm grouped_gemm decode_gemm decode_rows grouped_decode
#                    attention attention_backward norm sample router
#   rollout          dense rollout (Qwen3-1.7B shape) against Hugging Face generate
#   rollout_moe      MoE rollout (24 of 48 Qwen3-30B-A3B layers) bf16 vs aligned, 3 paired rounds
#   rollout_kv       dense rollout: bf16, aligned and aligned with each quantized KV cache (no HF)
#   rollout_moe_full the full 48-layer MoE on sampler-only models: bf16, aligned, aligned/fp8, 3 paired rounds
#   rollout_dense_sampler_only the dense shape on sampler-only models: bf16, aligned, aligned/fp8
#   rollout_max_batch each recipe at the largest batch its memory holds (full MoE, sampler-only)
#   rollout_batch    rollout against batch size, 32-512 sequences: dense (full models), full MoE (sampler-only)
#   profile_rollout_moe48 a decode step's kernels on the full MoE, aligned sampler-only
#   agreement_kv     aligned learner vs sampler with each quantized KV cache, dense and MoE
#   memory           benchmarks/e2e/bench_memory.py on the dense shape: bytes by kind, measured
#   learner          learner train step, dense and MoE, with a profile of each (--kernels)
#   rl_step          one RL step of configs/gpu_arith.toml: aligned, naive te/vllm, bf16
#   profile_rollout  a rollout decode step's kernels: dense aligned, MoE bf16 and aligned
#   learner_gaps learner_host linear_host decode_floor   the profiles and probes in benchmarks/tools/
#   ncu_decode       Nsight Compute counters of the decode GEMM (NCU_SPECS: one ncu_decode.py line each)
#   ncu_attention    Nsight Compute counters of decode attention on bf16, fp8 and nvfp4 KV caches
#   ncu_grouped_decode Nsight Compute counters and warp stalls of the MoE experts (256 tokens, gate|up)
#                    and of the o projection in row tiles (128 rows)
#   gemm_tiles gemm_tma decode_tiles quantize_tiles      the tile sweeps in benchmarks/tools/
#   pair_attention   dense rollouts, attention at 4 against 2 warps, paired (bf16 and aligned/fp8 sampler-only)
#   attention_regcap decode attention on fp8 / nvfp4 caches with registers capped, paired, bitwise-checked
#   agreement        aligned learner vs sampler on 4 layers of qwen3-1.7b and qwen3-30b-a3b
#   agreement_full   bf16/bf16, aligned/aligned, te/vllm on all 28 layers of qwen3-1.7b
#   diagnose         minite diagnose at full depth, te/vllm and aligned/aligned
#   train            the GPU training preset (configs/gpu_arith.toml)
# Outputs under $OUT (default benchmarks/results/gpu): log.txt and results.tgz (every JSON and text
# output). Each step has a time cap so that the call ends inside BUDGET seconds (default 570).
# Triton's kernel cache lives in .triton_cache (carry it to skip recompiling on a fresh machine).
set -o pipefail
OUT=${OUT:-benchmarks/results/gpu}
BUDGET=${BUDGET:-570}
NCU_SPECS=${NCU_SPECS:-"--layer gate+up --m 8 --cublas
--layer gate+up --m 64 --cublas"}
mkdir -p "$OUT/extra"
export PYTHONPATH=. PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown} TRITON_CACHE_DIR=$PWD/.triton_cache
log="$OUT/log.txt" x="$OUT/extra" t_start=$(date +%s)
step() {  # step CAP COMMAND...: run it for at most CAP seconds (less if the budget is nearly spent)
  local cap=$1 left=$((BUDGET - ($(date +%s) - t_start))); shift
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -le 5 ]; then echo "== skipped (no time left): $*" | tee -a "$log"; return; fi
  echo "== [$(date +%T)] $* (cap ${cap}s)" | tee -a "$log"
  timeout "$cap" "$@" > "$x/step.txt" 2>&1
  echo "rc=$?" >> "$x/step.txt"
  tail -n 40 "$x/step.txt" | tee -a "$log"
}
py() { local cap=$1; shift; step "$cap" python3 -m "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$log"
for part in "$@"; do
  case $part in
    tests) py "${TESTS_CAP:-200}" pytest -q -m gpu -p no:cacheprovider tests ;;
    quantize|gemm|grouped_gemm|decode_gemm|decode_rows|grouped_decode|attention|attention_backward|norm|sample|router)
      py 200 "benchmarks.ops.bench_$part" --out "$x/$part.json" ;;
    rollout) py 170 benchmarks.e2e.bench_rollout --models dense --out "$x/rollout_dense.json" ;;
    rollout_moe)
      moe="--models moe --moe-layers 24 --new-tokens 256 --no-hf"
      py 150 benchmarks.e2e.bench_rollout $moe --rounds 3 --out "$x/rollout_moe24.json" ;;
    rollout_kv) py 100 benchmarks.e2e.bench_rollout --models dense --no-hf \
      --recipes bf16,aligned,aligned/fp8,aligned/nvfp4 --out "$x/rollout_dense_kv.json" ;;
    rollout_moe_full)
      moe="--models moe --sampler-only --new-tokens 256 --no-hf"
      py 300 benchmarks.e2e.bench_rollout $moe --recipes bf16,aligned,aligned/fp8 --rounds 3 \
        --out "$x/rollout_moe48.json" ;;
    rollout_dense_sampler_only) py 150 benchmarks.e2e.bench_rollout --models dense --sampler-only --no-hf \
      --recipes bf16,aligned,aligned/fp8 --out "$x/rollout_dense_sampler_only.json" ;;
    rollout_max_batch) py 300 benchmarks.e2e.bench_rollout --models moe --sampler-only --new-tokens 256 --no-hf \
      --max-batch --recipes bf16,aligned/fp8 --out "$x/rollout_moe48_max_batch.json" ;;
    rollout_batch)
      sizes="--sequences 32,64,128,256,512 --recipes bf16,aligned,aligned/fp8"
      py 200 benchmarks.e2e.sweep_rollout_batch --model dense $sizes --out "$x/sweep_rollout_batch_dense.json"
      py 290 benchmarks.e2e.sweep_rollout_batch --model moe --sampler-only --new-tokens 256 $sizes \
        --out "$x/sweep_rollout_batch_moe48.json" ;;
    profile_rollout_moe48) py 150 benchmarks.tools.profile_rollout --model moe --moe-layers 48 --kernels 3 \
      --recipe aligned --sampler-only --out "$x/profile_rollout_moe48_aligned.json" ;;
    agreement_kv)  # each quantized KV cache: the dense shape at full depth, the MoE shape at 8 of 48 layers
      for run in "qwen3-1.7b 28" "qwen3-30b-a3b 8"; do
        read -r preset layers <<< "$run"
        for kv in fp8 nvfp4; do
          py 60 minite.cli agreement --preset $preset --layers $layers --kv-cache $kv --num-prompts 16 --n 4 \
            --max-tokens 64 --learner-recipe aligned --json
          cp "$x/step.txt" "$x/agreement_${preset}_$kv.txt"
        done
      done ;;
    memory) py 90 benchmarks.e2e.bench_memory --models dense --out "$x/memory.json" ;;
    learner) py 160 benchmarks.e2e.bench_learner --kernels --out "$x/learner.json" ;;
    rl_step) py 400 benchmarks.e2e.bench_rl_step --out "$x/rl_step.json" ;;
    profile_rollout)
      py 70 benchmarks.tools.profile_rollout --kernels 6 --recipe aligned --out "$x/profile_rollout_aligned.json"
      for recipe in bf16 aligned; do
        py 70 benchmarks.tools.profile_rollout --model moe --moe-layers 24 --kernels 4 --recipe $recipe \
          --out "$x/profile_rollout_moe24_$recipe.json"
      done ;;
    learner_gaps) py 150 benchmarks.tools.profile_learner_gaps --out "$x/learner_gaps.json" ;;
    learner_host) py 120 benchmarks.tools.profile_learner_host --out "$x/learner_host.json" ;;
    linear_host) py 60 benchmarks.tools.probe_linear_host --out "$x/linear_host.json" ;;
    decode_floor) py 200 benchmarks.tools.probe_decode_floor --out "$x/decode_floor.json" ;;
    gemm_tiles) py 400 benchmarks.tools.sweep_gemm_tiles --out "$x/gemm_tiles.json" ;;
    gemm_tma) py 300 benchmarks.tools.sweep_gemm_tma --out "$x/gemm_tma.json" ;;
    decode_tiles) py 300 benchmarks.tools.sweep_decode_tiles --out "$x/decode_tiles.json" ;;
    quantize_tiles) py 150 benchmarks.tools.sweep_quantize --out "$x/quantize_tiles.json" ;;
    pair_attention) py 240 benchmarks.tools.pair_attention_config --out "$x/attention_warps_rollout_paired.json" ;;
    attention_regcap) py 150 benchmarks.tools.probe_attention_regcap --out "$x/attention_regcap.json" ;;
    ncu_decode)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
      while read -r spec; do
        name=$(echo "$spec" | sed 's/--//g; s/+/p/g; s/|/_/g; s/ /_/g')
        step 60 "$NCU" --clock-control none --profile-from-start off --csv --page details \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
          python3 -m benchmarks.tools.ncu_decode $spec
        cp "$x/step.txt" "$x/ncu_$name.csv"
      done <<< "$NCU_SPECS" ;;
    ncu_attention)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
      step 90 "$NCU" --clock-control none --profile-from-start off --csv --page details \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        --section SourceCounters python3 -m benchmarks.tools.ncu_attention
      cp "$x/step.txt" "$x/ncu_attention.csv" ;;
    ncu_grouped_decode)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
      for target in experts rows; do
        step 60 "$NCU" --clock-control none --profile-from-start off --csv --page details \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
          --section SchedulerStats --section SourceCounters python3 -m benchmarks.tools.ncu_grouped_decode $target
        cp "$x/step.txt" "$x/ncu_grouped_decode_$target.csv"
      done ;;
    agreement)
      for preset in qwen3-1.7b qwen3-30b-a3b; do
        py 60 minite.cli agreement --preset $preset --layers 4 --num-prompts 16 --n 4 --max-tokens 64 \
          --learner-recipe aligned --json
        cp "$x/step.txt" "$x/agreement_$preset.txt"
      done ;;
    agreement_full)
      for pair in "bf16 bf16" "aligned aligned" "te vllm"; do
        read -r lr sr <<< "$pair"
        py 40 minite.cli agreement --preset qwen3-1.7b --learner-recipe "$lr" --sampler-recipe "$sr" \
          --num-prompts 16 --n 4 --max-tokens 64 --json
        cp "$x/step.txt" "$x/agreement_${lr}_$sr.txt"
      done ;;
    diagnose)
      for pair in "te vllm 150" "aligned aligned 110"; do
        read -r lr sr cap <<< "$pair"
        py "$cap" minite.cli diagnose --preset qwen3-1.7b --learner-recipe "$lr" --sampler-recipe "$sr" \
          --n-prompts 16 --max-tokens 48 --out "$x/diagnose_${lr}_$sr"
      done ;;
    train)  # metrics, plots and the summary come back; the checkpoints (subfolders) stay on the machine
      run_dir=$(mktemp -d)
      py 600 minite.cli train --config configs/gpu_arith.toml --run_dir="$run_dir"
      mkdir -p "$x/train" && find "$run_dir" -maxdepth 1 -type f -exec cp {} "$x/train/" \; ;;
    *) echo "unknown part $part" | tee -a "$log" ;;
  esac
done
rm -f "$x/step.txt"
(cd "$OUT" && tar czf results.tgz extra && rm -rf extra)
