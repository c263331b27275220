"""Why the dense learner slowed with the large aligned tile (session 4): host time per W4A4 launch and
GPU time per call, at the learner's shapes (Qwen3-1.7B, M = 8192), small vs large aligned tile.

    python benchmarks/probe_aligned_tile.py --out OUT.json
"""

import argparse
import json
import time

import torch
from bench_common import bench_ms, env_info, warm_up

from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq

SHAPES = {"q": (2048, 2048), "kv": (1024, 2048), "gate|up": (12288, 2048), "down": (2048, 6144)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    warm_up()
    rows = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(8192, k, device="cuda", dtype=torch.bfloat16)
        wq = kq.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), "tensor")
        wc = kg.unscaled_copy(wq)
        a, sa = kq.quantize_unscaled(x)
        outs = {}
        for label, large_m in (("small", 1 << 62), ("large", 2048)):
            kg.ALIGNED_LARGE_M = large_m
            outs[label] = kg.w4a4_gemm(a, sa, wc, wq.global_scale)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                kg.w4a4_gemm(a, sa, wc, wq.global_scale)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            gpu = bench_ms(lambda: kg.w4a4_gemm(a, sa, wc, wq.global_scale))  # noqa: B023
            rows.append(dict(shape=name, N=n, K=k, tile=label, host_us=(t1 - t0) / 200 * 1e6,
                             loop_us=(t2 - t0) / 200 * 1e6, gpu_us=gpu * 1e3))
            print(rows[-1], flush=True)
        rows[-1]["same_bits"] = bool(torch.equal(outs["small"], outs["large"]))
    kg.ALIGNED_LARGE_M = 2048
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
