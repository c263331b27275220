"""A sampler-form weight above the decode threshold: `grouped_decode.decode_gemm_rows` (the decode
layout in BM-row tiles, the aligned bits) vs the aligned tile on the bf16 copy (what a full model
runs) and cuBLAS bf16, at 128-4096 rows.

Shapes: the Qwen3-30B-A3B attention projections (q, k or v, q|k|v as one weight, o) and the
Qwen3-1.7B MLP (gate|up, down). Each column is a CUDA graph of back-to-back calls over rotating
weight copies (more bytes than L2), in microseconds per call; `ROW_TILES` are the row tiles tried
(the first is the default), each checked bitwise against the aligned tile on the copy.

    python -m benchmarks.ops.bench_decode_rows --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch

from benchmarks.common import copies, graph_us, parse_args, report, warm_up
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels import grouped_decode as gd
from minite.kernels import nvfp4 as kq

SHAPES = {"moe q": (4096, 2048), "moe k|v": (512, 2048), "moe q|k|v": (5120, 2048), "moe o": (2048, 4096),
          "dense gate|up": (12288, 2048), "dense down": (2048, 6144)}
MS = (128, 256, 512, 2048, 4096)
ROW_TILES = (None, dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, HALVES=True),
             dict(BM=128, BN=64, BK=128, num_warps=4, num_stages=3, HALVES=True),
             dict(BM=64, BN=256, BK=128, num_warps=8, num_stages=3, HALVES=True),
             # more programs an SM: registers capped (BM 64: 168 a thread, ~130 bytes of spills in
             # ptxas -v), or half the accumulator
             dict(BM=64, BN=128, BK=128, num_warps=4, num_stages=3, HALVES=True, maxnreg=168),
             dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=3, HALVES=True),
             dict(BM=32, BN=64, BK=128, num_warps=4, num_stages=3, HALVES=True))


def main():
    args = parse_args()
    warm_up()
    rows = []
    for name, (n, k) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g)
        wq = kq.quantize(w, "tensor")
        dw = kd.pack_weight(wq.codes, wq.block_scales)
        wbytes = n * k * (0.5 + 2 / 16)
        dws = [kd.DecodeWeight(c, dw.scales.clone(), dw.n) for c in copies(dw.codes, int(wbytes))]
        wc = kg.unscaled_copy(wq)
        wcs = copies(wc, wc.numel() * 2)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            a, sa = kq.quantize_unscaled(x)
            want = kg.w4a4_gemm(a, sa, wc, wq.global_scale)
            ws = copies(w, w.numel() * 2)
            row = dict(layer=name, M=m, N=n, K=k,
                       cublas_us=graph_us([lambda w=w_: torch.matmul(x, w.t()) for w_ in ws]),
                       aligned_copy_us=graph_us([lambda w=w_: kg.w4a4_gemm(a, sa, w, wq.global_scale)
                                                 for w_ in wcs]))
            for cfg in ROW_TILES:
                tag = "rows" if cfg is None else (f"rows_bm{cfg['BM']}_bn{cfg['BN']}_w{cfg['num_warps']}"
                                                   + (f"_r{cfg['maxnreg']}" if "maxnreg" in cfg else ""))
                try:
                    same = torch.equal(gd.decode_gemm_rows(a, sa, dw, wq.global_scale, config=cfg), want)
                    us = graph_us([lambda d=d: gd.decode_gemm_rows(a, sa, d, wq.global_scale, config=cfg)
                                   for d in dws])
                except Exception as err:  # a tile that does not build (registers, shared memory)
                    print(f"{name} M={m} {tag}: {type(err).__name__}: {str(err)[:120]}", flush=True)
                    continue
                row.update({f"{tag}_us": us, f"{tag}_vs_copy": row["aligned_copy_us"] / us,
                            f"{tag}_same_bits": same})
            rows.append(row)
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    report("decode layout in row tiles", rows, args.out,
           dict(row_tiles=[c or "grouped_decode_config" for c in ROW_TILES]))


if __name__ == "__main__":
    main()
