"""One decode-attention launch over a paged KV cache in each format, for Nsight Compute to read its
counters: whether the quantized formats' kernel is bound by memory, by issue (the dequantization) or
by stalls on loads that are not pipelined.

The kernels are compiled and run first; only the launches between cudaProfilerStart / Stop are
profiled (`ncu --profile-from-start off`). `bash benchmarks/tools/run_gpu.sh ncu_attention` asks for
the throughput, memory, occupancy and warp-stall sections.

    ncu --profile-from-start off ... python3 -m benchmarks.tools.ncu_attention --formats bf16,fp8,nvfp4
"""

import argparse

import torch

from benchmarks.ops.bench_attention import decode_inputs, quantized_cache
from minite.kernels import attention as ka


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--formats", default="bf16,fp8,nvfp4")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--context", type=int, default=512)
    args = p.parse_args()
    cache, tables, q, seq, pos, lens = decode_inputs(args.batch, args.context)
    tiles = ka.plan_tiles(seq, args.batch, q.shape[1] // cache.k.shape[-2])
    runs = []
    for fmt in args.formats.split(","):
        c = cache if fmt == "bf16" else quantized_cache(cache, fmt)
        runs.append(lambda c=c: ka.paged_attention(q, c.k[0], c.v[0], seq, pos, tables, lens, tiles=tiles))
    for run in runs:
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs:
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
