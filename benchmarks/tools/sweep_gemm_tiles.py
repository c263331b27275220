"""Sweep of tile configurations for the batch-invariant ('aligned') W4A4 GEMM, dense and MoE grouped
(one GPU call): which tiles keep the aligned contract, and how fast they are.

The aligned path must give a row the same bits whatever M is and must give an expert's rows the bits
of a dense GEMM with that expert's weight; any single tile used everywhere can be the aligned one.
For each candidate (BM, BN, BK, warps, stages) this records, on heavy-tailed data where fp32
accumulation order matters:
- `batch_invariant`: rows bitwise equal across M in {1, 7, 64, 300, 4096};
- `grouped_equals_dense`: the grouped kernel with the same tile gives each expert's rows the dense bits;
- `same_bits_as_current`: the fraction of outputs equal to the current `aligned` config's (1.0 means
  switching keeps every stored result reproducible);
- time at Qwen3-8B layer shapes for M in {512, 4096, 16384} against cuBLAS bf16 and the current
  config, and at Qwen3-30B-A3B expert shapes against `torch._grouped_mm` (bf16).

`--decode-step` times the same tiles instead at a rollout decode step (M = 512 rows, the rollout
models' attention and MLP shapes: Qwen3-1.7B and the Qwen3-30B-A3B attention), each as a CUDA graph
over rotating weight copies (no launch gaps, weights from HBM as in a model's layer sequence),
checking the bits against the current tile.

    python -m benchmarks.tools.sweep_gemm_tiles --out OUT.json [--workers 12] [--decode-step]
    TRITON_INTERPRET=1 python -m benchmarks.tools.sweep_gemm_tiles --smoke   # the script's logic, CPU
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse
import itertools
import json
import time

import torch

from benchmarks.common import bench_ms, copies, env_info, graph_us, heavy, warm_up

DENSE = {"q|o": (4096, 4096), "k|v": (1024, 4096), "gate|up": (12288, 4096), "down": (4096, 12288)}
DENSE_MS = (512, 4096, 16384)
EXPERTS, TOP_K, HIDDEN, EXPERT_INTER = 128, 8, 2048, 768
MOE_TOKENS = (512, 4096, 16384)
INVARIANCE_MS = (1, 7, 64, 300, 4096)
# (N, K) at a rollout decode step: Qwen3-1.7B (dense rollout) and the Qwen3-30B-A3B attention (MoE)
DECODE_STEP = {"1.7B q|o": (2048, 2048), "1.7B k|v": (1024, 2048), "1.7B gate|up": (6144, 2048),
               "1.7B down": (2048, 6144), "A3B q": (4096, 2048), "A3B k|v": (512, 2048),
               "A3B o": (2048, 4096)}
DECODE_STEP_M = 512
GRID = dict(BM=(64, 128), BN=(64, 128, 256), BK=(64, 128), warps_stages=((4, 3), (4, 4), (8, 3), (8, 4)))


def candidates(smoke: bool = False) -> list[dict]:
    if smoke:
        return [dict(BM=16, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=1),
                dict(BM=32, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=1)]
    out = []
    for bm, bn, bk, (w, s) in itertools.product(GRID["BM"], GRID["BN"], GRID["BK"], GRID["warps_stages"]):
        if bm * bn >= 128 * 256 and w == 4:
            continue  # a 32k-element fp32 accumulator on one warpgroup spills
        out.append(dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=w, num_stages=s))
    # small row tiles (mma.sync instead of wgmma) for decode and MoE's ~32 rows per expert: usable in
    # that regime only if they keep the current bits (`same_bits_as_current` = 1)
    for bm, bn, s in itertools.product((16, 32), (64, 128), (3, 4)):
        out.append(dict(BM=bm, BN=bn, BK=64, GROUP_M=8, num_warps=4, num_stages=s))
    return out


def name(cfg: dict) -> str:
    return f"{cfg['BM']}x{cfg['BN']}x{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']}"


def dense_operands(m, n, k, dev, seed=0):
    from minite.kernels import gemm as kg
    from minite.kernels import nvfp4 as kq

    wq = kq.quantize(heavy(n, k, seed + 1, dev), "tensor")
    a, sa = kq.quantize_unscaled(heavy(m, k, seed, dev), kg.operand_dtype(dev))
    return a, sa, kg.unscaled_copy(wq).to(a.dtype), wq.global_scale


def moe_operands(tokens, n, k, dev, seed=0):
    """Rows of `tokens * TOP_K` token-expert pairs sorted by expert (uneven counts), expert weights."""
    from minite.kernels import gemm as kg
    from minite.kernels import nvfp4 as kq

    g = torch.Generator().manual_seed(seed)
    experts = EXPERTS if dev.type == "cuda" else 4
    ids = torch.randint(0, experts, (tokens * TOP_K,), generator=g).sort().values
    offsets = torch.nn.functional.pad(torch.bincount(ids, minlength=experts).cumsum(0), (1, 0)).to(dev)
    codes, sb, sdec, _, vals = kq.quantize_tensors(heavy(experts * n, k, seed + 1, dev).view(experts, n, k))
    a, sa = kq.quantize_unscaled(heavy(ids.numel(), k, seed, dev), kg.operand_dtype(dev))
    return a, sa, vals.to(a.dtype), sdec, offsets


def compile_worker(chunk, shapes=None):
    from minite.kernels import gemm as kg
    from minite.kernels import grouped_gemm as gg

    dev = torch.device("cuda")
    errors = []
    for cfg in chunk:
        try:
            if shapes is not None:
                for n, k in sorted(set(shapes)):
                    kg.w4a4_gemm(*dense_operands(64, n, k, dev), config=cfg)
                torch.cuda.synchronize()
                continue
            for n, k in sorted(set(DENSE.values())):
                a, sa, w, sw = dense_operands(64, n, k, dev)
                kg.w4a4_gemm(a, sa, w, sw, config=cfg)
            for n, k in ((2 * EXPERT_INTER, HIDDEN), (HIDDEN, EXPERT_INTER)):
                a, sa, w, sw, offs = moe_operands(64, n, k, dev)
                gg.grouped_w4a4_gemm(a, sa, w, sw, offs, config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a candidate that fails to build is reported, not fatal)
            errors.append((json.dumps(cfg, sort_keys=True), f"{type(e).__name__}: {str(e)[:200]}"))
    return errors


def contract(cfg, current, dev, smoke) -> dict:
    """Batch invariance, grouped == dense, and agreement with the current aligned config."""
    from minite.kernels import gemm as kg
    from minite.kernels import grouped_gemm as gg

    n, k = (48, 64) if smoke else (1024, 4096)
    ms = (1, 7, 40) if smoke else INVARIANCE_MS
    a, sa, w, sw = dense_operands(max(ms), n, k, dev, seed=2)
    full = kg.w4a4_gemm(a, sa, w, sw, config=cfg)
    invariant = all(torch.equal(kg.w4a4_gemm(a[rows], sa[rows], w, sw, config=cfg), full[rows])
                    for m in ms for rows in (slice(0, m), slice(max(ms) - m, max(ms))))
    same = float((full == kg.w4a4_gemm(a, sa, w, sw, config=current)).float().mean())
    ga, gsa, gw, gsw, offs = moe_operands(8 if smoke else 256, n, k, dev, seed=3)
    grouped = gg.grouped_w4a4_gemm(ga, gsa, gw, gsw, offs, config=cfg)
    bounds = offs.tolist()
    grouped_ok = all(
        torch.equal(grouped[lo:hi], kg.w4a4_gemm(ga[lo:hi], gsa[lo:hi], gw[e], gsw[e], config=cfg))
        for e, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if hi > lo)
    return dict(batch_invariant=invariant, grouped_equals_dense=grouped_ok, same_bits_as_current=same)


def decode_step_worker(chunk):
    return compile_worker(chunk, list(DECODE_STEP.values()))


def decode_step(args) -> None:
    """Every candidate tile at M = 512 on the rollout shapes, CUDA-graph timed (module docstring)."""
    import multiprocessing as mp

    from minite.kernels import gemm as kg

    dev = torch.device("cuda")
    current = dict(kg.CONFIGS["aligned"])
    cands = candidates()
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        chunks = [cands[i:: args.workers] for i in range(args.workers)]
        failed = dict(e for errs in pool.map(decode_step_worker, chunks) for e in errs)
    print(f"compiled {len(cands)} tiles in {time.time() - t0:.0f} s, {len(failed)} failed", flush=True)
    warm_up()
    timings = []
    for layer, (n, k) in DECODE_STEP.items():
        a, sa, w, sw = dense_operands(DECODE_STEP_M, n, k, dev)
        ws = copies(w, w.numel() * 2)
        base = graph_us([lambda w=w_: torch.matmul(a, w.t()) for w_ in ws])
        want = kg.w4a4_gemm(a, sa, w, sw, config=current)
        cur = graph_us([lambda w=w_: kg.w4a4_gemm(a, sa, w, sw, config=current) for w_ in ws])
        for cfg in cands:
            if json.dumps(cfg, sort_keys=True) in failed:
                continue
            same = bool(torch.equal(kg.w4a4_gemm(a, sa, w, sw, config=cfg), want))
            t = graph_us([lambda w=w_: kg.w4a4_gemm(a, sa, w, sw, config=cfg) for w_ in ws])
            timings.append(dict(shape=layer, M=DECODE_STEP_M, N=n, K=k, tile=name(cfg), **cfg, us=t,
                                cublas_us=base, vs_cublas=base / t, vs_current=cur / t, same_bits=same))
    totals = {}
    for t in timings:
        totals.setdefault(t["tile"], []).append(t["us"])
    ranked = sorted((sum(v), tile) for tile, v in totals.items() if len(v) == len(DECODE_STEP))
    print("tiles by total us over the decode-step shapes:", [(tile, round(us, 1)) for us, tile in ranked[:8]])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="aligned tile sweep at a rollout decode step", env=env_info(),
                           current=current, failed=failed, timings=timings, ranked=ranked), f, indent=1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, two tiles (CPU interpreter)")
    p.add_argument("--decode-step", action="store_true", help="M = 512, rollout shapes, CUDA graphs")
    args = p.parse_args()
    if args.decode_step:
        decode_step(args)
        return
    from minite.kernels import gemm as kg
    from minite.kernels import grouped_gemm as gg
    from minite.kernels import nvfp4 as kq

    dev = torch.device("cpu" if args.smoke else "cuda")
    current = dict(kg.CONFIGS["interpret" if args.smoke else "aligned"])
    cands = candidates(args.smoke)
    t0 = time.time()
    failed = {}
    if not args.smoke:
        import multiprocessing as mp

        chunks = [cands[i:: args.workers] for i in range(args.workers)]
        with mp.get_context("spawn").Pool(args.workers) as pool:
            failed = dict(e for errs in pool.map(compile_worker, chunks) for e in errs)
        print(f"compiled {len(cands)} tiles in {time.time() - t0:.0f} s, {len(failed)} failed", flush=True)
    timer = (lambda fn: 0.0) if args.smoke else (lambda fn: bench_ms(fn, warmup=5, rep=30))

    rows = []
    for cfg in cands:
        key = json.dumps(cfg, sort_keys=True)
        row = dict(tile=name(cfg), **cfg)
        if key in failed:
            rows.append(dict(row, error=failed[key]))
            continue
        row.update(contract(cfg, current, dev, args.smoke))
        rows.append(row)
        print(json.dumps(row), flush=True)

    timings = []
    dense = {"tiny": (48, 64)} if args.smoke else DENSE
    for (layer, (n, k)), m in itertools.product(dense.items(), (40,) if args.smoke else DENSE_MS):
        a, sa, w, sw = dense_operands(m, n, k, dev)
        x, wb = a.to(torch.bfloat16), w.to(torch.bfloat16)
        base = timer(lambda: torch.matmul(x, wb.t()))
        quant = timer(lambda: kq.quantize_unscaled(x))
        cur = timer(lambda: kg.w4a4_gemm(a, sa, w, sw, config=current))
        for cfg, row in zip(cands, rows):
            if "error" in row:
                continue
            t = timer(lambda: kg.w4a4_gemm(a, sa, w, sw, config=cfg))
            timings.append(dict(kind="dense", shape=layer, M=m, N=n, K=k, tile=row["tile"], ms=t,
                                vs_cublas=base / t if t else None, vs_current=cur / t if t else None,
                                with_quant_vs_cublas=base / (t + quant) if t else None))
    projections = ((2 * EXPERT_INTER, HIDDEN), (HIDDEN, EXPERT_INTER))
    moe = ((16, 32, 64),) if args.smoke else [(t, n, k) for t in MOE_TOKENS for n, k in projections]
    for tokens, n, k in moe:
        a, sa, w, sw, offs = moe_operands(tokens, n, k, dev)
        ab, wb, ends = a.to(torch.bfloat16), w.to(torch.bfloat16), offs[1:].to(torch.int32)
        base = timer(lambda: torch._grouped_mm(ab, wb.transpose(1, 2), offs=ends)) if not args.smoke else 0.0
        cur = timer(lambda: gg.grouped_w4a4_gemm(a, sa, w, sw, offs, config=current))
        for cfg, row in zip(cands, rows):
            if "error" in row:
                continue
            t = timer(lambda: gg.grouped_w4a4_gemm(a, sa, w, sw, offs, config=cfg))
            timings.append(dict(kind="grouped", shape=f"{n}x{k}", M=tokens * TOP_K, N=n, K=k,
                                tile=row["tile"], ms=t, vs_grouped_mm=base / t if t else None,
                                vs_current=cur / t if t else None))

    ok = [r["tile"] for r in rows if r.get("batch_invariant") and r.get("grouped_equals_dense")]
    best = {}
    for t in timings:
        if t["tile"] in ok and t["ms"]:
            key = (t["kind"], t["shape"], t["M"])
            if key not in best or t["ms"] < best[key]["ms"]:
                best[key] = t
    print(f"\n== aligned tile sweep ({time.time() - t0:.0f} s): {len(ok)} of {len(cands)} tiles keep "
          "the contract; the fastest of those per shape:")
    for t in best.values():
        print(json.dumps(t))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="aligned gemm sweep", env=env_info(), current=current, contract=rows,
                           timings=timings, best=list(best.values())), f, indent=1)


if __name__ == "__main__":
    main()
