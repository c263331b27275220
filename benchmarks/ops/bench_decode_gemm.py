"""Decode-regime W4A4 GEMM (small M, packed 4-bit weights read from memory) vs cuBLAS bf16.

Ceiling: bf16 weights are 2 B, NVFP4 0.5 + 1/16 B per weight, so at most 3.56x faster than bf16; the
decode layout (`decode_gemm.pack_weight`) stores 16-bit block scales, 0.625 B per weight: 3.2x.
Ours: the `decode` config (`decode_gemm.decode_config`'s tile; GEMM alone, and with the activation
quantizer) and the batch-invariant `aligned` config on the packed weights. In the aligned K order
(the aligned path's bits): the decode kernel without split-K (`aligned_decode_config`, what the nn
layers run at M <= 64) against the aligned tile on the bf16 copy. Tile sweeps:
`benchmarks/tools/sweep_decode_tiles.py`.

Two timings of each: `do_bench` (one call, L2 flushed before it) and, as a decode step runs them, a
CUDA graph of back-to-back calls over rotating weight copies (more bytes than the 50 MB L2, so every
call reads its weight from HBM; no launch gaps). The headline `x` columns are the graph ones.

    python -m benchmarks.ops.bench_decode_gemm --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import multiprocessing as mp

import torch

from benchmarks.common import (
    DECODE_CEILING,
    QWEN3_8B,
    bench_ms,
    copies,
    graph_us,
    parse_args,
    report,
    warm_up,
)
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq

# Qwen3-8B: q/o, k/v, gate or up, gate+up fused, down
SHAPES = {name: QWEN3_8B[name] for name in ("q|o", "k|v", "gate|up", "gate+up", "down")}
MS = (1, 8, 32, 64)


def operands(n, k, m, seed=0):
    """bf16 weight [n, k] and activation [m, k], the quantized weight, the quantized activation."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    wq = kq.quantize(w, "tensor")
    a, sa = kq.quantize_unscaled(x)
    return w, x, wq, a, sa


def _warm(job):
    """Compile one (shape, M)'s kernels (fills Triton's on-disk cache for the timing process)."""
    n, k, m = job
    _, x, wq, _, _ = operands(n, k, m)
    a, sa = kq.quantize_unscaled(x)
    dw = kd.pack_weight(wq.codes, wq.block_scales)
    kd.decode_gemm(a, sa, dw, wq.global_scale)
    kd.decode_gemm(a, sa, dw, wq.global_scale, config=kd.aligned_decode_config(m, k))
    kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales)
    kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq), wq.global_scale)
    torch.cuda.synchronize()


def main():
    args = parse_args()
    todo = [(n, k, m) for n, k in SHAPES.values() for m in MS]
    with mp.get_context("spawn").Pool(min(len(todo), 12)) as pool:
        pool.map(_warm, todo)
    warm_up()
    rows = []
    for layer, (n, k) in SHAPES.items():
        for m in MS:
            w, x, wq, a, sa = operands(n, k, m)
            wbytes = n * k * (0.5 + 2 / 16)  # codes + the decode layout's 16-bit block scales
            cfg = kd.decode_config(m, n, k)
            row = dict(layer=layer, M=m, N=n, K=k,
                       tile=f"BM{cfg['BM']} BN{cfg['BN']} BK{cfg['BK']} S{cfg['SPLIT_K']}")
            ws = copies(w, w.numel() * 2)
            dw = kd.pack_weight(wq.codes, wq.block_scales)  # once per weight update
            dws = [kd.DecodeWeight(c, dw.scales.clone(), dw.n) for c in copies(dw.codes, int(wbytes))]
            base = graph_us([lambda w=w_: torch.matmul(x, w.t()) for w_ in ws])
            ours = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale, config=cfg) for d in dws])
            ours_q = graph_us([lambda d=d: kd.decode_gemm(*kq.quantize_unscaled(x), d, wq.global_scale,
                                                          config=cfg) for d in dws])
            row.update(cublas_us=base, decode_us=ours, decode_x=base / ours, decode_quant_x=base / ours_q,
                       decode_frac_ceiling=base / ours / DECODE_CEILING,
                       decode_weight_tb_s=wbytes / ours / 1e6)
            # the aligned K order: decode kernel without split-K vs the aligned tile on the bf16 copy
            acfg = kd.aligned_decode_config(m, k)
            al_dec = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale, config=acfg)
                               for d in dws])
            wc = kg.unscaled_copy(wq)
            al_copy = graph_us([lambda w=w_: kg.w4a4_gemm(a, sa, w, wq.global_scale)
                                for w_ in copies(wc, wc.numel() * 2)])
            same = torch.equal(kd.decode_gemm(a, sa, dw, wq.global_scale, config=acfg),
                               kg.w4a4_gemm(a, sa, wc, wq.global_scale))
            row.update(aligned_decode_x=base / al_dec, aligned_copy_x=base / al_copy,
                       aligned_decode_vs_copy=al_copy / al_dec, aligned_decode_same_bits=same)
            # one call, L2 flushed (do_bench): the same kernels without the graph
            b1 = bench_ms(lambda: torch.matmul(x, w.t())) * 1e3
            d1 = bench_ms(lambda: kd.decode_gemm(a, sa, dw, wq.global_scale, config=cfg)) * 1e3
            al = bench_ms(lambda: kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales)) * 1e3
            row.update(flush_cublas_us=b1, flush_decode_us=d1, flush_decode_x=b1 / d1, aligned_x=b1 / al)
            rows.append(row)
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    report("decode gemm", rows, args.out,
           dict(target="decode >= 2.5x cuBLAS bf16 at M in {1, 8, 32, 64}", ceiling=DECODE_CEILING,
                decode_tiles=kd.DECODE_TILES))


if __name__ == "__main__":
    main()
