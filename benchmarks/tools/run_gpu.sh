#!/usr/bin/env bash
# The engines' GPU work in one device call. Usage (repo root): bash benchmarks/run_gpu_engines.sh PART...
#   tests     the GPU tests
#   fused_tests  every test of the fused projections and the segmented GEMM on CUDA
#   quant_tests  every test of the quantize and GEMM kernel files on CUDA (not only the gpu-marked ones)
#   profile   where a rollout decode step spends its time (benchmarks/profile_rollout.py): dense aligned,
#             MoE (24 layers) bf16 and aligned; profile_moe: the MoE ones only
#   rollout   rollout benchmark: dense 1.7B against HF generate
#   moe       MoE rollout, 24 layers of 48: bf16 vs aligned (experts on the grouped decode kernel; 3 paired
#             rounds), and aligned with the experts on the aligned tile over the bf16 copy
#   sample    the sampler's token draw: the Triton kernel against the torch reference (bench_sample.py)
#   rollout_draw  MoE rollout (24 layers, bf16 and aligned, 2 paired rounds) with the torch draw, then the
#             kernel, twice, alternating
#   rollout_combine  the same with the MoE combine in torch, then the kernel, twice, alternating
#   decode    the dense decode GEMM (M <= 64) vs cuBLAS bf16, fast and aligned K order (bench_decode_gemm.py)
#   ncu_decode  Nsight Compute counters of the decode GEMM (benchmarks/ncu_decode.py): HBM, L2, stalls
#   decode_wide  the decode GEMM's wide N tiles at M = 32 / 64 (sweep_decode_gemm.py --wide)
#   grouped_decode  MoE decode-step expert GEMMs: grouped decode kernel vs torch._grouped_mm and the aligned
#             tile on the bf16 copy, plus a tile sweep (benchmarks/bench_grouped_decode.py)
#   quantize  the quantize kernel against a device copy (benchmarks/bench_quantize.py)
#   sweep     the quantize kernel's launch configurations (benchmarks/sweep_quantize.py)
#   gemm      the W4A4 GEMM (compute-bound) and the MoE grouped GEMM against cuBLAS / torch._grouped_mm
#   grouped   the MoE grouped GEMM alone, with its tile sweep (benchmarks/bench_grouped_gemm.py)
#   floor     the decode shapes' floor: an empty kernel and a kernel that only reads the packed bytes,
#             against cuBLAS and the decode GEMM (benchmarks/probe_decode_floor.py)
#   tma       the TMA variant of the W4A4 GEMM against the pointer kernel (benchmarks/sweep_tma_gemm.py)
#   tiles     tiles for the aligned W4A4 GEMM, dense and grouped (benchmarks/sweep_aligned_gemm.py)
#   tiles_step  aligned tiles at a rollout decode step (M = 512, CUDA graphs; sweep_aligned_gemm.py --decode-step)
#   learner   learner train-step benchmark
#   learner_ab  the dense learner again with the aligned GEMMs on the small tile at every M
#   learner_launch  the dense learner twice with the direct kernel launches (`minite.kernels.launch`), twice
#             on Triton's own launch path (before session 12), alternating
#   learner_moe  the MoE learner alone (bf16 and aligned)
#   learner_repeat  the dense learner in 4 processes (8 steps each): the spread between processes
#   learner_grads  the dense learner twice freeing the grads after each step (the default), twice keeping
#             them (before session 16), alternating: step time and the memory held between steps
#   agreement_presets  aligned learner vs aligned sampler, 4 layers of qwen3-1.7b and of qwen3-30b-a3b
#   learner_dense  the dense learner alone, default tiles
#   learner_attn  the dense learner twice with the Triton attention backward, twice with the reference
#             backward (before session 13), alternating
#   learner_proj  the dense learner twice with q/k/v and gate/up fused into one GEMM each, twice with one
#             GEMM per linear (before session 14), alternating
#   attention_backward  the attention backward kernels against SDPA's flash backward and the reference
#   learner_norm  the dense learner twice with the norms quantizing for the projections, twice on the
#             element-layout norm kernel without (the path before session 11), alternating
#   norm      the RMSNorm kernels and the norm that quantizes its output (benchmarks/bench_norm.py)
#   gaps      where the GPU waits in a dense learner step, by phase, bf16 vs aligned (probe_learner_gaps.py)
#   host      where the dense learner step's host time goes, bf16 vs aligned (profile_learner_host.py)
#   linear_host  host time of one linear's forward + backward, bf16 vs aligned, and its parts
#   probe     host and GPU time of the aligned W4A4 launch: small, large pointer, large TMA (probe_aligned_tile.py)
#   agreement agreement on the benchmark model for bf16/bf16, aligned/aligned, te/vllm
#   diagnose  minite diagnose reports at the benchmark model's full depth, te/vllm and aligned
#   train     the GPU training preset (configs/gpu_arith.toml), whatever time is left of BUDGET
# Outputs under $OUT (default benchmarks/results/gpu): log.txt and results.tgz (the JSON results and the
# extra folder: the device returns at most 8 files). Each step has a time cap so that the call ends
# inside the device's 10 minutes (BUDGET seconds, default 570).
# Triton's kernel cache lives in .triton_cache (carry it to skip recompiling on a fresh machine); it
# comes back as triton_cache.tgz when small enough.
set -o pipefail
NCU_SPECS=${NCU_SPECS:-"--layer gate+up --m 8 --cublas
--layer gate+up --m 32
--layer gate+up --m 64 --cublas
--layer down --m 64"}
OUT=${OUT:-benchmarks/results/gpu}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT/extra"
export PYTHONPATH=. PYTHONUNBUFFERED=1 GIT_COMMIT=${GIT_COMMIT:-unknown} TRITON_CACHE_DIR=$PWD/.triton_cache
log="$OUT/log.txt"
t_start=$(date +%s)
step() {
  local cap=$1; shift
  local left=$((BUDGET - ($(date +%s) - t_start)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$cap" -le 5 ]; then echo "== skipped (no time left): $*" | tee -a "$log"; return; fi
  echo "== [$(date +%T)] $* (cap ${cap}s)" | tee -a "$log"
  timeout "$cap" "$@" > "$OUT/extra/step.txt" 2>&1
  echo "rc=$?" >> "$OUT/extra/step.txt"
  tail -n 40 "$OUT/extra/step.txt" | tee -a "$log"
}
# learner_ab PREFIX FLAG A B: the dense learner with --FLAG A, B, A, B (alternating, one process each)
learner_ab() {
  local prefix=$1 flag=$2 n=0 path
  for path in "$3" "$4" "$3" "$4"; do
    step 75 python3 benchmarks/bench_learner.py --models dense --steps 5 "--$flag" "$path" \
      --out "$OUT/extra/learner_dense_$prefix$path.json"
    cp "$OUT/extra/learner_dense_$prefix$path.json" "$OUT/extra/learner_dense_$prefix${path}_$((++n)).json"
  done
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$log"
for part in "$@"; do
  case $part in
    tests) step ${TESTS_CAP:-200} python3 -m pytest -q -m gpu -p no:cacheprovider tests ;;
    fused_tests)
      step 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemm_segments.py \
        tests/nn/test_fused_projections.py ;;
    learner_repeat)
      for i in 1 2 3 4; do
        step 60 python3 benchmarks/bench_learner.py --models dense --steps 8 --out "$OUT/extra/learner_dense_$i.json"
      done ;;
    learner_grads)
      for i in 1 2; do
        for mode in release keep; do
          flag=$([ $mode = keep ] && echo --keep-grads)
          step 60 python3 benchmarks/bench_learner.py --models dense --steps 6 $flag \
            --out "$OUT/extra/learner_dense_${mode}_$i.json"
        done
      done ;;
    agreement_presets)
      for preset in qwen3-1.7b qwen3-30b-a3b; do
        step 60 python3 -m minite.cli agreement --preset $preset --layers 4 --num-prompts 16 --n 4 \
          --max-tokens 64 --learner-recipe aligned --backend triton --json
        cp "$OUT/extra/step.txt" "$OUT/extra/agreement_$preset.txt"
      done ;;
    gaps)
      step 150 python3 benchmarks/probe_learner_gaps.py --out "$OUT/extra/learner_gaps.json" ;;
    learner_moe)
      step 90 python3 benchmarks/bench_learner.py --models moe --out "$OUT/extra/learner_moe.json" ;;
    quant_tests)
      step 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_nvfp4.py tests/kernels/test_gemm.py ;;
    tma)
      step 300 python3 benchmarks/sweep_tma_gemm.py --out "$OUT/kernels_tma_sweep.json" ;;
    profile|profile_moe)
      [ "$part" = profile ] && step 70 python3 benchmarks/profile_rollout.py --kernels 6 --recipe aligned \
        --out "$OUT/profile_rollout_aligned.json"
      for recipe in bf16 aligned; do
        step 70 python3 benchmarks/profile_rollout.py --model moe --moe-layers 24 --kernels 4 --recipe $recipe \
          --out "$OUT/profile_rollout_moe24_$recipe.json"
      done ;;
    rollout)
      step 170 python3 benchmarks/bench_rollout.py --models dense --backend triton --out "$OUT/rollout_dense.json" ;;
    moe)
      step 150 python3 benchmarks/bench_rollout.py --models moe --moe-layers 24 --new-tokens 256 --backend triton \
        --no-hf --rounds 3 --out "$OUT/rollout_moe24.json"
      step 60 python3 benchmarks/bench_rollout.py --models moe --moe-layers 24 --new-tokens 256 --backend triton \
        --no-hf --recipes aligned --moe-decode-rows 0 --out "$OUT/rollout_moe24_bf16_copy.json" ;;
    sample)
      step 90 python3 benchmarks/bench_sample.py --out "$OUT/kernels_sample.json" ;;
    rollout_draw)
      for i in 1 2; do
        for draw in torch kernel; do
          step 90 python3 benchmarks/bench_rollout.py --models moe --moe-layers 24 --new-tokens 256 \
            --backend triton --no-hf --rounds 2 --draw $draw --out "$OUT/extra/rollout_moe24_${draw}_$i.json"
        done
      done ;;
    rollout_combine)
      for i in 1 2; do
        for combine in torch kernel; do
          step 90 python3 benchmarks/bench_rollout.py --models moe --moe-layers 24 --new-tokens 256 \
            --backend triton --no-hf --rounds 2 --moe-combine $combine \
            --out "$OUT/extra/rollout_moe24_combine_${combine}_$i.json"
        done
      done ;;
    decode)
      step 260 python3 benchmarks/bench_decode_gemm.py --out "$OUT/kernels_decode_gemm.json" ;;
    ncu_decode)
      NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -n 1)
      while read -r spec; do
        name=$(echo "$spec" | sed 's/--//g; s/+/p/g; s/|/_/g; s/ /_/g')
        step 60 "$NCU" --clock-control none --profile-from-start off --csv --page details \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
          --section WarpStateStats --section ComputeWorkloadAnalysis \
          --metrics lts__t_bytes.sum,dram__bytes_read.sum,gpu__time_duration.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
          python3 benchmarks/ncu_decode.py $spec
        cp "$OUT/extra/step.txt" "$OUT/extra/ncu_$name.csv"
      done <<< "$NCU_SPECS" ;;
    decode_wide)
      step 300 python3 benchmarks/sweep_decode_gemm.py --wide --ms 32,64 --layers gate+up,down,q\|o \
        --out "$OUT/kernels_decode_wide_sweep.json" ;;
    grouped_decode)
      step 200 python3 benchmarks/bench_grouped_decode.py --out "$OUT/kernels_grouped_decode.json" ;;
    quantize)
      step 90 python3 benchmarks/bench_quantize.py --out "$OUT/kernels_quantize.json" ;;
    gemm)
      step 150 python3 benchmarks/bench_gemm.py --out "$OUT/kernels_gemm.json"
      step 100 python3 benchmarks/bench_grouped_gemm.py --out "$OUT/kernels_grouped_gemm.json" ;;
    grouped)
      step 150 python3 benchmarks/bench_grouped_gemm.py --out "$OUT/kernels_grouped_gemm.json" ;;
    floor)
      step 200 python3 benchmarks/probe_decode_floor.py --out "$OUT/probe_decode_floor.json" ;;
    sweep)
      step 150 python3 benchmarks/sweep_quantize.py --out "$OUT/kernels_quantize_sweep.json" ;;
    tiles)
      step 400 python3 benchmarks/sweep_aligned_gemm.py --out "$OUT/aligned_gemm_sweep.json" ;;
    tiles_step)
      step 300 python3 benchmarks/sweep_aligned_gemm.py --decode-step --out "$OUT/aligned_tiles_decode_step.json" ;;
    learner)
      step 160 python3 benchmarks/bench_learner.py --kernels --out "$OUT/learner.json" ;;
    learner_ab)
      step 70 python3 benchmarks/bench_learner.py --models dense --aligned-small-tile \
        --out "$OUT/learner_aligned_small_tile.json" ;;
    norm)
      step 90 python3 benchmarks/bench_norm.py --out "$OUT/kernels_norm.json" ;;
    learner_norm) learner_ab "" norm-path quantizing element ;;
    learner_launch) learner_ab "" launch-path direct triton ;;
    learner_attn) learner_ab attn_ attention-backward kernel reference ;;
    learner_proj) learner_ab proj_ projections fused separate ;;
    attention_backward)
      step 150 python3 benchmarks/bench_attention_backward.py --out "$OUT/kernels_attention_backward.json" ;;
    learner_dense)
      step 70 python3 benchmarks/bench_learner.py --models dense --out "$OUT/learner_dense.json" ;;
    host)
      step 120 python3 benchmarks/profile_learner_host.py --out "$OUT/learner_host_profile.json" ;;
    linear_host)
      step 60 python3 benchmarks/probe_linear_host.py --out "$OUT/probe_linear_host.json" ;;
    probe)
      step 60 python3 benchmarks/probe_aligned_tile.py --out "$OUT/probe_aligned_tile.json" ;;
    agreement)
      for pair in "bf16 bf16 triton" "aligned aligned triton" "te vllm ref"; do
        read -r lr sr backend <<< "$pair"
        step 40 python3 -m minite.cli agreement --preset qwen3-1.7b --learner-recipe "$lr" \
          --sampler-recipe "$sr" --backend "$backend" --num-prompts 16 --n 4 --max-tokens 64 --json
        cp "$OUT/extra/step.txt" "$OUT/extra/agreement_${lr}_$sr.txt"
      done ;;
    diagnose)
      for pair in "te vllm 150" "aligned aligned 110"; do
        read -r lr sr cap <<< "$pair"
        step "$cap" python3 -m minite.cli diagnose --preset qwen3-1.7b --learner-recipe "$lr" \
          --sampler-recipe "$sr" --n-prompts 16 --max-tokens 48 --out "$OUT/extra/diagnose_${lr}_$sr"
      done ;;
    train)
      step 600 python3 -m minite.cli train --config configs/gpu_arith.toml --recipe.overrides.backend=triton \
        --run_dir=/tmp/minite_train
      mkdir -p "$OUT/extra/train"
      find /tmp/minite_train -maxdepth 1 -type f -exec cp {} "$OUT/extra/train/" \; ;;
    *) echo "unknown part $part" | tee -a "$log" ;;
  esac
done
rm -f "$OUT/extra/step.txt"
tar czf "$OUT/triton_cache.tgz" .triton_cache 2>/dev/null
[ "$(stat -c %s "$OUT/triton_cache.tgz" 2>/dev/null || echo 0)" -gt 15000000 ] && rm -f "$OUT/triton_cache.tgz"
(cd "$OUT" && tar czf results.tgz extra $(ls ./*.json 2>/dev/null) && rm -rf extra ./*.json)
