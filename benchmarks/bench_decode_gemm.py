"""Decode-regime W4A4 GEMM (small M, packed 4-bit weights read from memory) vs cuBLAS bf16.

Ceiling: bf16 weights are 2 B, NVFP4 0.5 + 1/16 B per weight, so at most 3.56x faster than bf16.
Ours: `decode` config (GEMM only, and with the activation quantizer) and the batch-invariant
`aligned` config on the packed weights.
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch
import triton
from bench_common import DECODE_CEILING, bench_ms, parse_args, report

from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq

SHAPES = {"gate|up": (12288, 4096), "down": (4096, 12288), "qkv": (6144, 4096), "o": (4096, 4096)}
SWEEP = [dict(BN=bn, BK=bk, GROUP_M=1, num_warps=wp, num_stages=st)
         for bn, bk, wp, st in ((32, 256, 4, 4), (64, 256, 4, 4), (64, 512, 4, 3), (32, 512, 4, 3),
                                (128, 256, 4, 4), (64, 256, 8, 4), (16, 512, 4, 4), (32, 1024, 4, 2))]

# candidates for the one batch-invariant config (also timed at M = 4096 by bench_gemm.py)
ALIGNED = [dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4),
           dict(BM=64, BN=64, BK=128, GROUP_M=8, num_warps=4, num_stages=4),
           dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4),
           dict(BM=64, BN=128, BK=128, GROUP_M=8, num_warps=4, num_stages=3)]


def main():
    args = parse_args("benchmarks/results/kernels_decode_gemm.json")
    rows, sweep = [], []
    for layer, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        wq = kq.quantize(w, "tensor")
        for m in (1, 8, 32, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, sa = kq.quantize_unscaled(x)
            base = bench_ms(lambda: torch.matmul(x, w.t()))
            wbytes = n * k * (0.5 + 1 / 16)
            row = dict(layer=layer, M=m, N=n, K=k, cublas_us=base * 1e3)
            for cfg in ("decode", "aligned"):
                t = bench_ms(lambda: kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales,
                                                  config=cfg))
                row[f"{cfg}_us"] = t * 1e3
                row[f"{cfg}_speedup"] = base / t
                if cfg == "decode":
                    tq = bench_ms(lambda: kg.w4a4_gemm(*kq.quantize_unscaled(x), wq.codes, wq.global_scale,
                                                       wq.block_scales, config=cfg))
                    row["decode+quant_speedup"] = base / tq
                    row["decode_frac_ceiling"] = base / t / DECODE_CEILING
                    row["decode_weight_tb_s"] = wbytes / t / 1e9
            rows.append(row)
            if m in (1, 64) and layer in ("gate|up", "down") and not args.quick:
                bm = 16 if m <= 16 else 64
                cands = [("decode", dict(cfg, BM=bm)) for cfg in SWEEP] + [("aligned", c) for c in ALIGNED]
                for i, (kind, c) in enumerate(cands):
                    try:
                        t = bench_ms(lambda: kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales,
                                                          config=c))
                    except triton.runtime.errors.OutOfResources:
                        continue
                    sweep.append(dict(layer=layer, M=m, kind=kind, cfg=i, **c, us=t * 1e3, speedup=base / t))
    if sweep:
        report("decode config sweep", sweep, None)
    report("decode gemm", rows, args.out,
           dict(target="decode >= 2.5x cuBLAS bf16 at M in {1, 8, 32, 64}", ceiling=DECODE_CEILING,
                configs=kg.CONFIGS, sweep=sweep))


if __name__ == "__main__":
    main()
