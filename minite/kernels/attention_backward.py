"""Triton backward of the packed causal GQA attention (`kernels.attention.contiguous_attention`), the
kernel counterpart of `minite.ref.attention.contiguous_attention_backward`; the learner's backward.

Math (the exact softmax attention's gradient, as the reference states it): the forward stores each
(query, head) row's base-2 log-sum-exp `lse = m + log2(l)` of its scaled scores; the backward takes
`delta = sum_d(dO * O)` (fp32, per row) and, chunk by chunk, recomputes `p = 2^(s - lse)` with
`s = (q . k) * scale * log2(e)`, then `dV += p^T dO`, `dP = dO V^T`, `dS = p * (dP - delta)`,
`dK += dS^T Q`, `dQ += dS K`; dQ and dK are multiplied by `scale` at the end. p and dS enter the
MMAs in the value dtype (bf16 on the GPU), the sums are fp32.

Two kernels, no atomics, so the gradients are the same bits run after run:
- dQ: one program per query tile (the forward's tiles: BLOCK_M rows = BLOCK_M // G queries x the G
  heads of one kv head), walking the sequence's keys from position 0 in chunks of BLOCK_N.
- dK / dV: one program per tile of BLOCK_N keys of one sequence x one kv head, walking the
  sequence's queries from the tile's first key on (earlier queries cannot see it), BLOCK_M // G
  queries x G heads at a time, so the G query heads' contributions sum inside the program.

Against the reference: close, not bitwise (MMA order, bf16 p and dS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import launch as launch_kernel
from minite.ref.attention import LOG2E

CONFIGS = {
    # bf16 / fp16 on the GPU. H200, 16 x 1024 tokens, D 128 (benchmarks/ops/bench_attention_backward.py,
    # benchmarks/results/h200/attention_backward_with_reference.json): 1.12 / 2.31 ms at 16 / 32 query heads,
    # against 1.22 / 2.53 with 64 x 64 tiles in both kernels and 1.27-1.81 / 2.68-3.58 for the other
    # candidates (SDPA's flash backward: 0.59 / 1.12)
    "gpu": dict(dq=dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
                dkdv=dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=2)),
    "gpu_fp32": dict(dq=dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1),
                     dkdv=dict(BLOCK_M=32, BLOCK_N=32, num_warps=4, num_stages=1)),
    # the CPU interpreter: small tiles, so tiny tests walk several chunks
    "interpret": dict(dq=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
                      dkdv=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)),
}


@triton.jit
def _rows_of(tiles_ptr, tile, kvh, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """A query tile's rows: (sequence, valid [BLOCK_M], row [BLOCK_M] int64, head [BLOCK_M], any rows)."""
    seq = tl.load(tiles_ptr + tile * 3)
    row0 = tl.load(tiles_ptr + tile * 3 + 1)
    nrows = tl.load(tiles_ptr + tile * 3 + 2)
    r = tl.arange(0, BLOCK_M)
    valid = r // G < nrows
    rows = (row0 + tl.where(valid, r // G, 0)).to(tl.int64)
    return seq, valid, rows, kvh * G + r % G, nrows > 0


@triton.jit
def _load_rows(ptr, offs, valid, D: tl.constexpr):
    """[R, D] rows starting at ptr + offs [R] (zeros where not valid)."""
    return tl.load(ptr + offs[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, rows, heads, valid, stride_qn, stride_qh,
                stride_don, stride_doh, stride_ln, D: tl.constexpr, DOT_F32: tl.constexpr):
    """(q, dO [R, D], lse, delta, position [R]) of (query row, head) pairs (zeros where not valid)."""
    q = _load_rows(q_ptr, rows * stride_qn + heads * stride_qh, valid, D)
    do = _load_rows(do_ptr, rows * stride_don + heads * stride_doh, valid, D)
    if DOT_F32:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + rows * stride_ln + heads, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + rows * stride_ln + heads, mask=valid, other=0.0)
    return q, do, lse, delta, tl.load(pos_ptr + rows, mask=valid, other=-1)


@triton.jit
def _dq_chunk(q, do, lse, delta, qpos, dq, j0, kv_end, kv_base, kvh, k_ptr, v_ptr, qk_scale, stride_kn,
              stride_kh, stride_vn, stride_vh, D: tl.constexpr, DOT_F32: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_n = j0 + tl.arange(0, BLOCK_N)
    in_seq = offs_n < kv_end
    keys = kv_base + tl.where(in_seq, offs_n, 0)
    k = _load_rows(k_ptr, keys * stride_kn + kvh * stride_kh, in_seq, D)  # [BLOCK_N, D]
    v = _load_rows(v_ptr, keys * stride_vn + kvh * stride_vh, in_seq, D)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    visible = (offs_n[None, :] <= qpos[:, None]) & in_seq[None, :]
    p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    return tl.dot(ds, k, dq, input_precision=PRECISION)


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, tiles_ptr, pos_ptr, start_ptr,
               qk_scale, scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_don,
               stride_doh, stride_ln, stride_dqn, stride_dqh,
               G: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
               WHILE_LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    kvh = tl.program_id(1)
    seq, valid, rows, heads, any_rows = _rows_of(tiles_ptr, tl.program_id(0), kvh, G, BLOCK_M)
    if any_rows:
        q, do, lse, delta, qpos = _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, rows, heads, valid,
                                              stride_qn, stride_qh, stride_don, stride_doh, stride_ln, D,
                                              DOT_F32)
        kv_end = tl.max(qpos + 1, axis=0).to(tl.int32)
        kv_base = tl.load(start_ptr + seq).to(tl.int64)
        dq = tl.zeros([BLOCK_M, D], tl.float32)
        if WHILE_LOOP:  # the interpreter cannot take a loaded value as a range() bound
            j0 = 0
            while j0 < kv_end:
                dq = _dq_chunk(q, do, lse, delta, qpos, dq, j0, kv_end, kv_base, kvh, k_ptr, v_ptr, qk_scale,
                               stride_kn, stride_kh, stride_vn, stride_vh, D, DOT_F32, PRECISION, BLOCK_N)
                j0 += BLOCK_N
        else:
            for j0 in range(0, kv_end, BLOCK_N):
                dq = _dq_chunk(q, do, lse, delta, qpos, dq, j0, kv_end, kv_base, kvh, k_ptr, v_ptr, qk_scale,
                               stride_kn, stride_kh, stride_vn, stride_vh, D, DOT_F32, PRECISION, BLOCK_N)
        offs_d = tl.arange(0, D)
        tl.store(dq_ptr + rows[:, None] * stride_dqn + heads[:, None] * stride_dqh + offs_d[None, :],
                 (dq * scale).to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _dkdv_chunk(k, v, kpos, kvalid, dk, dv, q0, q_end, kvh, q_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr,
                qk_scale, stride_qn, stride_qh, stride_don, stride_doh, stride_ln, G: tl.constexpr,
                D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """Query rows q0 .. q0 + BLOCK_M // G (all G heads of kv head kvh) against the program's keys."""
    r = tl.arange(0, BLOCK_M)
    qrows = q0 + r // G
    qvalid = (r // G < BLOCK_M // G) & (qrows < q_end)  # BLOCK_M % G rows left over: padding
    qrows = tl.where(qvalid, qrows, 0).to(tl.int64)
    q, do, lse, delta, qpos = _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, pos_ptr, qrows,
                                          kvh * G + r % G, qvalid, stride_qn, stride_qh, stride_don,
                                          stride_doh, stride_ln, D, DOT_F32)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
    visible = (kpos[:, None] <= qpos[None, :]) & kvalid[:, None] & qvalid[None, :]
    p_t = tl.where(visible, tl.exp2(s_t - lse[None, :]), 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, tiles_ptr, pos_ptr,
                 start_ptr, len_ptr, qk_scale, scale, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn,
                 stride_vh, stride_don, stride_doh, stride_ln, stride_dkn, stride_dkh, stride_dvn, stride_dvh,
                 G: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                 WHILE_LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    kvh = tl.program_id(1)
    # key tiles are query tiles of one head: (sequence, first key row, number of keys)
    seq, kvalid, krows, _, any_keys = _rows_of(tiles_ptr, tl.program_id(0), 0, 1, BLOCK_N)
    if any_keys:
        k = _load_rows(k_ptr, krows * stride_kn + kvh * stride_kh, kvalid, D)  # [BLOCK_N, D]
        v = _load_rows(v_ptr, krows * stride_vn + kvh * stride_vh, kvalid, D)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        kpos = tl.load(pos_ptr + krows, mask=kvalid, other=0)
        q_end = tl.load(start_ptr + seq) + tl.load(len_ptr + seq)
        # a reduction, not a scalar load, so that the loop bound is 0-d in the interpreter too
        q_begin = tl.min(tl.where(kvalid, krows, q_end), axis=0)
        dk = tl.zeros([BLOCK_N, D], tl.float32)
        dv = tl.zeros([BLOCK_N, D], tl.float32)
        QPT: tl.constexpr = BLOCK_M // G  # queries per step
        if WHILE_LOOP:
            q0 = q_begin
            while q0 < q_end:
                dk, dv = _dkdv_chunk(k, v, kpos, kvalid, dk, dv, q0, q_end, kvh, q_ptr, do_ptr, lse_ptr,
                                     delta_ptr, pos_ptr, qk_scale, stride_qn, stride_qh, stride_don,
                                     stride_doh, stride_ln, G, D, DOT_F32, PRECISION, BLOCK_M)
                q0 += QPT
        else:
            for q0 in range(q_begin, q_end, QPT):
                dk, dv = _dkdv_chunk(k, v, kpos, kvalid, dk, dv, q0, q_end, kvh, q_ptr, do_ptr, lse_ptr,
                                     delta_ptr, pos_ptr, qk_scale, stride_qn, stride_qh, stride_don,
                                     stride_doh, stride_ln, G, D, DOT_F32, PRECISION, BLOCK_M)
        offs_d = tl.arange(0, D)
        tl.store(dk_ptr + krows[:, None] * stride_dkn + kvh * stride_dkh + offs_d[None, :],
                 (dk * scale).to(dk_ptr.dtype.element_ty), mask=kvalid[:, None])
        tl.store(dv_ptr + krows[:, None] * stride_dvn + kvh * stride_dvh + offs_d[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=kvalid[:, None])


def config(dtype: torch.dtype = torch.bfloat16) -> dict:
    """The backward's launch configurations in force for operands of `dtype`: {"dq": ..., "dkdv": ...}."""
    if interpreted():
        return CONFIGS["interpret"]
    return CONFIGS["gpu_fp32"] if dtype == torch.float32 else CONFIGS["gpu"]


def contiguous_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, query_seq: torch.Tensor,
                                  query_pos: torch.Tensor, kv_start: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float | None = None, q_tiles: torch.Tensor | None = None,
                                  k_tiles: torch.Tensor | None = None, cfg: dict | None = None):
    """Gradients of `contiguous_attention` for packed sequences whose queries are their keys: q, out,
    grad [N, Hq, D], k / v [N, Hkv, D], sequence s at rows kv_start[s] .. + context_lens[s] with
    positions 0, 1, ... (query_seq / query_pos [N]), lse fp32 [N, Hq] from the forward (its `lse=`).
    -> (dq, dk, dv) in the operands' dtype. q_tiles / k_tiles: `plan_tiles(query_seq, S, G,
    cfg["dq"]["BLOCK_M"])` and `plan_tiles(query_seq, S, 1, cfg["dkdv"]["BLOCK_N"])`, made once and
    shared by the layers."""
    from minite.kernels.attention import _check_common, plan_tiles

    _check_common(q, k, v, query_seq, query_pos, context_lens, "k", 3)
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if k.shape[0] != N or out.shape != q.shape or grad.shape != q.shape:
        raise ValueError(f"k / v must have q's N={N} rows and out / grad q's shape {tuple(q.shape)}; got k "
                         f"{tuple(k.shape)}, out {tuple(out.shape)}, grad {tuple(grad.shape)}")
    if lse.shape != (N, Hq) or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous fp32 [N, Hq] = {(N, Hq)}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    cfg = config(q.dtype) if cfg is None else cfg
    cq, ckv = cfg["dq"], cfg["dkdv"]
    if G > cq["BLOCK_M"] or G > ckv["BLOCK_M"]:
        raise ValueError(f"{G} query heads per kv head exceed the backward tiles' BLOCK_M")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if N == 0:
        return dq, dk.zero_(), dv.zero_()
    S = context_lens.shape[0]
    q_tiles = plan_tiles(query_seq, S, G, cq["BLOCK_M"]) if q_tiles is None else q_tiles
    k_tiles = plan_tiles(query_seq, S, 1, ckv["BLOCK_N"]) if k_tiles is None else k_tiles
    delta = (grad.float() * out.float()).sum(-1)  # [N, Hq]
    scale = D ** -0.5 if scale is None else scale
    dot_f32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreted())
    common = dict(G=G, D=D, DOT_F32=dot_f32, PRECISION="ieee" if dot_f32 else "tf32",
                  WHILE_LOOP=interpreted())
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), grad.stride(0),
               grad.stride(1), lse.stride(0))
    launch_kernel(_dq_kernel, (q_tiles.shape[0], Hkv), (
        q, k, v, grad, lse, delta, dq, q_tiles, query_pos, kv_start, scale * LOG2E, scale, *strides,
        dq.stride(0), dq.stride(1)), **common, **cq)
    launch_kernel(_dkdv_kernel, (k_tiles.shape[0], Hkv), (
        q, k, v, grad, lse, delta, dk, dv, k_tiles, query_pos, kv_start, context_lens, scale * LOG2E, scale,
        *strides, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1)), **common, **ckv)
    return dq, dk, dv
