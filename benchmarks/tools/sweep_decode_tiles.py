"""Sweep of the decode W4A4 kernel's tiles (one GPU call): Qwen3-8B shapes x M in {1, 8, 32, 64}.

Compiles every candidate first in parallel worker processes (they fill Triton's on-disk cache), then
times, in one process: cuBLAS bf16, the `aligned` config on the packed weight, `decode_config`'s
pick, and each candidate; each candidate's output is compared bit for bit with the aligned path on
the dequantized copy (Gaussian data: nearly every fp32 sum is exact, FACTS.md 1.1). cuBLAS and the
candidates are timed as bench_decode_gemm.py times them (CUDA graphs over rotating weight copies);
the aligned config with do_bench.

Session 5, in order (graph timings in bench_decode_gemm.py; sass_kernels.py decode for the counts):
- int16 code words, inline-PTX dequant into the wgmma register operand, strided bf16 activation
  converted to fp16 in registers: 5.2-9.5 instructions per weight; measured 0.1-0.6x. The SASS had a
  MEMBAR.ALL.CTA + proxy fence before every MMA (the register-written activation tile).
- decode weight layout (activation slices async-copied untouched): 5.6-5.9 per weight, no fence;
  measured 1.1-1.5x at M <= 8 on the large shapes (1.25-1.5 TB/s), 0.5-0.8x at M = 64.
- block scales stored in the operand dtype (no E4M3 conversion in the loop): 3.2-3.8 per weight.
  Expected 1.5-2x at M <= 8 if latency hiding holds, mma.sync tiles better than wgmma at M = 1-16.
  Measured (graph): 1.3-2.2x at M <= 8, 0.8-1.4x at M = 64; fewer stages (more CTAs per SM) won,
  mma.sync at 1-2 warps lost.
- word bit placement (WORD_BITS) and an M <= 8 tile on mma.sync at 4 warps (m16n8k16: half the
  activation tile): 2.7 per weight at M <= 8, 3.1-3.3 above. Expected ~10-20% at M <= 8.
  Measured: BK 512 best at M <= 8 (1.3-2.6x, the table's tile since).
- BK 128 at M = 32 / 64 (half the activation tile per stage, more CTAs per SM). Expected: M = 64
  gains most (its st2 tile holds two CTAs per SM), ~10-25 %. Measured: no gain (0.74-1.43x as
  before): occupancy is not what holds M = 64 back; the serialized wgmma waits and the activation
  re-read by every N tile are the suspects.

Session 8 (ncu_decode.py, run_gpu_engines.sh ncu_decode; s8 run1):
- Nsight Compute at M = 64 (gate+up): L2 47 %, DRAM 34 %, tensor pipe 33 % of peak, issue 31 %:
  latency-bound, not bandwidth-bound, so the activation re-reads are not the limit; the SASS waits
  for each of the four dots' wgmma before dequantizing the next operand.
- Wide N tiles (TILES_WIDE: BN 128 / 256 on 8 warps, less activation traffic): slower everywhere
  (e.g. gate+up M = 64: 53.9 vs 40.3 us), fewer programs and no more overlap.
- A layout in MMA register order, one dot per K step (now `decode_gemm`'s; probe
  exp_decode_pairs.py at 736de97, s8 run2): the wgmma waits allow 7 in flight. Expected: M = 32 / 64
  gain most. Measured (final tiles, run6 vs s6 run5): M = 32 4-28 % less time (q|o 12.7 -> 10.2,
  down 23.9 -> 18.6 us), M = 64 9-19 % less, M <= 8 from 4 % more to 3 % less; still far from the
  13 us tensor-pipe floor at M = 64 (gate+up 36.0 us).
- A tiled copy of that layout (each 64-row block's K step contiguous; probe exp_decode_tiled.py at
  93fb9ba, s8 run9). Expected 10-30 % at M <= 8 if DRAM page locality held it back. Measured
  1.02-1.07x (gate+up 1.06-1.07x): a small part of the gap to cuBLAS's bandwidth.

Session 10: the split at M <= 16 (MIN_PROGRAMS 132 to 1056, 2-4 stages, BK 128 / 256), after the
floor probe (probe_decode_floor.py) found reads fastest over 1-4k small programs. Expected: at most
5 % on down and gate|up (their reduction cost grows with the split). Measured (s10 run9): the picks
fastest on gate|up, gate+up and down; q|o 3-5 % and k|v 2-4 % faster on other splits.

Session 9 (h200_2026-11-30_s9): the layout in memory tiles of 64 rows x 256 columns (now
`decode_gemm`'s; 4-6 % less time on gate+up); 8-bit scales lost (more instructions than bytes
saved). The M = 32 / 64 sweep on it (run5): the picks best or within 3 %, but q|o at M = 64 (split 2
at BK 128, 7 % faster); BK 256 unsplit at M = 64 (whole memory tiles) did not win.

    python benchmarks/sweep_decode_gemm.py --out OUT.json [--workers 12]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse
import json
import multiprocessing as mp
import time

import torch

SHAPES = {"q|o": (4096, 4096), "k|v": (1024, 4096), "gate|up": (12288, 4096),
          "gate+up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 8, 32, 64)
# (BN, BK, num_warps, num_stages, MIN_PROGRAMS[, SPLIT_K]) per M padded; SPLIT_K from decode_config's
# rule (uncapped) unless given. BN a
# multiple of 64 with 4 warps runs wgmma; 1-2 warps (or BN 32) run mma.sync (no warpgroup waits)
TILES = {
    16: [(64, 256, 4, 3, 264), (128, 256, 4, 3, 264), (64, 128, 4, 3, 264), (128, 128, 4, 3, 264),
         (64, 256, 4, 4, 264),
         # s10: the split at M <= 16 (the floor probe's fastest reads used 1-4k small programs)
         (64, 256, 4, 3, 528), (64, 256, 4, 2, 528), (64, 256, 4, 2, 264), (64, 256, 4, 3, 132),
         (64, 128, 4, 3, 528), (64, 128, 4, 4, 1056)],
    32: [(64, 256, 4, 3, 264), (64, 128, 4, 3, 264), (128, 256, 4, 3, 264), (128, 128, 4, 3, 264),
         (128, 128, 4, 3, 132)],
    64: [(64, 128, 4, 3, 264, 1), (64, 128, 4, 3, 264, 2), (64, 256, 4, 2, 0, 4), (128, 128, 4, 3, 264, 1),
         (128, 128, 4, 3, 0, 2), (128, 128, 4, 3, 0, 4), (128, 256, 4, 2, 0, 4),
         # BK 256 unsplit: a K step is a whole 256-column memory tile of the decode layout (s9)
         (64, 256, 4, 2, 264, 1), (64, 256, 4, 3, 264, 1), (64, 256, 4, 2, 0, 2)],
}
# wide N tiles for M = 32 / 64: the activation tile (M * BK * 2 bytes) is read from L2 by every N tile,
# 3.2x the weight bytes at BM = BN = 64, so BN 128 / 256 (two warpgroups at 8 warps) cut that traffic;
# a sixth entry forces SPLIT_K (split-K partials cost SPLIT * BM * N * 8 bytes of traffic)
TILES_WIDE = {
    32: [(64, 256, 4, 3, 264), (128, 256, 8, 2, 0, 1), (128, 256, 8, 3, 0, 1), (128, 256, 4, 2, 0, 1),
         (256, 256, 8, 2, 0, 1), (128, 256, 8, 2, 0, 2), (256, 256, 8, 2, 0, 2), (128, 128, 8, 3, 0, 1)],
    64: [(64, 256, 4, 2, 264), (128, 256, 8, 2, 0, 1), (128, 256, 8, 1, 0, 1), (128, 256, 4, 2, 0, 1),
         (256, 256, 8, 2, 0, 1), (256, 128, 8, 2, 0, 1), (128, 256, 8, 2, 0, 2), (256, 256, 8, 2, 0, 2),
         (128, 128, 8, 3, 0, 1), (64, 256, 4, 2, 0, 1)],
}


def split_for(n, k, bn, bk, min_programs):
    split = 1
    while -(-n // bn) * split < min_programs and split < 16 and k % (2 * split * bk) == 0:
        split *= 2
    return split


def candidates(m, n, k, wide=False):
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    out = []
    for bn, bk, wp, st, mp_, *forced in (TILES_WIDE if wide else TILES)[bm]:
        sp = forced[0] if forced else split_for(n, k, bn, bk, mp_)
        cfg = dict(kernel="decode", BM=bm, BN=bn, BK=bk, SPLIT_K=sp, num_warps=wp, num_stages=st)
        if k % (sp * bk) == 0 and cfg not in out:
            out.append(cfg)
    return out


def operands(n, k, m, seed=0):
    from minite.kernels import nvfp4 as kq

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    wq = kq.quantize(w, "tensor")
    a, sa = kq.quantize_unscaled(x)
    return w, x, wq, a, sa


def jobs(ms=MS, layers=tuple(SHAPES), wide=False):
    return [(layer, m, cfg) for layer in layers for m in ms for cfg in candidates(m, *SHAPES[layer], wide)]


def run(a, sa, wq, cfg, packed, out_dtype=torch.bfloat16):
    """The decode kernel on codes already in the decode layout of cfg's BK (cached in `packed`)."""
    from minite.kernels import decode_gemm as kd

    if "w" not in packed:
        packed["w"] = kd.pack_weight(wq.codes, wq.block_scales, a.dtype)
    return kd.decode_gemm(a, sa, packed["w"], wq.global_scale, out_dtype=out_dtype, config=cfg)


def compile_worker(chunk):

    errors = []
    cache = {}
    for layer, m, cfg in chunk:
        n, k = SHAPES[layer]
        if (n, k, m) not in cache:
            cache[(n, k, m)] = operands(n, k, m), {}
        (_, _, wq, a, sa), packed = cache[(n, k, m)]
        try:
            run(a, sa, wq, cfg, packed)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a candidate that fails to compile is reported, not fatal)
            errors.append((layer, m, cfg, f"{type(e).__name__}: {str(e)[:200]}"))
    return errors


def tile_name(r):
    return f"BM{r['BM']} BN{r['BN']} BK{r['BK']} S{r['SPLIT_K']} w{r['num_warps']} st{r['num_stages']}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="decode_gemm_sweep.json")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="the M values to sweep, comma-separated")
    p.add_argument("--layers", default=",".join(SHAPES), help="the shapes to sweep, comma-separated")
    p.add_argument("--wide", action="store_true", help="the wide N tiles (TILES_WIDE) at M = 32 / 64")
    args = p.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    layers = args.layers.split(",")
    from bench_common import bench_ms, env_info, warm_up
    from bench_decode_gemm import copies, graph_us

    from minite.kernels import decode_gemm as kd
    from minite.kernels import gemm as kg

    t0 = time.time()
    todo = jobs(ms, layers, args.wide)
    chunks = [todo[i:: args.workers] for i in range(args.workers)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        errors = [e for errs in pool.map(compile_worker, chunks) for e in errs]
    failed = {(layer, m, json.dumps(cfg, sort_keys=True)): err for layer, m, cfg, err in errors}
    print(f"compiled {len(todo)} candidates in {time.time() - t0:.0f} s, {len(errors)} failed", flush=True)
    for e in errors[:8]:
        print("  failed:", e)

    warm_up()
    rows, best = [], []
    for layer in layers:
        n, k = SHAPES[layer]
        for m in ms:
            w, x, wq, a, sa = operands(n, k, m)
            ref = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq), wq.global_scale, out_dtype=torch.float32)
            # CUDA graphs over rotating weight copies (bench_decode_gemm.py): HBM reads, no launch gaps
            base = graph_us([lambda w=w_: torch.matmul(x, w.t()) for w_ in copies(w, w.numel() * 2)]) / 1e3
            aligned = bench_ms(lambda: kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales),
                               warmup=5, rep=30)
            pick = kd.decode_config(m, n, k)
            cands = candidates(m, n, k, args.wide)
            if pick not in cands:
                cands.append(pick)
            top, packed = None, {}
            for cfg in cands:
                key = (layer, m, json.dumps(cfg, sort_keys=True))
                row = dict(layer=layer, M=m, N=n, K=k, **{c: cfg[c] for c in
                           ("BM", "BN", "BK", "SPLIT_K", "num_warps", "num_stages")},
                           picked=cfg == pick, cublas_us=base * 1e3)
                if key in failed:
                    rows.append(dict(row, error=failed[key]))
                    continue
                try:
                    got = run(a, sa, wq, cfg, packed, torch.float32)
                    dw = packed["w"]
                    dws = [kd.DecodeWeight(c, dw.scales.clone(), dw.n)
                           for c in copies(dw.codes, n * k * 5 // 8)]
                    t = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale, config=cfg)
                                  for d in dws]) / 1e3
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(row, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                exact = float((got == ref).float().mean())
                rel = float((got - ref).abs().max() / ref.abs().max())
                row.update(us=t * 1e3, speedup=base / t, weight_tb_s=n * k * 0.625 / t / 1e9,
                           exact_vs_aligned=exact, max_rel_err=rel)
                rows.append(row)
                if exact > 0.99 and (top is None or t < top["us"] / 1e3):
                    top = row
            summary = dict(layer=layer, M=m, cublas_us=base * 1e3, aligned_x=base / aligned)
            pr = next((r for r in rows if r["layer"] == layer and r["M"] == m and r["picked"]
                       and "us" in r), None)
            if pr:
                summary.update(picked_us=pr["us"], picked_x=pr["speedup"])
            if top:
                summary.update(best_us=top["us"], best_x=top["speedup"], best_tb_s=top["weight_tb_s"],
                               best=tile_name(top))
            best.append(summary)
            print(json.dumps(summary), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(benchmark="decode gemm sweep", env=env_info(), best=best, rows=rows), f, indent=1)
    print(f"\n== decode sweep ({time.time() - t0:.0f} s): best per shape, x = speedup over cuBLAS bf16")
    print(f"{'layer':>8} {'M':>3} {'cublas':>7} {'best_us':>8} {'best_x':>6} {'TB/s':>5} {'pick_x':>6} "
          f"{'algn_x':>6}  best tile")
    for s in best:
        print(f"{s['layer']:>8} {s['M']:>3} {s['cublas_us']:7.2f} {s.get('best_us', 0):8.2f} "
              f"{s.get('best_x', 0):6.2f} {s.get('best_tb_s', 0):5.2f} {s.get('picked_x', 0):6.2f} "
              f"{s['aligned_x']:6.2f}  {s.get('best', 'none')}")


if __name__ == "__main__":
    main()
