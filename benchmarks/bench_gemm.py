"""Compute-bound W4A4 GEMM (learner / prefill) vs cuBLAS bf16 (torch.matmul), same process.

Qwen3-8B layer shapes (N, K); M in {4096, 16384}. Ours: the fused activation quantizer (bf16 x ->
exact values + row scales) and the GEMM on the weight's dequantized bf16 copy; reported with and
without the quantizer, for the fastest (`prefill`) and the batch-invariant (`aligned`) configs. Timed
by do_bench (L2 flushed before each call; host time between the flush and the call counts, which
the two launches of "+quant" can exceed) and, for "+quant", also as CUDA graphs of four calls (GPU
time alone, against cuBLAS timed the same way).
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch
import triton
from bench_common import CUBLAS_BF16_TFLOPS, bench_ms, parse_args, report
from bench_decode_gemm import graph_us

from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate|up": (12288, 4096), "down": (4096, 12288)}
SWEEP = [dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4),  # pointer loads (s4-s6)
         dict(kg.CONFIGS["prefill"]),  # TMA, persistent
         dict(kg.CONFIGS["prefill"], PERSIST=0),  # TMA, one program per tile
         dict(kg.CONFIGS["aligned"])]


def heavy(m, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda") ** 3
    return torch.where(torch.rand(m, k, generator=g, device="cuda") < 0.001, 50 * x, x)


def alignment_rows():
    """On heavy-tailed data: the fraction of fp32 accumulators exactly equal to the correctly rounded
    sum, per config; configs against each other; and bf16 outputs of cuBLAS vs the exact bf16 output."""
    rows = []
    for k in (4096, 12288):
        x, w = heavy(1024, k, 0), heavy(4096, k, 1)
        wq = kq.quantize(w, "tensor")
        wc = kg.unscaled_copy(wq)
        a, _ = kq.quantize_unscaled(x)
        one = torch.ones((), device="cuda")
        exact = (a.double() @ wc.double().t()).float()
        acc = {c: kg.w4a4_gemm(a, one, wc, one, out_dtype=torch.float32, config=c)
               for c in ("aligned", "prefill")}
        acc["aligned_packed"] = kg.w4a4_gemm(a, one, wq.codes, one, wq.block_scales,
                                             out_dtype=torch.float32, config="aligned")
        dec = kg.w4a4_gemm(a[:64], one, wq.codes, one, wq.block_scales, out_dtype=torch.float32,
                           config="decode")
        cublas = torch.matmul(a, wc.t())
        ours = kg.w4a4_gemm(a, one, wc, one, out_dtype=torch.bfloat16, config="aligned")
        row = dict(K=k, M=1024, N=4096)
        for c, v in acc.items():
            row[f"{c}_exact_frac"] = (v == exact).float().mean().item()
        row["decode_exact_frac"] = (dec == exact[:64]).float().mean().item()
        row["prefill_eq_aligned"] = (acc["prefill"] == acc["aligned"]).float().mean().item()
        row["packed_eq_copy"] = (acc["aligned_packed"] == acc["aligned"]).float().mean().item()
        row["decode_eq_aligned"] = (dec == acc["aligned"][:64]).float().mean().item()
        row["cublas_bf16_exact_frac"] = (cublas == exact.bfloat16()).float().mean().item()
        row["aligned_bf16_exact_frac"] = (ours == exact.bfloat16()).float().mean().item()
        rows.append(row)
    return rows


def main():
    args = parse_args("benchmarks/results/kernels_gemm.json")
    rows, sweep = [], []
    ms_list = [4096] if args.quick else [4096, 16384]
    for m in ms_list:
        for layer, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            wq = kq.quantize(w, "tensor")
            wc = kg.unscaled_copy(wq)
            a, sa = kq.quantize_unscaled(x)
            flop = 2 * m * n * k
            base = bench_ms(lambda: torch.matmul(x, w.t()))
            # CUDA graphs of 4 calls: GPU time alone (do_bench also counts host gaps after its L2 flush)
            base_graph = graph_us([lambda: torch.matmul(x, w.t())] * 4)
            row = dict(layer=layer, M=m, N=n, K=k, cublas_tflops=flop / base / 1e9,
                       cublas_frac_ceiling=flop / base / 1e9 / CUBLAS_BF16_TFLOPS)
            for cfg in ("prefill", "aligned"):
                g = bench_ms(lambda: kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=cfg))
                gemm_q = lambda: kg.w4a4_gemm(*kq.quantize_unscaled(x), wc, wq.global_scale, config=cfg)
                gq = bench_ms(gemm_q)
                row[f"{cfg}_tflops"] = flop / g / 1e9
                row[f"{cfg}_vs_cublas"] = base / g
                row[f"{cfg}+quant_vs_cublas"] = base / gq
                row[f"{cfg}+quant_graph_vs_cublas"] = base_graph / graph_us([gemm_q] * 4)
            rows.append(row)
            if m == 4096 and layer in ("gate|up", "down") and not args.quick:
                for i, cfg in enumerate(SWEEP):
                    try:
                        t = bench_ms(lambda: kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=cfg))
                    except triton.runtime.errors.OutOfResources:
                        continue
                    sweep.append(dict(layer=layer, M=m, cfg=i, **cfg, tflops=flop / t / 1e9,
                                      vs_cublas=base / t))
    align = alignment_rows()
    report("gemm alignment on heavy-tailed data", align, None)
    if sweep:
        report("gemm config sweep", sweep, None)
    report("gemm (compute-bound)", rows, args.out,
           dict(target="prefill+quant >= 0.9x cuBLAS bf16", configs=kg.CONFIGS, sweep=sweep,
                alignment=align))


if __name__ == "__main__":
    main()
