"""RMSNorm and SwiGLU kernels, and both quantizing their output for the next GEMM, against a device copy.

Rows: Qwen3-8B hidden rows (4096 wide) at the compute-bound GEMM benchmark's M, the learner's 1.7B
rows (2048 wide), q_norm's head rows (128 wide) and a decode step's rows. Variants: the norm kernel
(16-bit rows take the word-layout kernel, `norm_pairs`), the norm then the quantizer
(`quantize_unscaled`, two launches) and both in one launch (`rms_norm_quantize`). SwiGLU on the MLP
widths of Qwen3-8B / 1.7B and the 30B-A3B experts: torch's two kernels, ours, ours then the quantizer,
both in one launch (`swiglu_quantize`). CUDA graphs over 4
input copies (more than L2 holds), interleaved rounds (`benchmarks.common.paired_graph_us`). Bytes
counted: x read, every output written once.

    python -m benchmarks.ops.bench_norm --out OUT.json [--quick]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
from statistics import median

import torch
import torch.nn.functional as F

from benchmarks.common import paired_graph_us, parse_args, report, warm_up
from minite.kernels import norm as kn
from minite.kernels import nvfp4 as kq
from minite.kernels import swiglu as ks

# the last of each: a 30B-A3B decode step at 128 sequences (its hidden rows; its experts' 1024 rows at top-8)
SHAPES = [(4096, 4096), (16384, 4096), (8192, 2048), (131072, 128), (128, 2048)]
SWIGLU_SHAPES = [(4096, 12288), (8192, 6144), (32768, 768), (1024, 768)]  # 8B MLP, 1.7B MLP, 30B-A3B experts
COPIES = 4
EPS = 1e-6


def main():
    args = parse_args()
    warm_up()
    rows = []
    for r, d in SHAPES[:1] if args.quick else SHAPES:
        xs = [torch.randn(r, d, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        w = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
        n = r * d
        variants = {
            "copy": ([lambda x=x: x.clone() for x in xs], 4 * n),
            "norm": ([lambda x=x: kn.rms_norm(x, w, EPS) for x in xs], 4 * n),
            "norm, then quantize": ([lambda x=x: kq.quantize_unscaled(kn.rms_norm(x, w, EPS)) for x in xs],
                                    8 * n + n // 16 + 4 * r),
            "norm+quantize, one launch": ([lambda x=x: kn.rms_norm_quantize(x, w, EPS) for x in xs],
                                          6 * n + n // 16 + 8 * r),
        }
        rows += timed_rows(f"{r}x{d}", variants, n)
    for r, i in SWIGLU_SHAPES[:1] if args.quick else SWIGLU_SHAPES:
        pairs = [[torch.randn(r, i, device="cuda", dtype=torch.bfloat16) * 2 for _ in range(2)]
                 for _ in range(COPIES)]
        n = r * i
        variants = {
            "copy": ([lambda g=g: g.clone() for g, _ in pairs], 4 * n),
            "swiglu, torch": ([lambda g=g, u=u: F.silu(g) * u for g, u in pairs], 6 * n),
            "swiglu": ([lambda g=g, u=u: ks.swiglu(g, u) for g, u in pairs], 6 * n),
            "swiglu, then quantize": (
                [lambda g=g, u=u: kq.quantize_unscaled(ks.swiglu(g, u)) for g, u in pairs],
                10 * n + n // 16 + 4 * r),
            "swiglu+quantize, one launch": ([lambda g=g, u=u: ks.swiglu_quantize(g, u) for g, u in pairs],
                                            8 * n + n // 16 + 8 * r),
        }
        rows += timed_rows(f"{r}x{i}", variants, n)
    report("rms_norm, swiglu (+ quantize)", rows, args.out)


def timed_rows(shape: str, variants: dict, n: int) -> list[dict]:
    """{name: (thunks, bytes moved)} timed in paired CUDA-graph rounds -> one row each: us, TB/s and the
    fraction of the "copy" variant's bandwidth (it moves 4 bytes for each of the n elements)."""
    us = paired_graph_us({k: v[0] for k, v in variants.items()})
    copy_us = median(us["copy"])
    rows = []
    for name, (_, nbytes) in variants.items():
        t = median(us[name])
        rows.append(dict(shape=shape, op=name, us=t, tb_s=nbytes / t / 1e6,
                         frac_copy=(nbytes / t) / (4 * n / copy_us)))
    return rows


if __name__ == "__main__":
    main()
