"""The aligned decode kernel (no split-K) on narrow N tiles against its BN 64 tile: each tile's bits
against the aligned tile on the bf16 copy (heavy-tailed data) and its time (CUDA graphs over 8 weight
copies), at Qwen3-1.7B and Qwen3-30B-A3B shapes, M 1-64. BN 64 with 4 warps runs wgmma; BN 16-32
runs mma.sync, with more programs for a narrow weight; 8 warps put two warpgroups on one tile.

    python -m benchmarks.tools.probe_decode_narrow_tiles OUT.json ["BN64 w4,BN64 w8"]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import json
import sys

import torch

from benchmarks.common import env_info, graph_us
from minite import nvfp4
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg


def heavy(r, c, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, c, generator=g) ** 3
    x[torch.rand(r, c, generator=g) < 0.002] *= 50.0
    return x

SHAPES = {"dense qkv": (4096, 2048), "dense o": (2048, 2048), "dense gate|up": (12288, 2048),
          "dense down": (2048, 6144), "moe qkv": (5120, 2048), "moe o": (2048, 4096)}
VARIANTS = [("BN64 w4", dict(BN=64, num_warps=4)), ("BN32 w4", dict(BN=32, num_warps=4)),
            ("BN32 w2", dict(BN=32, num_warps=2)), ("BN16 w1", dict(BN=16, num_warps=1)),
            ("BN16 w2", dict(BN=16, num_warps=2)), ("BN32 w1", dict(BN=32, num_warps=1)),
            # two warpgroups on one 64-row weight tile: twice the threads dequantizing each K step
            ("BN64 w8", dict(BN=64, num_warps=8)), ("BN64 w8 s2", dict(BN=64, num_warps=8, num_stages=2)),
            ("BN128 w8", dict(BN=128, num_warps=8))]


def probe(variants: list) -> list:
    rows = []
    for name, (n, k) in SHAPES.items():
        wqs = [nvfp4.quantize(heavy(n, k, s).cuda(), "tensor") for s in range(8)]
        dws = [kd.pack_weight(q.codes, q.block_scales) for q in wqs]
        for m in (1, 16, 32, 64):
            xq = nvfp4.quantize(heavy(m, k, 99).cuda(), "row")
            a, sa = xq.unscaled().to(torch.bfloat16), xq.global_scale.reshape(-1)
            want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wqs[0]), wqs[0].global_scale, out_dtype=torch.float32)
            base = kd.aligned_decode_config(m, k)
            r = dict(shape=name, N=n, K=k, M=m, base=dict(base))
            for vname, change in variants:
                cfg = dict(base, **change)
                try:
                    got = kd.decode_gemm(a, sa, dws[0], wqs[0].global_scale, out_dtype=torch.float32,
                                         config=cfg)
                    same = bool(torch.equal(got, want))
                    us = graph_us([lambda d=d, q=q: kd.decode_gemm(a, sa, d, q.global_scale, config=cfg)
                                   for d, q in zip(dws, wqs)])
                except Exception as e:  # noqa: BLE001
                    same, us = None, None
                    print(name, m, vname, "failed:", repr(e)[:200])
                r[vname] = dict(us=us, same_bits=same)
            rows.append(r)
            cells = [f"{v}: {r[v]['us'] and round(r[v]['us'], 1)} {r[v]['same_bits']}" for v, _ in variants]
            print(name, m, "  ".join(cells), flush=True)
    return rows


def main():
    """argv: OUT.json [a comma-separated choice of the variants' names]."""
    variants = VARIANTS
    if len(sys.argv) > 2:
        variants = [v for v in VARIANTS if v[0] in sys.argv[2].split(",")]
    rows = probe(variants)
    json.dump(dict(benchmark="aligned decode kernel at narrow N tiles", rows=rows, env=env_info()),
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
