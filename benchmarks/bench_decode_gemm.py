"""Decode-regime W4A4 GEMM (small M, packed 4-bit weights read from memory) vs cuBLAS bf16.

Ceiling: bf16 weights are 2 B, NVFP4 0.5 + 1/16 B per weight, so at most 3.56x faster than bf16.
Ours: `decode` config (`gemm.decode_config`'s tile; GEMM only, and with the activation quantizer) and
the batch-invariant `aligned` config on the packed weights. Tile sweeps: sweep_decode_gemm.py.
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import multiprocessing as mp

import torch
from bench_common import DECODE_CEILING, bench_ms, parse_args, report

from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq

# Qwen3-8B: q/o, k/v, gate or up, gate+up fused, down
SHAPES = {"q|o": (4096, 4096), "k|v": (1024, 4096), "gate|up": (12288, 4096),
          "gate+up": (24576, 4096), "down": (4096, 12288)}
MS = (1, 8, 32, 64)


def operands(n, k, m):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq = kq.quantize(w, "tensor")
    a, sa = kq.quantize_unscaled(x)
    return w, x, wq, a, sa


def _warm(job):
    """Compile one (shape, M)'s kernels (fills Triton's on-disk cache for the timing process)."""
    n, k, m = job
    _, x, wq, a, sa = operands(n, k, m)
    for cfg in ("decode", "aligned"):
        kg.w4a4_gemm(*kq.quantize_unscaled(x), wq.codes, wq.global_scale, wq.block_scales, config=cfg)
    torch.cuda.synchronize()


def main():
    args = parse_args("benchmarks/results/kernels_decode_gemm.json")
    todo = [(n, k, m) for n, k in SHAPES.values() for m in MS]
    with mp.get_context("spawn").Pool(min(len(todo), 12)) as pool:
        pool.map(_warm, todo)
    rows = []
    for layer, (n, k) in SHAPES.items():
        for m in MS:
            w, x, wq, a, sa = operands(n, k, m)
            base = bench_ms(lambda: torch.matmul(x, w.t()))
            wbytes = n * k * (0.5 + 1 / 16)
            cfg = kg.decode_config(m, n, k)
            row = dict(layer=layer, M=m, N=n, K=k, cublas_us=base * 1e3,
                       tile=f"BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} S{cfg['SPLIT_K']}")
            for name in ("decode", "aligned"):
                t = bench_ms(lambda: kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales,
                                                  config=name))
                row[f"{name}_us"] = t * 1e3
                row[f"{name}_speedup"] = base / t
                if name == "decode":
                    tq = bench_ms(lambda: kg.w4a4_gemm(*kq.quantize_unscaled(x), wq.codes, wq.global_scale,
                                                       wq.block_scales, config=name))
                    row["decode+quant_speedup"] = base / tq
                    row["decode_frac_ceiling"] = base / t / DECODE_CEILING
                    row["decode_weight_tb_s"] = wbytes / t / 1e9
            rows.append(row)
    report("decode gemm", rows, args.out,
           dict(target="decode >= 2.5x cuBLAS bf16 at M in {1, 8, 32, 64}", ceiling=DECODE_CEILING,
                decode_tiles=kg.DECODE_TILES, configs=kg.CONFIGS))


if __name__ == "__main__":
    main()
