"""MoE expert GEMMs of a rollout decode step: the grouped decode kernel (packed weights, aligned bits)
vs torch._grouped_mm bf16 and our grouped aligned tile on the bf16 copy.

Qwen3-30B-A3B experts (128 experts, top-8, hidden 2048, expert intermediate 768) at 64-1024 tokens a
step, i.e. 4-64 rows per expert on average. Every column is one CUDA graph of several calls (the
expert weights, 0.8 GB bf16, never fit in L2, so no rotation is needed), in microseconds per call.
A tile sweep (`SWEEP`) follows at every token count, bitwise checked against the default tile.
Writes JSON.

    python -m benchmarks.ops.bench_grouped_decode --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import multiprocessing as mp

import torch

from benchmarks.common import EXPERTS, MOE_OPS, TOP_K, graph_us, parse_args, report, warm_up
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels import grouped_decode as gd
from minite.kernels import grouped_gemm as gg
from minite.kernels import nvfp4 as kq

TOKENS = (64, 128, 256, 512, 1024)
CALLS = 4  # calls per graph
# tiles around `grouped_decode.GROUPED_DECODE_TILES`: BM 16 for few rows per expert; HALVES (a BM-row
# tile whose rows fit in BM / 2 runs half-height MMAs: the weight dequantized once per BM rows) above
SWEEP = ([dict(BM=16, BN=bn, BK=bk, num_warps=4, num_stages=3) for bn in (64, 128) for bk in (128, 256)]
         + [dict(BM=bm, BN=bn, BK=bk, num_warps=4, num_stages=st, HALVES=True) for bm in (32, 64)
            for bn, bk, st in ((128, 128, 3), (128, 128, 4), (256, 128, 3), (128, 64, 4))]
         + [dict(BM=bm, BN=bn, BK=128, num_warps=8, num_stages=3, HALVES=True) for bm in (32, 64)
            for bn in (128, 256)]
         + [dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4, HALVES=True),
            dict(BM=64, BN=128, BK=256, num_warps=4, num_stages=2, HALVES=True)]
         # registers capped so that four programs share an SM (the BM 32 tile holds 162 a thread, three
         # programs: ncu on the H200), and BM 32 on BN 64 (half the accumulator, twice the programs)
         + [dict(BM=32, BN=128, BK=bk, num_warps=4, num_stages=st, HALVES=True, maxnreg=cap)
            for cap in (128, 144) for bk, st in ((128, 3), (128, 2), (64, 4))]
         + [dict(BM=16, BN=bn, BK=256, num_warps=4, num_stages=3, maxnreg=128) for bn in (64, 128)]
         + [dict(BM=32, BN=64, BK=bk, num_warps=4, num_stages=st, HALVES=True)
            for bk, st in ((128, 3), (256, 3), (128, 4))]
         + [dict(BM=16, BN=bn, BK=256, num_warps=4, num_stages=4) for bn in (64, 128)])


def experts(n, k):
    """bf16 weights [EXPERTS, N, K], their quantized container, the bf16 copy and the decode layout."""
    w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
    qs = [kq.quantize(w[e], "tensor") for e in range(EXPERTS)]
    codes = torch.stack([q.codes for q in qs])
    sb = torch.stack([q.block_scales for q in qs])
    sw = torch.stack([q.global_scale for q in qs]).reshape(EXPERTS)
    copy = torch.stack([kg.unscaled_copy(q) for q in qs])
    return w, sw, copy, kd.pack_weight(codes, sb)


def random_routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` tokens routed top-k over random logits (seeded by the count): the per-expert counts
    [EXPERTS] and the sorted rows' offsets int32 [EXPERTS + 1]."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    ids = logits.topk(TOP_K, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=EXPERTS)
    offsets = torch.zeros(EXPERTS + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = counts.cumsum(0)
    return counts, offsets


def _warm(job):
    """Compile one (op, tile) (fills Triton's on-disk cache for the timing process): random words,
    the real shapes and argument values."""
    (n, k), cfg = job
    codes = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device="cuda")
    dw = kd.pack_weight(codes, torch.rand(EXPERTS, n, k // 16, device="cuda").to(torch.float8_e4m3fn))
    a = torch.randn(EXPERTS * 4, k, device="cuda", dtype=torch.bfloat16)
    offsets = torch.arange(0, EXPERTS * 4 + 1, 4, dtype=torch.int32, device="cuda")
    try:
        ones = torch.ones(EXPERTS * 4, device="cuda")
        gd.grouped_decode_gemm(a, ones, dw, ones[:EXPERTS], offsets, config=cfg)
        torch.cuda.synchronize()
    except Exception:  # a tile that does not build: reported by the timing loop
        pass


def main():
    args = parse_args()
    todo = [(nk, c) for nk in MOE_OPS.values() for c in SWEEP]
    with mp.get_context("spawn").Pool(12) as pool:
        pool.map(_warm, todo)
    warm_up()
    rows, sweep = [], []
    for op, (n, k) in MOE_OPS.items():
        w, sw, copy, dw = experts(n, k)
        w_t = w.transpose(-2, -1)
        for tokens in TOKENS:
            counts, offsets = random_routing(tokens)
            t = tokens * TOP_K
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            a, sa = kq.quantize_unscaled(x)
            active = int((counts > 0).sum())
            cfg = gd.grouped_decode_config(t, EXPERTS, k)
            base = graph_us([lambda: torch._grouped_mm(x, w_t, offs=offsets[1:])] * CALLS)
            aligned = graph_us([lambda: gg.grouped_w4a4_gemm(a, sa, copy, sw, offsets, config="aligned")]
                               * CALLS)
            ours = graph_us([lambda: gd.grouped_decode_gemm(a, sa, dw, sw, offsets)] * CALLS)
            ours_q = graph_us([lambda: gd.grouped_decode_gemm(*kq.quantize_unscaled(x), dw, sw, offsets)]
                              * CALLS)
            want = gg.grouped_w4a4_gemm(a, sa, copy, sw, offsets, config="aligned")
            got = gd.grouped_decode_gemm(a, sa, dw, sw, offsets)
            wbytes = active * n * k * (0.5 + 2 / 16)
            row = dict(op=op, tokens=tokens, rows_per_expert=t / EXPERTS, max_rows=int(counts.max()),
                       N=n, K=k,
                       tile=f"BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} S{cfg['num_stages']}",
                       grouped_mm_us=base, aligned_copy_us=aligned, decode_us=ours, decode_quant_us=ours_q,
                       decode_vs_grouped_mm=base / ours, decode_vs_aligned_copy=aligned / ours,
                       decode_quant_vs_grouped_mm=base / ours_q,
                       bf16_weight_tb_s=active * n * k * 2 / base / 1e6,
                       decode_weight_tb_s=wbytes / ours / 1e6,
                       same_bits_as_aligned=bool(torch.equal(got, want)))
            rows.append(row)
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
            for c in SWEEP:
                try:
                    same = bool(torch.equal(gd.grouped_decode_gemm(a, sa, dw, sw, offsets, config=c), got))
                    us = graph_us([lambda: gd.grouped_decode_gemm(a, sa, dw, sw, offsets, config=c)] * CALLS)
                except Exception as err:  # a tile that does not build (shared memory, registers)
                    print(f"{op} {tokens} {c}: {type(err).__name__}: {str(err)[:120]}")
                    continue
                sweep.append(dict(op=op, tokens=tokens, **c, us=us, vs_default=ours / us, same_bits=same))
    report("grouped decode sweep", sweep, None)
    best = {}
    for s in sweep:
        key = (s["op"], s["tokens"])
        if key not in best or s["us"] < best[key]["us"]:
            best[key] = s
    report("grouped decode (MoE decode step)", rows, args.out,
           dict(tiles=gd.GROUPED_DECODE_TILES, calls_per_graph=CALLS, sweep=sweep,
                best=[dict(op=o, tokens=t, **{k: v for k, v in b.items() if k not in ("op", "tokens")})
                      for (o, t), b in best.items()]))


if __name__ == "__main__":
    main()
