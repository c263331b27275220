"""One grouped-decode launch for Nsight Compute to read its counters: the MoE experts of a decode step
(Qwen3-30B-A3B, 128 experts, top-8, random routing) or one weight in row tiles (`decode_gemm_rows`,
the 30B-A3B attention projections). The kernel is compiled and run first; only the launch between
cudaProfilerStart / Stop is profiled (`ncu --profile-from-start off`). Used by
`tools/run_gpu.sh ncu_grouped_decode` (the files `ncu_grouped_decode_experts.txt` and
`ncu_decode_rows_moe_o.txt` came from these shapes and data).

    ncu --profile-from-start off ... python3 -m benchmarks.tools.ncu_grouped_decode experts --tokens 256
    ncu --profile-from-start off ... python3 -m benchmarks.tools.ncu_grouped_decode rows --layer "moe o"
"""

import argparse

import torch

from benchmarks.common import EXPERTS, MOE_OPS, TOP_K
from benchmarks.ops.bench_decode_rows import SHAPES
from benchmarks.ops.bench_grouped_decode import experts
from minite.kernels import decode_gemm as kd
from minite.kernels import grouped_decode as gd
from minite.kernels import nvfp4 as kq


def _experts_launch(op: str, tokens: int):
    n, k = MOE_OPS[op]
    _, sw, _, dw = experts(n, k)
    ids = torch.randn(tokens, EXPERTS, device="cuda").topk(TOP_K, dim=-1).indices.reshape(-1)
    offsets = torch.zeros(EXPERTS + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.bincount(ids, minlength=EXPERTS).cumsum(0)
    a, sa = kq.quantize_unscaled(torch.randn(tokens * TOP_K, k, device="cuda", dtype=torch.bfloat16))
    return lambda: gd.grouped_decode_gemm(a, sa, dw, sw, offsets)


def _rows_launch(layer: str, m: int):
    n, k = SHAPES[layer]
    q = kq.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16), "tensor")
    dw = kd.pack_weight(q.codes, q.block_scales)
    a, sa = kq.quantize_unscaled(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    return lambda: gd.decode_gemm_rows(a, sa, dw, q.global_scale)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("target", choices=["experts", "rows"])
    p.add_argument("--op", default="gate|up", choices=list(MOE_OPS), help="experts: the projection")
    p.add_argument("--tokens", type=int, default=256, help="experts: tokens of the decode step")
    p.add_argument("--layer", default="moe o", choices=list(SHAPES), help="rows: the weight")
    p.add_argument("--m", type=int, default=128, help="rows: the row count")
    args = p.parse_args()
    torch.manual_seed(0)
    if args.target == "experts":
        run = _experts_launch(args.op, args.tokens)
    else:
        run = _rows_launch(args.layer, args.m)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
