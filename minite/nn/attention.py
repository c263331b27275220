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

On CUDA (with Triton, and `use_kernel(True)`, the default) the layer runs the paged attention kernel
(`minite.kernels.attention`, math in `minite.ref.attention`) instead, over its packed k/v: the same
kernel and launch configuration the sampler runs on its KV cache, so a token's attention output is
the same bits in the learner's full-sequence forward as in the sampler's decode step. The kernel
reads key slot j of a sequence as position j, so it is taken only when the positions are 0, 1, ...
within each sequence (the models' default); its backward recomputes through the reference math.
The CPU always runs the reference functions above.
"""

from __future__ import annotations

import torch
from torch import nn

from minite.nn.linear import Linear
from minite.nn.norm import RMSNorm
from minite.nn.rope import apply_rope, rope_cos_sin

_USE_KERNEL = True


def use_kernel(enabled: bool) -> bool:
    """Switch the CUDA attention kernel on or off (for tests and benchmarks); -> the previous setting."""
    global _USE_KERNEL
    previous, _USE_KERNEL = _USE_KERNEL, bool(enabled)
    return previous


def kernel_enabled(device: torch.device) -> bool:
    """Whether attention on `device` runs the Triton kernel: CUDA, Triton importable, switched on."""
    if not _USE_KERNEL or device.type != "cuda":
        return False
    from minite.kernels import available

    return available()


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


VARLEN_SCORE_BUDGET = 1 << 28  # fp32 score elements (1 GiB) one padded varlen_attention call may use


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal GQA over packed sequences: q `[N, Hq, D]`, k/v `[N, Hkv, D]`, positions `[N]`,
    cu_seqlens `[S + 1]` (sequence s is rows `cu_seqlens[s]:cu_seqlens[s + 1]`) -> `[N, Hq, D]`.

    Sequences of similar length are scattered into right-padded `[S_g, T_g]` groups (padding keys get
    position -1: invisible), one `attention` call per group, each group's padded scores within
    `VARLEN_SCORE_BUDGET` (a single sequence may exceed it alone)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the packed length {q.shape[0]}")
    spans = sorted(((b - a, a) for a, b in zip(bounds, bounds[1:]) if b > a), reverse=True)
    out = q.new_empty(q.shape)
    i = 0
    while i < len(spans):
        T = spans[i][0]
        S = max(1, min(len(spans) - i, VARLEN_SCORE_BUDGET // (T * T * q.shape[1])))
        group = spans[i: i + S]
        rows = torch.tensor([a + t for n, a in group for t in range(n)], device=q.device)
        idx = torch.tensor([s * T + t for s, (n, _) in enumerate(group) for t in range(n)], device=q.device)

        def padded(x: torch.Tensor, fill, rows=rows, idx=idx, S=S, T=T) -> torch.Tensor:
            buf = x.new_full((S * T, *x.shape[1:]), fill)
            return buf.index_copy(0, idx, x[rows]).view(S, T, *x.shape[1:])

        pos = padded(positions, -1)  # [S, T]
        o = attention(padded(q, 0), padded(k, 0), padded(v, 0), pos, pos, scale)  # [S, T, Hq, D]
        out = out.index_copy(0, rows, o.reshape(S * T, *q.shape[1:])[idx])
        i += S
    return out


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
        B, T = x.shape[:2]
        if kernel_enabled(x.device) and _kernel_shapes_ok(q):
            cu = cu_seqlens if cu_seqlens is not None else torch.arange(0, B * T + 1, T, device=x.device)
            out = packed_kernel_attention(q.reshape(B * T, *q.shape[2:]), k.reshape(B * T, *k.shape[2:]),
                                          v.reshape(B * T, *v.shape[2:]), positions.reshape(B * T), cu)
            if out is not None:
                return self.o_proj(out.view(B, T, -1))
        if cu_seqlens is None:
            out = attention(q, k, v, positions, positions)  # [B, T, Hq, D]
        else:
            out = varlen_attention(q[0], k[0], v[0], positions[0], cu_seqlens)[None]
        return self.o_proj(out.flatten(-2))


def _kernel_shapes_ok(q: torch.Tensor) -> bool:
    D = q.shape[-1]
    return q.dtype in (torch.bfloat16, torch.float16, torch.float32) and D >= 16 and D & (D - 1) == 0


def packed_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """`varlen_attention` by the kernel: q `[N, Hq, D]`, k/v `[N, Hkv, D]`, positions `[N]`,
    cu_seqlens `[S + 1]` -> `[N, Hq, D]`; None when the positions are not 0, 1, ... per sequence
    (the kernel's layout), so the caller runs the reference instead."""
    N = q.shape[0]
    cu = cu_seqlens.to(q.device, torch.int64)
    lengths = cu[1:] - cu[:-1]  # [S]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=q.device), lengths, output_size=N)
    positions = positions.to(torch.int64).contiguous()
    if not torch.equal(positions, torch.arange(N, device=q.device) - cu[:-1][seq]):
        return None
    return _KernelAttention.apply(q, k, v, seq, positions, cu)


class _KernelAttention(torch.autograd.Function):
    """Forward: the kernel over contiguous packed k/v. Backward: the reference math (`varlen_attention`,
    fp32, padded groups of sequences) recomputed under autograd: the exact softmax attention's gradient."""

    @staticmethod
    def forward(ctx, q, k, v, seq, positions, cu):
        from minite.kernels.attention import contiguous_attention

        ctx.save_for_backward(q, k, v, positions, cu)
        return contiguous_attention(q, k, v, seq, positions, cu[:-1], cu[1:] - cu[:-1])

    @staticmethod
    def backward(ctx, grad):
        q, k, v, positions, cu = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = varlen_attention(*inputs, positions, cu)
            dq, dk, dv = torch.autograd.grad(out, inputs, grad)
        return dq, dk, dv, None, None, None
