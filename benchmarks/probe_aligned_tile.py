"""Host time per W4A4 launch and GPU time per call at the learner's shapes (Qwen3-1.7B, M = 8192) and
the Qwen3-8B k|v shape at M = 4096, for the aligned tiles: small and large on pointer loads (sessions
4-6) and both by TMA (session 7: the large one persistent). Session 4 asked why
the dense learner slowed with the large tile; session 7 whether TMA descriptors cost host time (the
TMA sweep's k|v row at M = 4096, timed without graphs, read 0.39x cuBLAS).

    python benchmarks/probe_aligned_tile.py --out OUT.json
"""

import argparse
import json
import time

import torch
from bench_common import bench_ms, env_info, warm_up
from bench_decode_gemm import graph_us

from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq

SHAPES = {"1.7B q": (8192, 2048, 2048), "1.7B kv": (8192, 1024, 2048), "1.7B gate|up": (8192, 12288, 2048),
          "1.7B down": (8192, 2048, 6144), "8B k|v": (4096, 1024, 4096)}
POINTER_SMALL = dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
POINTER_LARGE = dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=4)
TILES = {"small": POINTER_SMALL, "small tma": kg.CONFIGS["aligned"], "large pointer": POINTER_LARGE,
         "large tma": kg.CONFIGS["aligned_large"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    warm_up()
    rows = []
    for name, (m, n, k) in SHAPES.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wq = kq.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), "tensor")
        wc = kg.unscaled_copy(wq)
        a, sa = kq.quantize_unscaled(x)
        outs = {}
        cublas = graph_us([lambda: torch.matmul(x, wc.t())] * 4)  # noqa: B023
        for label, cfg in TILES.items():
            outs[label] = kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=cfg)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=cfg)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            gpu = bench_ms(lambda: kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=cfg))  # noqa: B023
            graph = graph_us([lambda: kg.w4a4_gemm(a, sa, wc, wq.global_scale, config=cfg)] * 4)  # noqa: B023
            rows.append(dict(shape=name, M=m, N=n, K=k, tile=label, host_us=(t1 - t0) / 200 * 1e6,
                             loop_us=(t2 - t0) / 200 * 1e6, gpu_us=gpu * 1e3, graph_us=graph,
                             cublas_graph_us=cublas, graph_vs_cublas=cublas / graph,
                             same_bits=bool(torch.equal(outs[label], outs["small"]))))
            print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
