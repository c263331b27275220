"""Probe: a decode layout in MMA register order, one dot per K step (GPU, one call).

The decode kernel runs four dots per K step (one per code position of the int16 words); its SASS
waits for each dot's wgmma before dequantizing the next operand (ncu: tensor pipe 33 % busy at
M = 64, nothing else saturated). Here a word holds the four columns one thread owns in the MMA's
register operand ({2t, 2t+1, 2t+8, 2t+9} of a k16 block; words t of two blocks side by side), so the
four code tensors join into one [BN, BK] operand in plain column order without a shuffle, and the
loop has one dot, which Triton pipelines (wgmma waits allow 7 in flight).

    python benchmarks/exp_decode_pairs.py --out OUT.json
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


def pack_pairs(codes: torch.Tensor, block_scales: torch.Tensor, dtype=torch.bfloat16):
    """Codes uint8 [N, K // 2] -> int16 words [N, K // 4]: column 32 g + 16 b + 8 h + 2 t + e is code
    2 b + h of word 8 g + 2 t + e (bits as kd.WORD_BITS); scales as kd.pack_weight."""
    n, kh = codes.shape
    k = 2 * kh
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(n, k // 32, 2, 2, 4, 2).to(torch.int32)
    nib = nib.permute(0, 1, 4, 5, 2, 3).reshape(n, k // 32, 4, 2, 4)  # [n, g, t, e, o = 2b + h]
    mag, sign = nib & 7, nib >> 3
    word = torch.zeros_like(mag[..., 0])
    for o, (mag_at, sign_at) in enumerate(kd.WORD_BITS):
        for bit, at in enumerate(mag_at):
            word |= ((mag[..., o] >> bit) & 1) << at
        word |= sign[..., o] << sign_at
    scales = (block_scales.float() * kd.SCALE_SHIFT[dtype]).to(dtype)
    return word.reshape(n, k // 4).to(torch.int16).contiguous(), scales.contiguous()


@triton.jit
def _pairs_kernel(a_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N,
                  stride_am, stride_cn, stride_sn, stride_om, stride_sa,
                  K: tl.constexpr, EPILOGUE: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr,
                  W_SHIFT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    KS: tl.constexpr = K // SPLIT_K
    G: tl.constexpr = BK // 32
    w_cols = (codes_ptr + rows * stride_cn)[:, None] + tl.arange(0, BK // 4)[None, :]
    s_cols = (ws_ptr + rows * stride_sn)[:, None] + tl.arange(0, BK // 16)[None, :]
    a_cols = (a_ptr + offs_m.to(tl.int64) * stride_am)[None, :] + tl.arange(0, BK)[:, None]
    acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kb = pid_k * KS + k0
        q = tl.reshape(tl.load(w_cols + kb // 4), [BN, G, 4, 2])
        s0, s1 = tl.split(tl.reshape(tl.load(s_cols + kb // 16), [BN, G, 2]))
        s0 = s0[:, :, None, None]
        s1 = s1[:, :, None, None]
        w0 = kd._code(q, 0, BF16, HW) * s0
        w1 = kd._code(q, 1, BF16, HW) * s0
        w2 = kd._code(q, 2, BF16, HW) * s1
        w3 = kd._code(q, 3, BF16, HW) * s1
        wj = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [BN, G, t, e, h, b]
        w = tl.reshape(tl.permute(wj, (0, 1, 5, 4, 2, 3)), [BN, BK])
        x = tl.load(a_cols + kb, mask=mask_m[None, :], other=0.0)
        acc_t = tl.dot(w, x, acc_t)
    acc = tl.trans(acc_t) * W_SHIFT
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=1.0)
    sw = tl.load(sw_ptr)
    if SPLIT_K == 1:
        tl.store(out_ptrs, epilogue(acc, sa, sw, EPILOGUE).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
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
            tl.store(out_ptrs, epilogue(total, sa, sw, EPILOGUE).to(out_ptr.dtype.element_ty), mask=out_mask)


def pairs_gemm(a, sa, words, scales, w_scale, cfg, out_dtype=torch.bfloat16):
    m, k = a.shape
    n = words.shape[0]
    bm, bn, bk, split = cfg["BM"], cfg["BN"], cfg["BK"], cfg["SPLIT_K"]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    tiles = triton.cdiv(n, bn)
    if split > 1:
        part = torch.empty(split, bm, n, dtype=torch.float32, device=a.device)
        counters = kd._split_counters(tiles, a.device)
    else:
        part = counters = out
    sa = sa.reshape(-1)
    _pairs_kernel[(tiles, split)](
        a, words, scales, sa, w_scale, out, part, counters, m, n,
        a.stride(0), words.stride(0), scales.stride(0), out.stride(0), 0 if sa.numel() == 1 else 1,
        K=k, EPILOGUE=0, BF16=a.dtype == torch.bfloat16, HW=not interpreted(), W_SHIFT=kd.W_SHIFT[a.dtype],
        BM=bm, BN=bn, BK=bk, SPLIT_K=split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def split_for(n, k, bn, bk, min_programs):
    split = 1
    while -(-n // bn) * split < min_programs and split < 16 and k % (2 * split * bk) == 0:
        split *= 2
    return split


# (BM, BN, BK, warps, stages, MIN_PROGRAMS) per M
SMALL = [(16, 64, 256, 4, 3, 200), (16, 64, 256, 4, 4, 200), (16, 64, 512, 4, 3, 200),
         (16, 64, 256, 4, 3, 264)]
CANDS = {
    1: SMALL,
    8: SMALL,
    32: [(32, 64, 256, 4, 3, 264), (32, 64, 256, 4, 2, 264), (32, 64, 128, 4, 3, 264),
         (32, 64, 512, 4, 2, 264), (32, 128, 256, 8, 2, 264)],
    64: [(64, 64, 256, 4, 2, 264), (64, 64, 256, 4, 3, 264), (64, 64, 128, 4, 3, 264),
         (64, 64, 128, 4, 4, 264), (64, 128, 256, 8, 2, 264), (64, 64, 256, 4, 2, 132)],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="exp_decode_pairs.json")
    args = p.parse_args()
    from bench_common import env_info, warm_up
    from bench_decode_gemm import SHAPES, copies, graph_us, operands

    from minite.kernels import gemm as kg

    warm_up()
    rows = []
    for layer, (n, k) in SHAPES.items():
        for m in (1, 8, 32, 64):
            w, x, wq, a, sa = operands(n, k, m)
            wbytes = n * k * 0.625
            base = graph_us([lambda w=w_: torch.matmul(x, w.t()) for w_ in copies(w, w.numel() * 2)])
            dw = kd.pack_weight(wq.codes, wq.block_scales)
            old = graph_us([lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale)
                            for d in [kd.DecodeWeight(c, dw.scales.clone(), dw.chunk)
                                      for c in copies(dw.codes, int(wbytes))]])
            aligned = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq), wq.global_scale, out_dtype=torch.float32)
            words, scales = pack_pairs(wq.codes, wq.block_scales)
            row = dict(layer=layer, M=m, cublas_us=base, old_us=old, old_x=base / old, cands=[])
            for bm, bn, bk, wp, st, mp in CANDS[m]:
                cfg = dict(BM=bm, BN=bn, BK=bk, SPLIT_K=split_for(n, k, bn, bk, mp), num_warps=wp,
                           num_stages=st)
                try:
                    got = pairs_gemm(a, sa, words, scales, wq.global_scale, cfg, torch.float32)
                    t = graph_us([lambda c=c: pairs_gemm(a, sa, c, scales, wq.global_scale, cfg)
                                  for c in copies(words, int(wbytes))])
                except Exception as e:  # noqa: BLE001
                    row["cands"].append(dict(cfg, error=f"{type(e).__name__}: {str(e)[:160]}"))
                    continue
                row["cands"].append(dict(cfg, us=t, x=base / t, weight_tb_s=wbytes / t / 1e6,
                                         bitwise_aligned=bool(torch.equal(got, aligned)),
                                         exact_frac=float((got == aligned).float().mean())))
            best = min((c for c in row["cands"] if "us" in c), key=lambda c: c["us"], default=None)
            row["best"] = best
            rows.append(row)
            print(f"{layer:>8} M={m:>2} cublas {base:6.1f} old {old:6.1f} ({base / old:.2f}x) pairs best "
                  f"{best['us'] if best else 0:6.1f} ({best['x'] if best else 0:.2f}x) {best}", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(benchmark="decode pairs probe", env=env_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
