"""Causal grouped-query attention with Qwen3's per-head q/k RMSNorm.

Math (`attention`): for query i and key j of the same sequence, key j is visible iff
`0 <= k_pos[j] <= q_pos[i]`; `p = softmax_j(q_i . k_j * scale)` over visible keys (fp32 scores and
softmax), `out_i = sum_j p_ij v_j`, cast back to the query dtype. Each group of
`num_heads // num_kv_heads` query heads shares one key/value head. Visibility is decided by
positions alone, so keys read from a cache and keys computed in this call are treated alike; a
negative key position marks an empty (padding) slot. A query that sees no key gets a zero output.
Packed variable-length input (`cu_seqlens`) runs `attention` per group of sequences
(`varlen_attention`).

`Attention` is the layer: the q|k|v projection (one recipe-driven `SegmentedLinear`), RMSNorm of each q
and k head, RoPE, then, per the forward's context (`minite.nn.context`), the KV cache write (a cached
step's new keys join the cache before any query reads it) and the context's attention backend
(`minite.nn.attention_backends`), then the output projection.

Where the execution runs the attention kernel (`Execution.attention`: on CUDA by default) the backends
run the paged attention kernel (`minite.kernels.attention`, math in `minite.ref.attention`): the same kernel
and launch configuration over the learner's packed k/v (`KernelAttention`, `PackedLayout`) as over
the sampler's KV cache, so a token's attention output is the same bits in the learner's
full-sequence forward as in the sampler's decode step. The kernel reads key slot j of a sequence as
position j, so it is taken only when the positions are 0, 1, ... within each sequence (the models'
default); its backward is the Triton backward (`minite.kernels.attention_backward`), or, with
`Execution.attention_backward = "reference"`, the reference math recomputed under autograd. The CPU
runs the reference functions above (the kernel only under the interpreter, `attention = "triton"`).

A quantized KV format (`Recipe.kv_cache`, `minite.nn.kv_quant`): the learner's k and v, after RoPE,
go through the sampler's quantizer; the kernel reads the quantized form (the sampler's bits), the
reference reads its dequantized values, and the backward runs on the dequantized values the forward
used, its k and v gradients passed straight through the quantization.
"""

from __future__ import annotations

import torch
from torch import nn

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn.kv_quant import quantize_kv
from minite.nn.linear import Linear, SegmentedLinear
from minite.nn.norm import RMSNorm
from minite.nn.qk_norm_rope import qk_norm_rope
from minite.nn.rope import rope_cos_sin


def kernel_applies(q: torch.Tensor, execution: Execution = DEFAULT) -> bool:
    """Whether the kernel runs attention for queries `q [..., D]`: `execution` runs it on q's device,
    a 16- or 32-bit dtype and a power-of-two head dimension of at least 16."""
    D = q.shape[-1]
    return (execution.attention_kernel(q.device) and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and D >= 16 and D & (D - 1) == 0)


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


def varlen_plan(bounds: list[int], n: int, num_heads: int, device) -> list[tuple]:
    """`varlen_attention`'s padded groups for sequence bounds `bounds` (cu_seqlens on the host) over
    `n` packed rows: [(S, T, rows [S_real], idx [S_real])], host work only plus two small copies per
    group; build it once per forward and hand it to every layer."""
    if bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} must rise from 0 to the packed length {n}")
    spans = sorted(((b - a, a) for a, b in zip(bounds, bounds[1:]) if b > a), reverse=True)
    groups, i = [], 0
    while i < len(spans):
        T = spans[i][0]
        S = max(1, min(len(spans) - i, VARLEN_SCORE_BUDGET // (T * T * num_heads)))
        group = spans[i: i + S]
        rows = torch.tensor([a + t for n_, a in group for t in range(n_)], device=device)
        idx = torch.tensor([s * T + t for s, (n_, _) in enumerate(group) for t in range(n_)], device=device)
        groups.append((S, T, rows, idx))
        i += S
    return groups


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float | None = None,
                     plan: list | None = None) -> torch.Tensor:
    """Causal GQA over packed sequences: q `[N, Hq, D]`, k/v `[N, Hkv, D]`, positions `[N]`,
    cu_seqlens `[S + 1]` (sequence s is rows `cu_seqlens[s]:cu_seqlens[s + 1]`) -> `[N, Hq, D]`.

    Sequences of similar length are scattered into right-padded `[S_g, T_g]` groups (padding keys get
    position -1: invisible), one `attention` call per group, each group's padded scores within
    `VARLEN_SCORE_BUDGET` (a single sequence may exceed it alone). `plan`: `varlen_plan`'s groups,
    made here from cu_seqlens (a host sync) when not given."""
    if plan is None:
        plan = varlen_plan(cu_seqlens.tolist(), q.shape[0], q.shape[1], q.device)
    out = q.new_empty(q.shape)
    for S, T, rows, idx in plan:
        def padded(x: torch.Tensor, fill, rows=rows, idx=idx, S=S, T=T) -> torch.Tensor:
            buf = x.new_full((S * T, *x.shape[1:]), fill)
            return buf.index_copy(0, idx, x[rows]).view(S, T, *x.shape[1:])

        pos = padded(positions, -1)  # [S, T]
        o = attention(padded(q, 0), padded(k, 0), padded(v, 0), pos, pos, scale)  # [S, T, Hq, D]
        out = out.index_copy(0, rows, o.reshape(S * T, *q.shape[1:])[idx])
    return out


class PackedLayout:
    """Packed sequences as every layer's attention sees them in one forward: flat positions [N], cu
    [S + 1] int64, the sequences' `lengths` [S], each row's sequence `seq` [N], whether positions run
    0, 1, ... per sequence (the kernel's layout; one host sync), and, made on first use and then
    shared, the kernel's query tiles and the reference backward's `varlen_plan` (from the bounds,
    read at construction when grad is enabled so that the backward never waits on the host).
    `kernel_backward`: the kernel's backward is the Triton one (else the reference math)."""

    def __init__(self, positions: torch.Tensor, cu: torch.Tensor, kernel_ok: bool | None = None,
                 kernel_backward: bool = True):
        n, dev = positions.numel(), positions.device
        self.positions = positions.reshape(n).to(torch.int64).contiguous()
        self.cu = cu.to(dev, torch.int64)
        self.lengths = lengths = self.cu[1:] - self.cu[:-1]  # [S], made once for every layer's kernels
        self.seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths, output_size=n)
        if kernel_ok is None:  # unless the caller made the positions that way (`sequence_context`)
            kernel_ok = torch.equal(self.positions, torch.arange(n, device=dev) - self.cu[:-1][self.seq])
        self.kernel_ok, self.kernel_backward = kernel_ok, kernel_backward
        self._tiles: dict[tuple, torch.Tensor] = {}
        self._plans: dict[int, list] = {}
        # the reference backward will need the bounds: read them now, beside the sync above, not
        # mid-backward (the kernel backward needs none)
        self._bounds = self.cu.tolist() if torch.is_grad_enabled() and not kernel_backward else None

    def tiles(self, group: int, block_m: int | None = None) -> torch.Tensor:
        """The kernels' query tiles of `group` heads (`plan_tiles`; block_m None: the forward's)."""
        from minite.kernels.attention import plan_tiles

        key = (group, block_m)
        if key not in self._tiles:
            self._tiles[key] = plan_tiles(self.seq, self.cu.numel() - 1, group, block_m)
        return self._tiles[key]

    def plan(self, num_heads: int) -> list:
        if num_heads not in self._plans:
            if self._bounds is None:
                self._bounds = self.cu.tolist()
            self._plans[num_heads] = varlen_plan(self._bounds, self.positions.numel(), num_heads,
                                                 self.positions.device)
        return self._plans[num_heads]


class Attention(nn.Module):
    """Qwen3 self-attention: projections under `recipe`, q/k RMSNorm per head, RoPE, causal GQA over
    the keys the forward's context gives (`minite.nn.context`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float, eps: float, recipe, layer_index: int = 0):
        super().__init__()
        self.layer_index = layer_index  # which layer of the KV cache this layer reads and writes
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        kv = num_kv_heads * head_dim
        self.qkv_proj = SegmentedLinear(hidden_size, (num_heads * head_dim, kv, kv), recipe=recipe)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, recipe=recipe)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor, quantized=None, store=None):
        """x `[..., T, H]` (`quantized`: its quantization, handed over by the norm before), positions
        `[..., T]` -> q `[..., T, Hq, D]`, k and v `[..., T, Hkv, D]`; q and k are normed per head and
        rotated (`minite.nn.qk_norm_rope`; `store` (k_rows, v_rows, slots): k and v also written there)."""
        lead = x.shape[:-1]
        q, k, v = self.qkv_proj(x, quantized)
        execution = self.qkv_proj.recipe.execution
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta, q.dtype)
        q, k = qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                            execution, store=None if store is None else (v, *store))
        return q, k, v

    def forward(self, x: torch.Tensor, context, quantized=None) -> torch.Tensor:
        """x `[..., T, H]` -> `[..., T, H]` under the forward's `minite.nn.context.ForwardContext`
        (positions `[..., T]`; not imported here: the context's backends import this module). A cached
        step's new keys join the cache before any query reads it (written, or quantized, in the norm and
        rotation's launch): fresh and cached keys alike."""
        cache = context.kv_cache
        store = None if cache is None else (*cache.rows(self.layer_index), context.slots)
        q, k, v = self.project_qkv(x, context.positions, quantized, store)
        return self.o_proj(context.attention(self.layer_index, q, k, v))


def packed_kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cu_seqlens: torch.Tensor, execution: Execution = DEFAULT) -> torch.Tensor | None:
    """`varlen_attention` by the kernel: q `[N, Hq, D]`, k/v `[N, Hkv, D]`, positions `[N]`,
    cu_seqlens `[S + 1]` -> `[N, Hq, D]`; None when the positions are not 0, 1, ... per sequence
    (the kernel's layout), so the caller runs the reference instead."""
    layout = PackedLayout(positions, cu_seqlens, kernel_backward=execution.attention_backward == "kernel")
    return KernelAttention.apply(q, k, v, layout) if layout.kernel_ok else None


class KernelAttention(torch.autograd.Function):
    """Forward: the kernel over contiguous packed k/v (with each row's log-sum-exp when a gradient is
    needed). Backward: the Triton backward (`minite.kernels.attention_backward`), or where the layout
    says so (`Execution.attention_backward = "reference"`) the reference math (`varlen_attention`, fp32,
    padded groups of sequences) recomputed under autograd. The layout (tiles, backward plan) is shared
    by every layer. `kv_format` fp8 / nvfp4: k and v quantized first (`execution` picks the
    quantizer), the backward on their dequantized values, straight through to k and v."""

    @staticmethod
    def forward(ctx, q, k, v, layout: PackedLayout, kv_format: str = "bf16", execution: Execution = DEFAULT):
        cu = layout.cu
        ctx.layout = layout
        ctx.kernel_backward = layout.kernel_backward and any(ctx.needs_input_grad)
        lse = q.new_empty(q.shape[:2], dtype=torch.float32) if ctx.kernel_backward else None
        tiles = layout.tiles(q.shape[1] // k.shape[1])
        kq, vq = k, v
        if kv_format != "bf16":
            kq, vq = quantize_kv(k, kv_format, execution), quantize_kv(v, kv_format, execution)
            if any(ctx.needs_input_grad):
                k, v = kq.dequantize(k.dtype), vq.dequantize(v.dtype)
        out = lazy.attention.contiguous_attention(q, kq, vq, layout.seq, layout.positions, cu[:-1],
                                                  layout.lengths, tiles=tiles, lse=lse)
        if ctx.kernel_backward:
            ctx.save_for_backward(q, k, v, out, lse)
        else:
            ctx.save_for_backward(q, k, v)
        return out

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        if ctx.kernel_backward:
            from minite.kernels.attention_backward import config, contiguous_attention_backward

            q, k, v, out, lse = ctx.saved_tensors
            cfg, group, cu = config(q.dtype), q.shape[1] // k.shape[1], layout.cu
            dq, dk, dv = contiguous_attention_backward(
                grad, q, k, v, out, lse, layout.seq, layout.positions, cu[:-1], layout.lengths,
                q_tiles=layout.tiles(group, cfg["dq"]["BLOCK_M"]),
                k_tiles=layout.tiles(1, cfg["dkdv"]["BLOCK_N"]))
            return dq, dk, dv, None, None, None
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            out = varlen_attention(*inputs, layout.positions, layout.cu, plan=layout.plan(q.shape[1]))
            dq, dk, dv = torch.autograd.grad(out, inputs, grad)
        return dq, dk, dv, None, None, None
