"""CUDA graphs of the decode step (one new token per sequence), captured lazily per padded shape.

A graph captures `runner.cached_forward` on static buffers: the step's context (positions, slots,
the paged attention backend and its query tiles) is made inside the capture from those buffers, so a
replay recomputes it for the batch copied in, and the model's own forward runs under it.

A graph is keyed on (rows, width): the batch padded up to a bucket of `ROW_BUCKETS` (then multiples
of 16) and the block tables padded to a power-of-two number of blocks. Inputs live in static buffers
sized for the largest shape; a replay copies the step's batch into them. Padding rows write only
the scratch block and see no key. Graphs hold the addresses of the weights (and of the quantized
weights they were captured with): `Sampler` drops them when the model's parameters change.
"""

from __future__ import annotations

import torch

from minite.sampler.kv_cache import KVCache
from minite.sampler.runner import CachedBatch, build_batch, build_decode_batch, cached_forward

ROW_BUCKETS = (1, 2, 4, 8, 16)


def bucket_rows(n: int) -> int:
    for b in ROW_BUCKETS:
        if n <= b:
            return b
    return -(-n // 16) * 16


def bucket_width(w: int) -> int:
    return 1 << max(0, (w - 1).bit_length())


class DecodeGraphs:
    def __init__(self, model, cache: KVCache, max_rows: int, max_width: int):
        self.model, self.cache = model, cache
        self.max_rows, self.max_width = bucket_rows(max_rows), bucket_width(max_width)
        scratch = [[0]] * self.max_rows
        self.static = build_batch(scratch, [0] * self.max_rows, [[cache.scratch_block]] * self.max_rows,
                                  cache.block_size, cache.scratch_block, cache.device,
                                  width=self.max_width)
        self._reset_static()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, CachedBatch, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def fits(self, rows: int, width: int) -> bool:
        return rows <= self.max_rows and width <= self.max_width

    def _view(self, rows: int, width: int) -> CachedBatch:
        s = self.static
        return CachedBatch(s.input_ids[:rows], s.positions[:rows], s.slots[:rows],
                           s.block_tables[:rows, :width], s.context_lens[:rows], s.query_rows[:rows],
                           s.query_pos[:rows], s.unpad[:rows], s.last[:rows])

    def _reset_static(self) -> None:
        """Inputs that touch only the scratch block (the warm-up run before a capture executes)."""
        s = self.static
        s.input_ids.zero_()
        s.positions.zero_()
        s.slots.fill_(self.cache.scratch_block * self.cache.block_size)
        s.block_tables.fill_(self.cache.scratch_block)
        s.context_lens.zero_()
        s.query_pos.fill_(-1)

    def _capture(self, rows: int, width: int):
        self._reset_static()
        batch = self._view(rows, width)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cached_forward(self.model, self.cache, batch)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = cached_forward(self.model, self.cache, batch)
        self.graphs[(rows, width)] = (graph, batch, logits)

    def run(self, token_lists: list[list[int]], block_tables: list[list[int]],
            ids: torch.Tensor | None = None) -> torch.Tensor:
        """Decode the last token of each sequence -> logits `[B, V]` (a view of the graph's output);
        `ids` (device, `[rows]`) replaces the last tokens (lookahead decode)."""
        B = len(token_lists)
        rows, width = bucket_rows(B), bucket_width(max(len(t) for t in block_tables))
        if (rows, width) not in self.graphs:
            self._capture(rows, width)
        graph, static, logits = self.graphs[(rows, width)]
        batch = build_decode_batch(token_lists, block_tables, self.cache.block_size, self.cache.scratch_block,
                                   self.cache.device, width=width, rows=rows)
        if ids is not None:
            batch.input_ids = ids
        for name in ("input_ids", "positions", "slots", "block_tables", "context_lens", "query_pos"):
            getattr(static, name).copy_(getattr(batch, name))
        graph.replay()
        return logits[:B]
