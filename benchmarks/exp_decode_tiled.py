"""Probe: does the decode GEMM's weight access pattern hold its bandwidth back at M <= 8 (GPU, one call)?

At M <= 8 the decode kernel streams 2.7 TB/s of packed weight where cuBLAS streams 3.7 TB/s of bf16
(ncu: DRAM 60 % vs 76-80 %, issue slots 55 % busy). Each K step of a program reads 128 bytes of
words and 32 bytes of scales from each of its 64 rows, rows 2 KB apart (K = 4096). Here the same
kernel reads a tiled copy instead: per 64-row block and K step of 256 columns, the words (8 KB) and
the scales (2 KB) contiguous. Same bits (the layout only moves bytes). Expected: if DRAM page
locality is the limit, 10-30 % less time at M <= 8; if issue is, nothing.

    python benchmarks/exp_decode_tiled.py --out OUT.json
"""

# ruff: noqa: B023
import argparse
import json

import torch
import triton
import triton.language as tl

from minite.kernels import decode_gemm as kd
from minite.kernels import interpreted
from minite.kernels.epilogue import epilogue

BN, BK = 64, 256  # the probe's only tile shape (the M <= 16 default's)


def tile(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[N, C] -> [N / BN, C / cols, BN, cols] contiguous: each (row block, K step) tile in one piece."""
    n, c = t.shape
    return t.reshape(n // BN, BN, c // cols, cols).permute(0, 2, 1, 3).contiguous()


@triton.jit
def _tiled_kernel(a_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N, stride_am,
                  stride_om, K: tl.constexpr, W_SHIFT: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    KS: tl.constexpr = K // SPLIT_K
    G: tl.constexpr = BK // 32
    r = tl.arange(0, BN)
    # tile (pid_n, step): BN x BK / 4 words, BN x BK / 16 scales, each contiguous
    w_tile = (codes_ptr + pid_n.to(tl.int64) * (BN * K // 4) + r[:, None] * (BK // 4)
              + tl.arange(0, BK // 4)[None, :])
    s_tile = (ws_ptr + pid_n.to(tl.int64) * (BN * K // 16) + r[:, None] * (BK // 16)
              + tl.arange(0, BK // 16)[None, :])
    a_cols = (a_ptr + offs_m.to(tl.int64) * stride_am)[None, :] + tl.arange(0, BK)[:, None]
    acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kb = pid_k * KS + k0
        step = kb // BK
        q = tl.reshape(tl.load(w_tile + step * (BN * BK // 4)), [BN, G, 4, 2])
        s0, s1 = tl.split(tl.reshape(tl.load(s_tile + step * (BN * BK // 16)), [BN, G, 2]))
        s0 = s0[:, :, None, None]
        s1 = s1[:, :, None, None]
        w = tl.join(tl.join(kd._code(q, 0, BF16, HW) * s0, kd._code(q, 1, BF16, HW) * s0),
                    tl.join(kd._code(q, 2, BF16, HW) * s1, kd._code(q, 3, BF16, HW) * s1))
        w = tl.reshape(tl.permute(w, (0, 1, 5, 4, 2, 3)), [BN, BK])
        x = tl.load(a_cols + kb, mask=mask_m[None, :], other=0.0)
        acc_t = tl.dot(w, x, acc_t)
    acc = tl.trans(acc_t) * W_SHIFT
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    sa = tl.load(sa_ptr + offs_m, mask=mask_m, other=1.0)
    sw = tl.load(sw_ptr)
    if SPLIT_K == 1:
        tl.store(out_ptrs, epilogue(acc, sa, sw, 0).to(out_ptr.dtype.element_ty), mask=mask_m[:, None])
    else:
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + pid_k * BM * N, acc, mask=mask_m[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                total += tl.load(parts + i * BM * N, mask=mask_m[:, None], other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            tl.store(out_ptrs, epilogue(total, sa, sw, 0).to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def tiled_gemm(a, sa, words_t, scales_t, w_scale, n, cfg, out_dtype=torch.bfloat16):
    m, k = a.shape
    split = cfg["SPLIT_K"]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if split > 1:
        part = torch.empty(split, cfg["BM"], n, dtype=torch.float32, device=a.device)
        counters = kd._split_counters(n // BN, a.device)
    else:
        part = counters = out
    _tiled_kernel[(n // BN, split)](a, words_t, scales_t, sa.reshape(-1), w_scale, out, part, counters, m, n,
                                    a.stride(0), out.stride(0), K=k, W_SHIFT=kd.W_SHIFT[a.dtype],
                                    BF16=a.dtype == torch.bfloat16, HW=not interpreted(), BM=cfg["BM"], BN=BN,
                                    BK=BK, SPLIT_K=split, num_warps=cfg["num_warps"],
                                    num_stages=cfg["num_stages"])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="exp_decode_tiled.json")
    args = p.parse_args()
    from bench_common import env_info, warm_up
    from bench_decode_gemm import SHAPES, copies, graph_us, operands

    warm_up()
    rows = []
    for layer, (n, k) in SHAPES.items():
        for m in (1, 8):
            _, _, wq, a, sa = operands(n, k, m)
            wbytes = n * k * 0.625
            cfg = kd.decode_config(m, n, k)
            assert cfg["BN"] == BN and cfg["BK"] == BK, cfg
            dw = kd.pack_weight(wq.codes, wq.block_scales)
            ref = kd.decode_gemm(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=cfg)
            words_t, scales_t = tile(dw.codes, BK // 4), tile(dw.scales, BK // 16)
            got = tiled_gemm(a, sa, words_t, scales_t, wq.global_scale, n, cfg, torch.float32)
            plain = [kd.DecodeWeight(c, dw.scales.clone()) for c in copies(dw.codes, int(wbytes))]
            tiles = [(c, scales_t.clone()) for c in copies(words_t, int(wbytes))]
            base = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale, config=cfg)
                             for d in plain])
            tiled = graph_us([lambda t=t: tiled_gemm(a, sa, *t, wq.global_scale, n, cfg) for t in tiles])
            row = dict(layer=layer, M=m, split=cfg["SPLIT_K"], decode_us=base, tiled_us=tiled,
                       speedup=base / tiled, decode_tb_s=wbytes / base / 1e6, tiled_tb_s=wbytes / tiled / 1e6,
                       same_bits=bool(torch.equal(got, ref)))
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(benchmark="decode tiled-layout probe", env=env_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
