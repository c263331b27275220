"""How fast can any kernel be at the decode GEMM's shapes, in `ops/bench_decode_gemm.py`'s harness? The floor
of a kernel that only reads the packed weight's bytes, against cuBLAS bf16 and our decode GEMM timed
the same way (CUDA graphs of back-to-back calls over rotating weight copies, so every call reads HBM).

- `empty_us`: a kernel that does nothing (256 programs): the per-call cost of a graph node;
- `read_us`: the fastest of several grids and step sizes of a kernel that streams the layout's bytes
  (0.625 per weight) and writes one word per program: no dequantization, no MMA, no split-K reduction;
- `max_x` = cuBLAS / read_us: the most any kernel reading those bytes could reach against cuBLAS here.
  Where it is below 2.5 (the decode target), no decode GEMM on this layout can reach the target.

    python -m benchmarks.tools.probe_decode_floor --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch
import triton
import triton.language as tl

from benchmarks.common import copies, graph_us, parse_args, report, warm_up
from benchmarks.ops.bench_decode_gemm import MS, SHAPES, operands
from minite.kernels import decode_gemm as kd

GRIDS = (132, 264, 528, 1056, 2112, 4224)
BLOCKS = (512, 1024, 2048)  # int32 words a program reads per step (2-8 KB)


@triton.jit
def _empty(out_ptr):
    if tl.program_id(0) < 0:
        tl.store(out_ptr, 0)


@triton.jit
def _read(x_ptr, out_ptr, words, per_program, BLOCK: tl.constexpr):
    """XOR of a program's contiguous share of `words` int32 words (so the loads cannot be dropped)."""
    start = tl.program_id(0) * per_program
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(start, start + per_program, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_us(words: int, grid: int, block: int) -> float:
    per = triton.cdiv(triton.cdiv(words, grid), block) * block
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    xs = copies(torch.zeros(words, dtype=torch.int32, device="cuda"), words * 4)
    return graph_us([lambda x=x: _read[(grid,)](x, out, words, per, BLOCK=block, num_warps=4) for x in xs])


def main():
    args = parse_args()
    warm_up()
    out = torch.empty(1, dtype=torch.int32, device="cuda")
    empty = graph_us([lambda: _empty[(256,)](out)] * 64)
    rows = []
    for layer, (n, k) in SHAPES.items():
        words = n * k * 5 // 32  # 0.625 bytes per weight in int32 words
        reads = {(g, b): read_us(words, g, b) for g in GRIDS for b in BLOCKS}
        grid = min(reads, key=reads.get)
        for m in MS:
            w, x, wq, a, sa = operands(n, k, m)
            dw = kd.pack_weight(wq.codes, wq.block_scales)
            dws = [kd.DecodeWeight(c, dw.scales.clone(), dw.n) for c in copies(dw.codes, words * 4)]
            base = graph_us([lambda w=w_: torch.matmul(x, w.t()) for w_ in copies(w, w.numel() * 2)])
            ours = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale) for d in dws])
            row = dict(layer=layer, M=m, N=n, K=k, mbytes=words * 4 / 1e6, empty_us=empty,
                       read_us=reads[grid], read_grid=grid[0], read_block=grid[1],
                       read_tb_s=words * 4 / reads[grid] / 1e6,
                       cublas_us=base, decode_us=ours, decode_x=base / ours, max_x=base / reads[grid],
                       decode_over_read=ours / reads[grid])
            rows.append(row)
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    report("decode floor", rows, args.out, dict(grids=GRIDS, block_words=BLOCKS, empty_us=empty))


if __name__ == "__main__":
    main()
