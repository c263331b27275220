"""The MoE experts of a rollout's prefill on the grouped decode kernel: tiles at 64-512 rows per expert.

A sampler-only model runs its experts on the packed weights at any row count
(`kernels.grouped_decode`); its tiles were tuned at a decode step's 4-64 rows per expert. This times
the default tile and wider ones at the row counts of a prefill of 1024-4096 tokens (Qwen3-30B-A3B
experts, top-8, random routing), against `torch._grouped_mm` on the bf16 weights and the aligned
grouped GEMM on the bf16 copy, each a CUDA graph of 4 calls, and checks every tile's bits against the
bf16 copy's (a tile partitions the outputs, never a row's sum). Writes JSON.

    python -m benchmarks.tools.probe_prefill_tiles --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse

import torch

from benchmarks.common import EXPERTS, MOE_OPS, TOP_K, graph_us, warm_up, write_json
from benchmarks.ops.bench_grouped_decode import experts, random_routing
from minite.kernels import grouped_decode as gd
from minite.kernels import grouped_gemm as gg
from minite.kernels import nvfp4 as kq

TOKENS = (1024, 2048, 4096)
TILES = [dict(BM=bm, BN=bn, BK=bk, num_warps=w, num_stages=st, HALVES=True)
         for bm, bn, bk, w, st in ((128, 128, 128, 8, 3), (128, 128, 64, 8, 4), (128, 64, 128, 4, 3),
                                   (64, 256, 128, 8, 3), (128, 256, 64, 8, 3), (64, 128, 128, 8, 3))]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    warm_up()
    rows = []
    for op, (n, k) in MOE_OPS.items():
        w, sw, copy, dw = experts(n, k)
        w_t = w.transpose(-2, -1)
        for tokens in TOKENS:
            _, offsets = random_routing(tokens)
            x = torch.randn(tokens * TOP_K, k, device="cuda", dtype=torch.bfloat16)
            a, sa = kq.quantize_unscaled(x)
            want = gg.grouped_w4a4_gemm(a, sa, copy, sw, offsets, config="aligned")
            row = dict(op=op, tokens=tokens, rows_per_expert=tokens * TOP_K / EXPERTS,
                       grouped_mm_us=graph_us([lambda: torch._grouped_mm(x, w_t, offs=offsets[1:])] * 4),
                       aligned_copy_us=graph_us(
                           [lambda: gg.grouped_w4a4_gemm(a, sa, copy, sw, offsets, config="aligned")] * 4),
                       tiles=[])
            default = gd.grouped_decode_config(tokens * TOP_K, EXPERTS, k)
            for cfg in [default, *TILES]:
                got = gd.grouped_decode_gemm(a, sa, dw, sw, offsets, config=cfg)
                us = graph_us([lambda: gd.grouped_decode_gemm(a, sa, dw, sw, offsets, config=cfg)] * 4)
                same = bool(torch.equal(got, want))
                row["tiles"].append(dict(cfg, default=cfg is default, us=us, same_bits=same))
            print(row, flush=True)
            rows.append(row)
    if args.out:
        write_json(args.out, dict(benchmark="prefill expert tiles", rows=rows))


if __name__ == "__main__":
    main()
