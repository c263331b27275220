"""Compute-bound W4A4 GEMM (learner / prefill) vs cuBLAS bf16 (torch.matmul), same process.

Qwen3-8B layer shapes (N, K); M in {4096, 16384}. Ours: the fused activation quantizer (bf16 x ->
exact values + row scales) and the GEMM on the weight's dequantized bf16 copy; reported with and
without the quantizer ("+quant": both kernels, timed together), for the fastest (`prefill`) and the
batch-invariant (`aligned`) configs. Every variant is a CUDA graph of CALLS calls (GPU time alone),
timed in interleaved rounds with cuBLAS (`benchmarks.common.paired_graph_us`): the x-cuBLAS columns are
the median of the per-round ratios, with their min and max. For the layers whose input an RMSNorm
(q/k/v, gate/up) or the SwiGLU (down) produces, also the layer as the model runs it ("layer"): that
op and cuBLAS against the op quantizing its output in the same launch
(`kernels.norm.rms_norm_quantize`, `kernels.swiglu.swiglu_quantize`) and our GEMM.
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
from statistics import median

import torch

from benchmarks.common import (
    CUBLAS_BF16_TFLOPS,
    QWEN3_8B,
    heavy,
    paired_graph_us,
    parse_args,
    ratio_stats,
    report,
    warm_up,
)
from minite.kernels import gemm as kg
from minite.kernels import norm as kn
from minite.kernels import nvfp4 as kq
from minite.kernels import swiglu as ks

SHAPES = {"qkv": QWEN3_8B["qkv"], "o": QWEN3_8B["q|o"], "gate|up": QWEN3_8B["gate|up"],
          "down": QWEN3_8B["down"]}
CALLS = 4  # calls per CUDA graph
# the op that produces each layer's input and, in the model, quantizes it for the GEMM in its own launch
PRODUCERS = {"qkv": "rms_norm", "gate|up": "rms_norm", "down": "swiglu"}
EPS = 1e-6


def producer_ops(producer: str, m: int, k: int):
    """(the producer alone -> its bf16 output [m, k], the producer quantizing -> (values, row factor))
    on random inputs: RMSNorm of x [m, k], or SwiGLU of gate / up [m, k]."""
    if producer == "rms_norm":
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        return lambda: kn.rms_norm(x, nw, EPS), lambda: kn.rms_norm_quantize(x, nw, EPS)[1:3]
    gate, up = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 2 for _ in range(2))
    return lambda: ks.swiglu(gate, up), lambda: ks.swiglu_quantize(gate, up)[1:3]


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
    args = parse_args()
    warm_up()
    rows = []
    ms_list = [4096] if args.quick else [4096, 16384]
    for m in ms_list:
        for layer, (n, k) in SHAPES.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            wq = kq.quantize(w, "tensor")
            wc = kg.unscaled_copy(wq)
            a, sa = kq.quantize_unscaled(x)
            flop = 2 * m * n * k
            variants = {"cublas": [lambda: torch.matmul(x, w.t())] * CALLS,
                        "quant": [lambda: kq.quantize_unscaled(x)] * CALLS}
            for cfg in ("prefill", "aligned"):
                variants[cfg] = [lambda c=cfg: kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=c)] * CALLS
                variants[f"{cfg}+quant"] = [lambda c=cfg: kg.w4a4_gemm(*kq.quantize_unscaled(x), wc,
                                                                       wq.global_scale, config=c)] * CALLS
            producer = PRODUCERS.get(layer)
            if producer:  # the layer as the model runs it: the op before the GEMM quantizes for it
                plain, quantizing = producer_ops(producer, m, k)
                variants["layer:cublas"] = [lambda: torch.matmul(plain(), w.t())] * CALLS
                for cfg in ("prefill", "aligned"):
                    variants[f"layer:{cfg}"] = [lambda c=cfg: kg.w4a4_gemm(
                        *quantizing(), wc, wq.global_scale, config=c)] * CALLS
            us = paired_graph_us(variants)
            base = us["cublas"]
            row = dict(layer=layer, M=m, N=n, K=k, cublas_us=median(base),
                       cublas_tflops=flop / median(base) / 1e6,
                       cublas_frac_ceiling=flop / median(base) / 1e6 / CUBLAS_BF16_TFLOPS,
                       quant_us=median(us["quant"]))
            for v in ("prefill", "prefill+quant", "aligned", "aligned+quant"):
                mid, lo, hi = ratio_stats(base, us[v])
                row.update({f"{v}_us": median(us[v]), f"{v}_vs_cublas": mid, f"{v}_vs_cublas_min": lo,
                            f"{v}_vs_cublas_max": hi})
            if producer:
                row.update(producer=producer, producer_us=median(us["layer:cublas"]) - median(base))
                for cfg in ("prefill", "aligned"):
                    mid, lo, hi = ratio_stats(us["layer:cublas"], us[f"layer:{cfg}"])
                    row.update({f"layer_{cfg}_vs_cublas": mid, f"layer_{cfg}_min": lo,
                                f"layer_{cfg}_max": hi})
            rows.append(row)
    align = alignment_rows()
    report("gemm alignment on heavy-tailed data", align, None)
    report("gemm (compute-bound)", rows, args.out,
           dict(target="prefill+quant >= 0.9x cuBLAS bf16 (layers with a producer: layer_prefill, the "
                       "producer quantizing + our GEMM against the producer + cuBLAS)",
                configs=kg.CONFIGS, alignment=align))


if __name__ == "__main__":
    main()
