"""Reference of the attention kernel's exact math: causal GQA over paged (or contiguous) keys, keys
consumed in fixed chunks of `kv_block` positions with an fp32 online softmax.

Layout. Query row n (`q [N, Hq, D]`) belongs to sequence `query_seq[n]` and sits at position
`query_pos[n]`. Key/value position p of sequence s lives in a flat slot: paged,
`block_tables[s, p // block_size] * block_size + p % block_size` of `k_cache [num_blocks, block_size,
Hkv, D]`; contiguous, row `kv_start[s] + p` of `k [M, Hkv, D]`. Key p is visible to query n iff
`p <= query_pos[n]` and `p < context_lens[s]`; positions are slot order, so cached and fresh keys
are treated alike. Query head h reads key/value head `h // (Hq // Hkv)`.

Math, per query row and head, with `c = fl32(scale * log2(e))` (scale defaults to D^-0.5):
    m = -inf, l = 0, acc = 0 (fp32 [D])
    for each chunk [j0, j0 + kv_block), j0 = 0, kv_block, 2 * kv_block, ... (the same boundaries for
    every caller, whatever batch the query is in):
        s_j = fl32(q . k_j) * c  (fp32 dot of the stored values; -inf where key j is not visible)
        m' = max(m, max_j s_j);  u = m' (0 if m' = -inf);  alpha = 2^(m - u);  p_j = 2^(s_j - u)
        l = l * alpha + sum_j p_j
        acc = acc * alpha + sum_j cast(p_j, v.dtype) * v_j  (fp32 accumulation)
    out = acc / l (0 where no key is visible), cast to q's dtype.
Quantized keys and values (`minite.ref.kv_quant.QuantizedKV`, fp8 or nvfp4): the dot products run on
the exact unscaled values (`exact`, in q's dtype) and each key's fp32 row scale is folded in,
    s_j = fl32(fl32(q . kexact_j) * kscale_j) * c
and each value's into the probabilities before their cast,
    acc = acc * alpha + sum_j cast(fl32(p_j * vscale_j), q.dtype) * vexact_j
(l sums the unscaled p_j). With bf16 keys and values the steps are the ones above.
Chunks entirely past the query change nothing (alpha = 1, p = 0), so a query's result depends only
on its own sequence's keys up to its position, never on other rows of the batch.

Backward (`contiguous_attention_backward`, the learner's), exact softmax attention in fp32: with
P = softmax_j(s_j) over the visible keys (s_j = scale * q . k_j) and dO the output's gradient,
    dV_j += P_j dO,  dP_j = dO . v_j,  dS_j = P_j (dP_j - sum_i P_i dP_i),
    dQ = scale * sum_j dS_j k_j,  dK_j += scale * dS_j q
(sums over every query head that reads kv head j's group). The Triton backward
(`minite.kernels.attention_backward`) recomputes P from the forward's log-sum-exp chunk by chunk and
takes sum_i P_i dP_i as dO . O; it matches this closely, not bitwise.

Agreement. In fp32 this equals `minite.nn.attention.attention` up to fp32 rounding (tested). The
Triton kernel (`minite.kernels.attention`) follows these steps but sums inside tensor-core MMAs and
tree reductions in its own order, so it matches this reference closely, not bitwise. What is bitwise
is the kernel against itself: one fixed launch configuration for every call, so the output for a
query is the same bits whether it was computed in a decode step (one query per sequence, keys from
the paged cache), in a full prefill of its sequence, or in a packed batch with other sequences.
"""

from __future__ import annotations

import math

import torch

from minite.ref.kv_quant import QuantizedKV

# The default keys per chunk of the online softmax (the bf16 / fp32 kernel's BLOCK_N); the kernel's chunk for
# each operand dtype and KV format is `minite.kernels.attention.kv_block(dtype, kv_format)`.
KV_BLOCK = 64
LOG2E = math.log2(math.e)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_seq: torch.Tensor,
                    query_pos: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    scale: float | None = None, kv_block: int = KV_BLOCK) -> torch.Tensor:
    """q [N, Hq, D], k_cache / v_cache [num_blocks, block_size, Hkv, D] (tensors or `QuantizedKV`),
    query_seq / query_pos [N], block_tables [S, W], context_lens [S] -> [N, Hq, D] in q's dtype."""
    block_size = k_cache.shape[1]
    width = block_tables.shape[1] * block_size
    pos = torch.arange(width, device=q.device)
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [S, width]
    return _chunked(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), query_seq, query_pos, slots,
                    context_lens, scale, kv_block)


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_seq: torch.Tensor,
                         query_pos: torch.Tensor, kv_start: torch.Tensor, context_lens: torch.Tensor,
                         scale: float | None = None, kv_block: int = KV_BLOCK) -> torch.Tensor:
    """q [N, Hq, D], k / v [M, Hkv, D] (tensors or `QuantizedKV`) with sequence s's keys at rows
    kv_start[s] + 0, 1, ..., query_seq / query_pos [N], kv_start / context_lens [S] -> [N, Hq, D] in
    q's dtype."""
    width = max(int(context_lens.max()), 1) if context_lens.numel() else 1
    slots = kv_start.long()[:, None] + torch.arange(width, device=q.device)  # [S, width]
    return _chunked(q, k, v, query_seq, query_pos, slots.clamp(max=k.shape[0] - 1), context_lens, scale,
                    kv_block)


def _unscaled(x, dtype):
    """(values, row scales or None): a `QuantizedKV`'s exact values in `dtype` and its scales."""
    if isinstance(x, QuantizedKV):
        return x.exact(dtype), x.scale
    return x, None


def _chunked(q, k, v, query_seq, query_pos, slots, context_lens, scale, kv_block):
    """k / v [slots, Hkv, D]; slots [S, width]: the flat slot of each sequence's key positions."""
    (k, k_scale), (v, v_scale) = _unscaled(k, q.dtype), _unscaled(v, q.dtype)
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    if Hq % Hkv or k.shape[-1] != D or v.shape != k.shape:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    G = Hq // Hkv
    c = torch.tensor((D ** -0.5 if scale is None else scale) * LOG2E, dtype=torch.float32)
    qf = q.float().view(N, Hkv, G, D)
    seq, qpos = query_seq.long(), query_pos.long()
    ctx = context_lens.long()[seq]  # [N]
    m = torch.full((N, Hkv, G), float("-inf"))
    l = torch.zeros(N, Hkv, G)
    acc = torch.zeros(N, Hkv, G, D)
    m, l, acc = m.to(q.device), l.to(q.device), acc.to(q.device)
    for j0 in range(0, slots.shape[1], kv_block):
        j = torch.arange(j0, min(j0 + kv_block, slots.shape[1]), device=q.device)  # [C]
        rows = slots[seq][:, j]  # [N, C]
        kj = k[rows].float()  # [N, C, Hkv, D]
        vj = v[rows]
        s = torch.einsum("nhgd,nchd->nhgc", qf, kj)  # [N, Hkv, G, C] fp32
        if k_scale is not None:
            s = s * k_scale[rows].transpose(1, 2)[:, :, None, :]
        s = s * c
        visible = (j[None, :] <= qpos[:, None]) & (j[None, :] < ctx[:, None])  # [N, C]
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        u = torch.where(m_new == float("-inf"), 0.0, m_new)
        alpha = torch.exp2(m - u)
        p = torch.exp2(s - u[..., None])
        l = l * alpha + p.sum(-1)
        if v_scale is not None:
            p = p * v_scale[rows].transpose(1, 2)[:, :, None, :]
        pv = torch.einsum("nhgc,nchd->nhgd", p.to(v.dtype).float(), vj.float())
        acc = acc * alpha[..., None] + pv
        m = m_new
    out = torch.where(l[..., None] > 0, acc / l[..., None], 0.0)
    return out.reshape(N, Hq, D).to(q.dtype)


def contiguous_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  query_seq: torch.Tensor, query_pos: torch.Tensor, kv_start: torch.Tensor,
                                  context_lens: torch.Tensor, scale: float | None = None):
    """Gradients (dq, dk, dv) of `contiguous_attention` (the module docstring's formulas, fp32, in the
    operands' dtype) for grad [N, Hq, D] of its output."""
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    width = max(int(context_lens.max()), 1) if context_lens.numel() else 1
    seq, qpos = query_seq.long(), query_pos.long()
    j = torch.arange(width, device=q.device)
    slots = (kv_start.long()[seq][:, None] + j).clamp(max=k.shape[0] - 1)  # [N, W]
    visible = (j[None, :] <= qpos[:, None]) & (j[None, :] < context_lens.long()[seq][:, None])
    qf, do = q.float().view(N, Hkv, G, D), grad.float().view(N, Hkv, G, D)
    kj, vj = k[slots].float(), v[slots].float()  # [N, W, Hkv, D]
    s = torch.einsum("nhgd,nwhd->nhgw", qf, kj) * scale
    p = torch.softmax(s.masked_fill(~visible[:, None, None, :], float("-inf")), -1).nan_to_num(0.0)
    dp = torch.einsum("nhgd,nwhd->nhgw", do, vj)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    dq = torch.einsum("nhgw,nwhd->nhgd", ds, kj) * scale
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    flat = slots.reshape(-1)
    dk.index_add_(0, flat, torch.einsum("nhgw,nhgd->nwhd", ds, qf).reshape(-1, Hkv, D) * scale)
    dv.index_add_(0, flat, torch.einsum("nhgw,nhgd->nwhd", p, do).reshape(-1, Hkv, D))
    return dq.reshape(N, Hq, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
