"""Sweep of the TMA W4A4 GEMM (`gemm._w4a4_tma_kernel`: operands by tensor descriptors, optionally
persistent, the `aligned` / `aligned_large` / `prefill` configs) against the pointer kernel (which
packed weights and unaligned operands take), in one GPU call.

Every candidate keeps the aligned K order (BK = 64 chunks of k16 MMAs), so it must give the pointer
tile's bits: checked on heavy-tailed data at every timed shape (`same_bits`) and across M in
{1, 7, 64, 300, 4096} (`batch_invariant`). Timed: Qwen3-8B layers at M 4096 / 16384 (do_bench, as
bench_gemm.py) and the rollout decode-step shapes at M = 512 (CUDA graphs over rotating weight
copies, as `sweep_gemm_tiles.py --decode-step`), against cuBLAS bf16, the current configuration
(`vs_current`) and the same tiles on pointer loads.

    python -m benchmarks.tools.sweep_gemm_tma --out OUT.json [--workers 12]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse
import itertools
import json
import time

import torch

from benchmarks.common import bench_ms, copies, env_info, graph_us, warm_up
from benchmarks.tools.sweep_gemm_tiles import (
    DECODE_STEP,
    DECODE_STEP_M,
    DENSE,
    DENSE_MS,
    INVARIANCE_MS,
    dense_operands,
)

BASE = dict(BK=64, GROUP_M=8, TMA=True)
# the `aligned` (M < 2048) and `aligned_large` tiles on pointer loads
POINTER_SMALL = dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
POINTER_LARGE = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
CANDIDATES = [dict(BASE, BM=bm, BN=bn, num_warps=w, num_stages=s, PERSIST=p, FLATTEN=f)
              for (bm, bn, w, s), (p, f) in itertools.product(
                  [(128, 256, 8, 3), (128, 256, 8, 4), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4),
                   (64, 256, 8, 4)],
                  [(0, False), (1, False), (1, True)])]


def name(cfg: dict) -> str:
    if not cfg.get("TMA"):
        return f"pointer {cfg['BM']}x{cfg['BN']} w{cfg['num_warps']} s{cfg['num_stages']}"
    kind = "tma" + (" persistent" if cfg["PERSIST"] else "") + (" flat" if cfg["FLATTEN"] else "")
    return f"{kind} {cfg['BM']}x{cfg['BN']} w{cfg['num_warps']} s{cfg['num_stages']}"


def shapes():
    return ([(m, n, k) for (n, k), m in itertools.product(DENSE.values(), DENSE_MS[1:])]
            + [(DECODE_STEP_M, n, k) for n, k in DECODE_STEP.values()])


def compile_worker(chunk):
    from minite.kernels import gemm as kg

    dev = torch.device("cuda")
    errors = []
    for cfg in chunk:
        try:
            for n, k in sorted({(n, k) for _, n, k in shapes()}):
                kg.w4a4_gemm(*dense_operands(512, n, k, dev), config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a candidate that fails to build is reported, not fatal)
            errors.append((name(cfg), f"{type(e).__name__}: {str(e)[:300]}"))
    return errors


def main():
    import multiprocessing as mp

    from minite.kernels import gemm as kg

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--workers", type=int, default=12)
    args = p.parse_args()
    dev = torch.device("cuda")
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        failed = dict(e for errs in pool.map(compile_worker, [CANDIDATES[i:: args.workers]
                                                              for i in range(args.workers)]) for e in errs)
    print(f"compiled {len(CANDIDATES)} candidates in {time.time() - t0:.0f} s; failed: {failed}", flush=True)
    cands = [c for c in CANDIDATES if name(c) not in failed]
    warm_up()

    a, sa, w, sw = dense_operands(max(INVARIANCE_MS), 1024, 4096, dev, seed=2)
    invariance = {}
    for cfg in cands:
        full = kg.w4a4_gemm(a, sa, w, sw, config=cfg)
        invariance[name(cfg)] = all(torch.equal(kg.w4a4_gemm(a[:m], sa[:m], w, sw, config=cfg), full[:m])
                                    for m in INVARIANCE_MS)
    print("batch invariant:", invariance, flush=True)

    rows = []
    for m, n, k in shapes():
        a, sa, w, sw = dense_operands(m, n, k, dev)
        current = kg.pick_config("aligned", m, n)
        pointer = [POINTER_LARGE if m >= kg.ALIGNED_LARGE_M else POINTER_SMALL]
        want = kg.w4a4_gemm(a, sa, w, sw, config=pointer[0])
        if m == DECODE_STEP_M:  # graph-timed over rotating weight copies (weights from HBM)
            ws = copies(w, w.numel() * 2)
            timer = lambda f: graph_us([lambda w_=w_: f(w_) for w_ in ws]) / 1e3
        else:
            timer = lambda f: bench_ms(lambda: f(w))
        base = timer(lambda w_: torch.matmul(a, w_.t()))
        cur = timer(lambda w_: kg.w4a4_gemm(a, sa, w_, sw, config=current))
        for cfg in pointer + cands:
            same = bool(torch.equal(kg.w4a4_gemm(a, sa, w, sw, config=cfg), want))
            t = timer(lambda w_: kg.w4a4_gemm(a, sa, w_, sw, config=cfg))
            rows.append(dict(M=m, N=n, K=k, kernel=name(cfg), ms=t, cublas_ms=base, vs_cublas=base / t,
                             vs_current=cur / t, same_bits=same, tflops=2 * m * n * k / t / 1e9))
            print(json.dumps(rows[-1]), flush=True)
    totals = {}
    for r in rows:
        totals.setdefault((r["M"] == DECODE_STEP_M, r["kernel"]), []).append(r["vs_cublas"])
    for (step, kernel), v in sorted(totals.items(), key=lambda kv: -sum(kv[1]) / len(kv[1])):
        print(f"{'M=512' if step else 'M>=4096'} {kernel}: mean vs cuBLAS {sum(v) / len(v):.3f} "
              f"(min {min(v):.3f}, {len(v)} shapes)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="TMA W4A4 GEMM sweep", env=env_info(), failed=failed,
                           batch_invariant=invariance, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
