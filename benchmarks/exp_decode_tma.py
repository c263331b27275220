"""Probe: the decode GEMM with its operands brought in by TMA (one 64-row x 256-column memory tile of
words and scales per K step, the activation slice), optionally warp-specialized (`tl.range(...,
warp_specialize=True)`: a producer warp issues the copies, the consumer warpgroup dequantizes and runs
the wgmma). Against the library kernel (`kernels.decode_gemm`, pointer loads that Triton pipelines
through cp.async) at the same split, timed as bench_decode_gemm.py does (CUDA graphs over rotating
weight copies); the unsplit form must give the aligned bits (the same K order).

    python benchmarks/exp_decode_tma.py --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch
import triton
import triton.language as tl
from bench_common import parse_args, report, warm_up
from bench_decode_gemm import MS, SHAPES, copies, graph_us, operands

from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels.epilogue import EPILOGUES, epilogue

VARIANTS = ((False, 2), (False, 3), (False, 4), (True, 3))  # (warp-specialized, stages)


@triton.jit
def _tma_decode_kernel(a_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N, ROWS,
                       stride_am, stride_om, K: tl.constexpr, W_SHIFT: tl.constexpr, BM: tl.constexpr,
                       SPLIT_K: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    BN: tl.constexpr = 64
    BK: tl.constexpr = 256  # one memory tile per K step
    STEPS: tl.constexpr = K // BK
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    w_desc = tl.make_tensor_descriptor(codes_ptr, [ROWS, BK // 4], [BK // 4, 1], [BN, BK // 4])
    s_desc = tl.make_tensor_descriptor(ws_ptr, [ROWS, BK // 16], [BK // 16, 1], [BN, BK // 16])
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BM, BK])
    KS: tl.constexpr = K // SPLIT_K
    acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in tl.range(0, KS, BK, num_stages=STAGES, warp_specialize=WS):
        kb = pid_k * KS + k0
        row = (pid_n * STEPS + kb // BK) * BN
        w = kd.dequant_step(w_desc.load([row, 0]), s_desc.load([row, 0]), True, True, BN, BK)
        acc_t = tl.dot(w, a_desc.load([0, kb]).T, acc_t)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    mask_n = offs_n < N
    mask_m = offs_m < M
    acc = tl.trans(acc_t) * W_SHIFT
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    sa = tl.load(sa_ptr + offs_m, mask=mask_m, other=1.0)
    sw = tl.load(sw_ptr)
    if SPLIT_K == 1:
        tl.store(out_ptrs, epilogue(acc, sa, sw, 0).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # the library's deterministic split-K: the last program of the tile sums in split order
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + pid_k * BM * N, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                total += tl.load(parts + i * BM * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            tl.store(out_ptrs, epilogue(total, sa, sw, 0).to(out_ptr.dtype.element_ty), mask=out_mask)


def tma_decode(a, sa, w: kd.DecodeWeight, sw, split: int, ws: bool, stages: int) -> torch.Tensor:
    m, k = a.shape
    n = w.shape[0]
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    tiles = w.n_pad // 64
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    part = torch.empty(split, bm, n, dtype=torch.float32, device=a.device) if split > 1 else out
    counters = kd._split_counters(tiles, a.device) if split > 1 else out
    kg._set_tma_allocator()
    _tma_decode_kernel[(tiles, split)](a, w.codes, w.scales, sa, sw, out, part, counters, m, n,
                                       w.codes.numel() // 64, a.stride(0), out.stride(0), K=k,
                                       W_SHIFT=kd.W_SHIFT[a.dtype], BM=bm, SPLIT_K=split, WS=ws,
                                       STAGES=stages, num_warps=4)
    return out


def main():
    args = parse_args("benchmarks/results/exp_decode_tma.json")
    assert EPILOGUES["sdec"] == 0
    warm_up()
    rows = []
    for layer, (n, k) in SHAPES.items():
        for m in MS:
            w, x, wq, a, sa = operands(n, k, m)
            dw = kd.pack_weight(wq.codes, wq.block_scales)
            cfg = dict(kd.decode_config(m, n, k), BK=256)  # the library's split, on whole memory tiles
            split = cfg["SPLIT_K"] = min(cfg["SPLIT_K"], k // 256)
            dws = [kd.DecodeWeight(c, dw.scales.clone(), dw.n) for c in copies(dw.codes, n * k * 5 // 8)]
            row = dict(layer=layer, M=m, N=n, K=k, split=split)
            ws_ = copies(w, w.numel() * 2)
            row["cublas_us"] = graph_us([lambda w=w_: torch.matmul(x, w.t()) for w_ in ws_])
            row["library_us"] = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale) for d in dws])
            row["library_bk256_us"] = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale,
                                                                           config=cfg) for d in dws])
            aligned = kd.decode_gemm(a, sa, dw, wq.global_scale, config=kd.aligned_decode_config(m, k))
            for ws, stages in VARIANTS:
                name = f"tma{'_ws' if ws else ''}_s{stages}"
                try:
                    same = torch.equal(tma_decode(a, sa, dw, wq.global_scale, 1, ws, stages), aligned)
                    row[name + "_us"] = graph_us([lambda d=d: tma_decode(a, sa, d, wq.global_scale, split, ws,
                                                                         stages) for d in dws])
                    row[name + "_aligned_bits"] = same
                except Exception as err:  # a variant that does not compile or fit
                    row[name + "_error"] = str(err)[:160]
            best = min((v, key) for key, v in row.items() if key.startswith("tma") and key.endswith("_us"))
            row.update(best=best[1], best_x=row["cublas_us"] / best[0],
                       library_x=row["cublas_us"] / row["library_us"])
            rows.append(row)
            print({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()}, flush=True)
    report("decode by TMA (probe)", rows, args.out, dict(shapes=SHAPES))


if __name__ == "__main__":
    main()
