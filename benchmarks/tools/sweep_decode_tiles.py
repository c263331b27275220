"""Sweep of the decode W4A4 kernel's tiles (one GPU call): Qwen3-8B shapes x M in {1, 8, 32, 64}.

Compiles every candidate first in parallel worker processes (they fill Triton's on-disk cache), then
times, in one process: cuBLAS bf16, the `aligned` config on the packed weight, `decode_config`'s
pick, and each candidate; each candidate's output is compared bit for bit with the aligned path on
the dequantized copy (Gaussian data: nearly every fp32 sum is exact, docs/facts.md). cuBLAS and the
candidates are timed as ops/bench_decode_gemm.py times them (CUDA graphs over rotating weight copies);
the aligned config with do_bench.

What the tiles trade (measured on the H200, docs/performance.md): fewer pipeline stages (more CTAs
per SM) beat deeper ones; wide N tiles (`--wide`: less activation re-reading
from L2) lose at M = 32 / 64, where the kernel is latency-bound.

    python -m benchmarks.tools.sweep_decode_tiles --out OUT.json [--workers 12] [--wide --ms 32,64]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse
import json
import multiprocessing as mp
import time

import torch

from benchmarks.common import bench_ms, copies, env_info, graph_us, warm_up
from benchmarks.ops.bench_decode_gemm import MS, SHAPES, operands

# (BN, BK, num_warps, num_stages, MIN_PROGRAMS[, SPLIT_K]) per M padded; SPLIT_K from decode_config's
# rule (uncapped) unless given. BN a
# multiple of 64 with 4 warps runs wgmma; 1-2 warps (or BN 32) run mma.sync (no warpgroup waits)
TILES = {
    16: [(64, 256, 4, 3, 264), (128, 256, 4, 3, 264), (64, 128, 4, 3, 264), (128, 128, 4, 3, 264),
         (64, 256, 4, 4, 264),
         # more programs at M <= 16 (the floor probe's fastest reads use 1-4k small programs)
         (64, 256, 4, 3, 528), (64, 256, 4, 2, 528), (64, 256, 4, 2, 264), (64, 256, 4, 3, 132),
         (64, 128, 4, 3, 528), (64, 128, 4, 4, 1056)],
    32: [(64, 256, 4, 3, 264), (64, 128, 4, 3, 264), (128, 256, 4, 3, 264), (128, 128, 4, 3, 264),
         (128, 128, 4, 3, 132)],
    64: [(64, 128, 4, 3, 264, 1), (64, 128, 4, 3, 264, 2), (64, 256, 4, 2, 0, 4), (128, 128, 4, 3, 264, 1),
         (128, 128, 4, 3, 0, 2), (128, 128, 4, 3, 0, 4), (128, 256, 4, 2, 0, 4),
         # BK 256 unsplit: a K step is a whole 256-column memory tile of the decode layout
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
    p.add_argument("--out", default="decode_tiles_sweep.json")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="the M values to sweep, comma-separated")
    p.add_argument("--layers", default=",".join(SHAPES), help="the shapes to sweep, comma-separated")
    p.add_argument("--wide", action="store_true", help="the wide N tiles (TILES_WIDE) at M = 32 / 64")
    args = p.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    layers = args.layers.split(",")
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
            # CUDA graphs over rotating weight copies (ops/bench_decode_gemm.py): HBM reads, no launch gaps
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
