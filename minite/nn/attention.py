"""Causal grouped-query attention with Qwen3's per-head q/k RMSNorm.

Math (`attention`): for query i and key j of the same sequence, key j is visible iff
`0 <= k_pos[j] <= q_pos[i]`; `p = softmax_j(q_i . k_j * scale)` over visible keys (fp32 scores and
softmax), `out_i = sum_j p_ij v_j`, cast back to the query dtype. Each group of
`num_heads // num_kv_heads` query heads shares one key/value head. Visibility is decided by
positions alone, so keys read from a cache and keys computed in this call are treated alike; a
negative key position marks an empty (padding) slot. A query that sees no key gets a zero output.

`Attention` is the layer: q/k/v projections (recipe-driven `Linear`), RMSNorm of each q and k head,
RoPE, `attention`, output projection. `project_qkv` and `o_proj` are separate steps so a KV cache can
sit between them. Packed variable-length input (`cu_seqlens`) runs `attention` per sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from minite.nn.linear import Linear
from minite.nn.norm import RMSNorm
from minite.nn.rope import apply_rope, rope_cos_sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              scale: float | None = None) -> torch.Tensor:
    """Causal GQA: q `[B, Tq, Hq, D]`, k/v `[B, Tk, Hkv, D]`, q_pos `[B, Tq]`, k_pos `[B, Tk]`
    (integer positions) -> `[B, Tq, Hq, D]` in q's dtype."""
    B, Tq, Hq, D = q.shape
    Hkv = k.shape[2]
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hq % Hkv:
        raise ValueError(
            f"attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q_pos.shape != (B, Tq) or k_pos.shape != (B, k.shape[1]):
        raise ValueError(
            f"attention: q_pos {tuple(q_pos.shape)} / k_pos {tuple(k_pos.shape)} do not match q / k")
    scale = D ** -0.5 if scale is None else scale
    qg = q.float().view(B, Tq, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qg, k.float()) * scale  # [B, Hkv, G, Tq, Tk] fp32
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # [B, Tq, Tk]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1)[:, None, None, :, None], probs, 0.0)
    out = torch.einsum("bhgqk,bkhd->bqhgd", probs, v.float())  # [B, Tq, Hkv, G, D] fp32
    return out.reshape(B, Tq, Hq, D).to(q.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal GQA over packed sequences: q `[N, Hq, D]`, k/v `[N, Hkv, D]`, positions `[N]`,
    cu_seqlens `[S + 1]` (sequence s is rows `cu_seqlens[s]:cu_seqlens[s + 1]`) -> `[N, Hq, D]`."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the packed length {q.shape[0]}")
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        pos = positions[None, a:b]
        outs.append(attention(q[None, a:b], k[None, a:b], v[None, a:b], pos, pos, scale)[0])
    return torch.cat(outs, dim=0)


class Attention(nn.Module):
    """Qwen3 self-attention: projections under `recipe`, q/k RMSNorm per head, RoPE, causal GQA."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, eps: float, recipe):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = Linear(hidden_size, num_heads * head_dim, recipe=recipe)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, recipe=recipe)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, recipe=recipe)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, recipe=recipe)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x `[..., T, H]`, positions `[..., T]` -> q `[..., T, Hq, D]`, k and v `[..., T, Hkv, D]`;
        q and k are normed per head and rotated."""
        lead = x.shape[:-1]
        q = self.q_norm(self.q_proj(x).view(*lead, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
        """x `[B, T, H]`, positions `[B, T]` -> `[B, T, H]`; with `cu_seqlens`, B must be 1 (packed)."""
        q, k, v = self.project_qkv(x, positions)
        if cu_seqlens is None:
            out = attention(q, k, v, positions, positions)  # [B, T, Hq, D]
        else:
            out = varlen_attention(q[0], k[0], v[0], positions[0], cu_seqlens)[None]
        return self.o_proj(out.flatten(-2))
