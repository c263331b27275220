"""A sampler step as a model forward: the new tokens of every sequence, their keys and values in the
paged KV cache.

`cached_forward` runs the model's own `forward` (the very modules and quantized weights the learner's
full-sequence forward runs) under the step's context (`cached_context`): the new tokens flattened to
`[N]` without padding for the token-wise ops (projections, norms, MLP), each layer storing its new k
and v in the cache before attending, every query then attending over its sequence's cached keys in
position order (fresh and cached keys are treated alike; the only difference from a full forward is
trailing empty key slots), and only each sequence's last token going through the final norm and the
LM head.

The attention backend (`minite.nn.attention_backends`): where the model's execution runs the attention
kernel (on CUDA by default, `Execution.attention`): the paged kernel reads the keys in place from the
cache blocks, for prefill and decode alike (the same kernel and launch configuration as the learner's
forward, so a token's attention output does not depend on the batch it was computed in); on the CPU the
reference over queries padded to `[B, Tq]` (pad queries have position -1, see `CachedBatch`) and keys
gathered from the cache. Both are free of host syncs (the decode step is captured in CUDA graphs). """

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minite.nn.attention_backends import PagedKernelAttention, PagedReferenceAttention, PagedSDPAAttention
from minite.nn.context import ForwardContext
from minite.sampler.kv_cache import KVCache


@dataclass
class CachedBatch:
    input_ids: torch.Tensor  # [N] int64, the new tokens of all sequences back to back
    positions: torch.Tensor  # [N] int64
    slots: torch.Tensor  # [N] int64, flat cache slot of each new token
    block_tables: torch.Tensor  # [B, W] int64 (padded with the scratch block)
    context_lens: torch.Tensor  # [B] int64, cached positions after this step (0 for a padding row)
    query_rows: torch.Tensor  # [B, Tq] int64 index into N (0 for padding)
    query_pos: torch.Tensor  # [B, Tq] int64 position (-1 for padding)
    unpad: torch.Tensor  # [N] int64 index into B * Tq
    last: torch.Tensor  # [B] int64 index into N of each sequence's last token


def build_batch(token_lists: list[list[int]], starts: list[int], block_tables: list[list[int]],
                block_size: int, scratch_block: int, device, width: int | None = None,
                rows: int | None = None) -> CachedBatch:
    """Batch for computing `tokens[start:]` of each sequence; `width` / `rows` pad the block tables
    and the batch (for CUDA graphs; padding rows compute nothing that is read). Built with numpy
    (a prefill's tokens as arrays, not per-token Python lists), copied without waiting for the GPU."""
    B = len(token_lists)
    rows = B if rows is None else rows
    lens = np.fromiter((len(t) - s for t, s in zip(token_lists, starts)), dtype=np.int64, count=B)
    Tq = int(lens.max()) if B else 1
    width = max(len(b) for b in block_tables) if width is None else width
    n = int(lens.sum())
    seq = np.repeat(np.arange(B), lens)  # [n] the sequence of each new token
    first = np.cumsum(lens) - lens  # [B] each sequence's first new token
    step = np.arange(n) - first[seq]  # [n] its place among the sequence's new tokens
    tables = np.full((rows, width), scratch_block, dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    pos = np.asarray(starts, dtype=np.int64)[seq] + step
    ids = np.zeros(n + rows - B, dtype=np.int64)  # padding rows: one token each, at position 0
    if n:
        ids[:n] = np.concatenate([np.asarray(t[s:], dtype=np.int64) for t, s in zip(token_lists, starts)])
    positions = np.zeros_like(ids)
    positions[:n] = pos
    slots = np.full_like(ids, scratch_block * block_size)  # padding rows write the scratch block
    slots[:n] = tables[seq, pos // block_size] * block_size + pos % block_size
    qrows = np.zeros((rows, Tq), dtype=np.int64)
    qrows[seq, step] = np.arange(n)
    qpos = np.full((rows, Tq), -1, dtype=np.int64)  # padding rows see no key
    qpos[seq, step] = pos
    pad_rows = np.arange(B, rows)
    qrows[pad_rows, 0] = n + pad_rows - B
    unpad = np.concatenate([seq * Tq + step, pad_rows * Tq])
    last = np.concatenate([first + lens - 1, n + pad_rows - B])
    ctx = np.zeros(rows, dtype=np.int64)
    ctx[:B] = np.fromiter(map(len, token_lists), dtype=np.int64, count=B)
    as_t = lambda x: to_device(x, device)
    return CachedBatch(as_t(ids), as_t(positions), as_t(slots), as_t(tables), as_t(ctx), as_t(qrows),
                       as_t(qpos), as_t(unpad), as_t(last))


def to_device(x: np.ndarray, device) -> torch.Tensor:
    """A host array on `device` without waiting for the GPU: a blocking host-to-device copy would
    synchronize the stream, so CUDA copies go through pinned memory, non-blocking."""
    t = torch.from_numpy(np.ascontiguousarray(x))
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def build_decode_batch(token_lists: list[list[int]], block_tables: list[list[int]], block_size: int,
                       scratch_block: int, device, width: int | None = None,
                       rows: int | None = None) -> CachedBatch:
    """`build_batch` for a decode step (one new token per sequence: its last), built with numpy
    instead of per-token Python lists; the same tensors, in a fraction of the host time."""
    B = len(token_lists)
    rows = B if rows is None else rows
    width = max(len(t) for t in block_tables) if width is None else width
    tables = np.full((rows, width), scratch_block, dtype=np.int64)
    for i, table in enumerate(block_tables):
        tables[i, : len(table)] = table
    ctx = np.zeros(rows, dtype=np.int64)
    ctx[:B] = np.fromiter(map(len, token_lists), dtype=np.int64, count=B)
    pos = np.maximum(ctx - 1, 0)  # padding rows: position 0
    ids = np.zeros(rows, dtype=np.int64)
    ids[:B] = np.fromiter((t[-1] for t in token_lists), dtype=np.int64, count=B)
    slots = np.full(rows, scratch_block * block_size, dtype=np.int64)
    slots[:B] = tables[np.arange(B), pos[:B] // block_size] * block_size + pos[:B] % block_size
    qpos = np.where(np.arange(rows) < B, pos, -1)[:, None]
    ar = np.arange(rows, dtype=np.int64)
    as_t = lambda x: to_device(x, device)
    return CachedBatch(as_t(ids), as_t(pos), as_t(slots), as_t(tables), as_t(ctx), as_t(ar[:, None]),
                       as_t(qpos), as_t(ar), as_t(ar))


def cached_context(model, cache: KVCache, batch: CachedBatch) -> ForwardContext:
    """The step's context: positions, the cache and the slots the layers write, the attention backend
    over the cache (as the recipe's execution says), each sequence's last token as the output rows."""
    Tq = batch.query_pos.shape[1]
    if model.recipe.execution.attention == "sdpa":
        attention = PagedSDPAAttention(cache, batch.block_tables, batch.context_lens, batch.query_rows,
                                       batch.query_pos, batch.unpad)
    elif model.recipe.execution.attention_kernel(cache.device):
        query_seq = batch.unpad // Tq  # [N] sequence of each new token
        group = model.config.num_attention_heads // model.config.num_key_value_heads
        attention = PagedKernelAttention(cache, query_seq, batch.positions, batch.block_tables,
                                         batch.context_lens, group)
    else:
        attention = PagedReferenceAttention(cache, batch.block_tables, batch.context_lens, batch.query_rows,
                                            batch.query_pos, batch.unpad)
    return ForwardContext(batch.positions, attention, kv_cache=cache, slots=batch.slots,
                          output_rows=batch.last)


def cached_forward(model, cache: KVCache, batch: CachedBatch) -> torch.Tensor:
    """Run the new tokens through `model`, writing their k/v into `cache`; -> logits `[B, V]` of
    each sequence's last new token, in the model's dtype."""
    return model(batch.input_ids, context=cached_context(model, cache, batch))
