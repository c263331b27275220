"""Attention backends: how one forward's attention layers read their keys (`ForwardContext.attention`).

A backend is made once per forward with the step's layout and called by every attention layer as
`backend(layer, q, k, v)` -> o_proj's input with the heads flattened. All of them compute the math of
`minite.nn.attention.attention` (visibility by positions alone, so cached and fresh keys are treated
alike); the kernel ones run the same kernel and launch configuration (`minite.kernels.attention`),
which is what makes a token's attention output the same bits in the learner's full-sequence forward
and in the sampler's decode step.

- `SequenceAttention`: full sequences, the keys computed in this forward. The packed kernel on CUDA
  where the execution runs it and the positions are 0, 1, ... per sequence
  (`minite.nn.attention.kernel_applies`), else the
  reference (`attention` on padded rows, `varlen_attention` on packed ones).
- `PagedKernelAttention`: a cached step on CUDA: the new tokens' queries over their sequences' keys,
  read in place from the cache blocks (prefill and decode alike).
- `PagedReferenceAttention`: a cached step on the CPU: the queries padded to `[B, Tq]` (pad queries
  at position -1) over the keys gathered from the cache in position order.
- `PagedSDPAAttention`: the same layout through torch's `scaled_dot_product_attention` (its fused
  kernels on CUDA, chosen by shape) where the recipe's execution says `attention = "sdpa"`: a serving
  engine's arithmetic, not the learner's bits.

A quantized KV format (`Recipe.kv_cache`): `SequenceAttention` quantizes k and v as the sampler's
cache does (`minite.nn.kv_quant`; the kernel reads the quantized form, the reference the dequantized
values, gradients straight through); the paged backends read the cache's quantized blocks (the
kernel in place, the reference and SDPA dequantizing what they gather).

None of them synchronizes with the host per layer (the decode step is captured in CUDA graphs).
"""

from __future__ import annotations

import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn.attention import KernelAttention, PackedLayout, attention, kernel_applies, varlen_attention
from minite.nn.kv_quant import fake_quantize_kv


class SequenceAttention:
    """Attention among the tokens of this forward: q/k/v `[B, T, H, D]` (one packed row when
    `cu_seqlens` is given). The packed kernel's layout is made once and shared by every layer and
    recompute: at construction when `kernel_layout` says the positions are the kernel's (no check),
    otherwise on the first kernel call (one host sync to check the positions). `execution` picks
    the kernel or the reference, and the kernel's backward; `kv_format` how k and v are stored."""

    def __init__(self, positions: torch.Tensor, cu_seqlens: torch.Tensor | None, kernel_layout: bool = False,
                 execution: Execution = DEFAULT, kv_format: str = "bf16"):
        self.positions, self.cu_seqlens = positions, cu_seqlens  # [B, T], [S + 1] or None
        self.execution, self.kv_format = execution, kv_format
        self._kernel_backward = execution.attention_backward == "kernel"
        self._layout = None
        if kernel_layout:
            self._layout = PackedLayout(positions, cu_seqlens, True, self._kernel_backward)

    def layout(self, B: int, T: int) -> PackedLayout:
        if self._layout is None:
            cu = self.cu_seqlens
            if cu is None:
                cu = torch.arange(0, B * T + 1, T, device=self.positions.device)
            self._layout = PackedLayout(self.positions, cu, None, self._kernel_backward)
        return self._layout

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, T = q.shape[:2]
        if kernel_applies(q, self.execution):
            layout = self.layout(B, T)
            if layout.kernel_ok:
                flat = [t.reshape(B * T, *t.shape[2:]) for t in (q, k, v)]
                return KernelAttention.apply(*flat, layout, self.kv_format, self.execution).view(B, T, -1)
        k, v = fake_quantize_kv(k, self.kv_format, self.execution), fake_quantize_kv(v, self.kv_format,
                                                                                    self.execution)
        positions = self.positions
        if self.cu_seqlens is None:
            out = attention(q, k, v, positions, positions)  # [B, T, Hq, D]
        else:
            out = varlen_attention(q[0], k[0], v[0], positions[0], self.cu_seqlens)[None]
        return out.flatten(-2)


class PagedKernelAttention:
    """The paged kernel over `cache` (`minite.sampler.kv_cache.KVCache`) for N new tokens: q `[N, Hq, D]`
    -> `[N, Hq * D]`. query_seq `[N]` is each token's row of the block tables `[B, W]`, context_lens
    `[B]` the cached positions after this step; the query tiles are planned once for every layer."""

    def __init__(self, cache, query_seq: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, group: int):
        self.cache, self.query_seq, self.positions = cache, query_seq, positions
        self.block_tables, self.context_lens = block_tables, context_lens
        self.tiles = lazy.attention.plan_tiles(query_seq, block_tables.shape[0], group)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return lazy.attention.paged_attention(q, self.cache.k[layer], self.cache.v[layer], self.query_seq,
                                              self.positions, self.block_tables, self.context_lens,
                                              tiles=self.tiles).flatten(1)


class PagedReferenceAttention:
    """The reference over `cache` for N new tokens: q `[N, Hq, D]` -> `[N, Hq * D]`, gathered into
    `[B, Tq]` by query_rows (query_pos -1 for padding), keys of the block tables `[B, W]` gathered in
    position order (the slots past context_lens `[B]` get position -1: empty), back to N by unpad."""

    def __init__(self, cache, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 query_rows: torch.Tensor, query_pos: torch.Tensor, unpad: torch.Tensor):
        self.cache, self.block_tables = cache, block_tables
        self.query_rows, self.query_pos, self.unpad = query_rows, query_pos, unpad
        B = query_pos.shape[0]
        Tk = block_tables.shape[1] * cache.block_size
        key_pos = torch.arange(Tk, device=query_pos.device).expand(B, Tk)
        self.key_pos = torch.where(key_pos < context_lens[:, None], key_pos, -1)  # [B, Tk]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, Tq = self.query_pos.shape
        keys, values = self.cache.gather(layer, self.block_tables)  # [B, Tk, Hkv, D]
        out = attention(q[self.query_rows], keys, values, self.query_pos, self.key_pos)
        return out.reshape(B * Tq, -1)[self.unpad]  # [N, Hq * D]


class PagedSDPAAttention(PagedReferenceAttention):
    """`PagedReferenceAttention`'s gather through torch SDPA: a boolean mask of the visible keys
    (key position <= query position; a padding query sees key 0 so that no row is empty), bf16 in,
    the kernel's own accumulation and reduction order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        visible = (self.key_pos[:, None, :] <= self.query_pos[:, :, None]) & (self.key_pos[:, None, :] >= 0)
        first = torch.zeros_like(visible)
        first[..., 0] = True
        self.mask = torch.where((self.query_pos < 0)[:, :, None], first, visible)[:, None]  # [B, 1, Tq, Tk]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, Tq = self.query_pos.shape
        keys, values = self.cache.gather(layer, self.block_tables)  # [B, Tk, Hkv, D]
        qb = q[self.query_rows].transpose(1, 2)  # [B, Hq, Tq, D]
        out = torch.nn.functional.scaled_dot_product_attention(
            qb, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=self.mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(B * Tq, -1)[self.unpad]  # [N, Hq * D]
