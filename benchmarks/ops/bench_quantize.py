"""NVFP4 quantize kernel throughput vs a device copy (the HBM ceiling), same process. bf16 inputs take
the pair kernel (`kernels/nvfp4/pairs.py`); fp32 inputs the general kernel (`kernels/nvfp4/`).

Bytes counted: the input read once plus every output written once (codes, scales, values, scales).
Timed two ways: do_bench in three interleaved rounds (best of each), and as CUDA graphs over 8 input
copies (`graph_frac_copy`, against a copy graphed the same way; do_bench rounds can swing 2x, the
graphs agree to a fraction of a percent).

    python -m benchmarks.ops.bench_quantize --out OUT.json [--quick]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch

from benchmarks.common import HBM_COPY_TBPS, bench_ms, graph_us, parse_args, report, warm_up
from minite.kernels import nvfp4 as kq
from minite.ref import nvfp4 as ref


def main():
    args = parse_args()
    shapes = [(16384, 4096)] if args.quick else [(16384, 4096), (4096, 12288), (16384, 12288)]
    rows = []
    warm_up()
    for r, k in shapes:
        x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
        xf = x.float()
        n = x.numel()
        copy_ms = bench_ms(lambda: x.clone())
        xs = [x.clone() for _ in range(8)]
        copy_graph_ms = graph_us([lambda xi=xi: xi.clone() for xi in xs]) / 1e3
        copy_tbps = 2 * 2 * n / copy_ms / 1e9
        rows.append(dict(shape=f"{r}x{k}", op="copy (baseline)", ms=copy_ms, tb_s=copy_tbps,
                         frac_copy=1.0, frac_facts=copy_tbps / HBM_COPY_TBPS))
        codes_bytes = n // 2 + n // 16 + 8 * r
        graphed = {"row 1x16 te (codes)": lambda xi: kq.quantize_packed(xi, "row"),
                   "row fused values+sdec": lambda xi: kq.quantize_unscaled(xi)}
        variants = [
            ("row 1x16 te (codes)", lambda: kq.quantize_packed(x, "row"), 2 * n + codes_bytes),
            ("row 1x16 te (codes), fp32 input (general kernel)", lambda: kq.quantize_packed(xf, "row"),
             4 * n + codes_bytes),
            ("row fused values+sdec", lambda: kq.quantize_unscaled(x), 2 * n + 2 * n + n // 16 + 4 * r),
            ("tensor 1x16 te (amax+codes)", lambda: kq.quantize_packed(x, "tensor"), 2 * n + codes_bytes),
            ("tensor 16x16 te", lambda: kq.quantize_packed(x, "tensor", (16, 16)), 2 * n + codes_bytes),
            ("row 1x16 stochastic", lambda: kq.quantize_packed(x, "row", rounding="stochastic"),
             2 * n + codes_bytes),
        ]
        if (r, k) == shapes[0] and not args.quick:
            variants.append(("torch reference (row)", lambda: ref.quantize_ref(
                x, "row", (1, 16), "rne", "te", None, False, None), 2 * n + codes_bytes))
        # three rounds over all variants, the best of each: single timings had slow spells (up to 1.8x,
        # a whole variant or shape at a time) that a neighbouring measurement did not share
        times = [[bench_ms(fn) for _, fn, _ in variants] for _ in range(3)]
        for i, (name, _, nbytes) in enumerate(variants):
            ms = min(t[i] for t in times)
            tbps = nbytes / ms / 1e9
            row = dict(shape=f"{r}x{k}", op=name, ms=ms, ms_rounds=[t[i] for t in times], tb_s=tbps,
                       frac_copy=tbps / copy_tbps, frac_facts=tbps / HBM_COPY_TBPS)
            if name in graphed:
                g_ms = graph_us([lambda xi=xi: graphed[name](xi) for xi in xs]) / 1e3
                row.update(graph_ms=g_ms, graph_frac_copy=(nbytes / g_ms) / (4 * n / copy_graph_ms))
            rows.append(row)
    report("quantize", rows, args.out,
           dict(target="codes+scales >= 0.85 of HBM copy bandwidth, 16384x4096 bf16"))


if __name__ == "__main__":
    main()
