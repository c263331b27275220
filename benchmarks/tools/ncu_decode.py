"""One decode-GEMM launch (and cuBLAS bf16 at the same shape) for Nsight Compute to read its counters.

The kernels are compiled and run first; only the launches between cudaProfilerStart / Stop are
profiled (`ncu --profile-from-start off`). Used by `tools/run_gpu.sh ncu_decode`, which asks for the
throughput, memory, occupancy and warp-stall sections: whether a tile is bound by HBM, by L2 (the
activation tile is re-read by every N tile: M * K * 2 bytes per BN weight rows) or by its issue.

    ncu --profile-from-start off ... python3 -m benchmarks.tools.ncu_decode --layer gate+up --m 64 \
        [--bn 128 --warps 8 --stages 2 --split 1] [--cublas]
"""

import argparse

import torch

from benchmarks.ops.bench_decode_gemm import SHAPES, operands
from minite.kernels import decode_gemm as kd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layer", default="gate+up", choices=list(SHAPES))
    p.add_argument("--m", type=int, default=64)
    p.add_argument("--bn", type=int)
    p.add_argument("--bk", type=int)
    p.add_argument("--warps", type=int)
    p.add_argument("--stages", type=int)
    p.add_argument("--split", type=int)
    p.add_argument("--cublas", action="store_true", help="also profile cuBLAS bf16 at this shape")
    args = p.parse_args()
    n, k = SHAPES[args.layer]
    w, x, wq, a, sa = operands(n, k, args.m)
    cfg = kd.decode_config(args.m, n, k)
    for key, val in (("BN", args.bn), ("BK", args.bk), ("num_warps", args.warps),
                     ("num_stages", args.stages), ("SPLIT_K", args.split)):
        if val:
            cfg[key] = val
    dw = kd.pack_weight(wq.codes, wq.block_scales)
    for _ in range(3):
        kd.decode_gemm(a, sa, dw, wq.global_scale, config=cfg)
        torch.matmul(x, w.t())
    torch.cuda.synchronize()
    print("config", cfg, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    kd.decode_gemm(a, sa, dw, wq.global_scale, config=cfg)
    if args.cublas:
        torch.matmul(x, w.t())
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
