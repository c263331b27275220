"""The MoE assignments sorted by expert as a counting sort in two launches: exactly
`minite.ref.moe_sort.sort_by_expert`'s tensors (a stable sort is unique).

torch runs it as a radix argsort, a scatter-add of the counts, a cumsum, the inverse scatter and three
gathers: about a dozen launches a MoE layer, the radix sort alone ~9 us at a decode step's 256
assignments (H200, a profiled 48-layer step at 86be0ba; this kernel took ~1 ms off that step in both
recipes, `benchmarks/results/h200/moe_sort_ab_moe_*.json`). Here the assignments are cut into chunks
of CHUNK:

1. `_count_kernel`, one program per chunk: its count per expert (a one-hot sum) into counts [C, E].
2. `_place_kernel`, one program per chunk: reads all chunks' counts (COUNT_BLOCK chunks at a time),
   so each expert's start (the offsets) and the assignments of that expert in earlier chunks are
   known; an assignment's sorted position is its expert's start, plus that expert's count in earlier
   chunks, plus its rank among the chunk's earlier assignments of that expert (counted pairwise, a
   [CHUNK, CHUNK] comparison: 6.4 us at 256 assignments against 9.7 us for a running sum of the
   one-hot, the same integers; `benchmarks/results/h200/probe_moe_sort.json`, e43d6cf). It writes
   tokens, experts and inverse at those positions, and program 0 the offsets.

Where the router runs as one kernel it can count its picks per chunk in its launch (`router_chunk`,
`minite.kernels.router.route(chunk=)`); the sort then starts at step 2, one launch.

Serves up to MAX_CHUNKS * CHUNK assignments and MAX_EXPERTS experts: a decode step, and a rollout's
prefill up to 4096 tokens at top-8 (each chunk's program reads every chunk's counts, so the reads grow
with the square of the chunks); `minite.nn.moe` runs the reference beyond (the same integers).
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel

CHUNK = 128
MAX_CHUNKS = 256  # 32768 assignments: 4096 tokens at top-8
COUNT_BLOCK = 64  # chunks' counts a program holds at once
MAX_EXPERTS = 256


@triton.jit
def _one_hot(ids_ptr, c, R, CHUNK: tl.constexpr, E_P2: tl.constexpr):
    offs = c * CHUNK + tl.arange(0, CHUNK)
    mask = offs < R
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    hot = (ids[:, None] == tl.arange(0, E_P2)[None, :]) & mask[:, None]
    return offs, mask, ids, hot.to(tl.int32)  # [CHUNK, E_P2]


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, R, CHUNK: tl.constexpr, E_P2: tl.constexpr):
    c = tl.program_id(0)
    _, _, _, hot = _one_hot(ids_ptr, c, R, CHUNK, E_P2)
    tl.store(counts_ptr + c * E_P2 + tl.arange(0, E_P2), tl.sum(hot, axis=0))


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, tokens_ptr, experts_ptr, offsets_ptr, inverse_ptr, R, C, E,
                  K: tl.constexpr, CHUNK: tl.constexpr, E_P2: tl.constexpr, CB: tl.constexpr):
    c = tl.program_id(0)
    cols = tl.arange(0, E_P2)
    totals = tl.zeros((E_P2,), dtype=tl.int32)  # per expert, over all chunks
    before = tl.zeros((E_P2,), dtype=tl.int32)  # in chunks before this one
    for c0 in range(0, C, CB):  # the counts in blocks of CB chunks
        chunks = c0 + tl.arange(0, CB)
        counts = tl.load(counts_ptr + chunks[:, None] * E_P2 + cols[None, :], mask=(chunks < C)[:, None],
                         other=0)
        totals += tl.sum(counts, axis=0)
        before += tl.sum(tl.where((chunks < c)[:, None], counts, 0), axis=0)
    starts = tl.cumsum(totals, axis=0) - totals  # each expert's first sorted row
    if c == 0:
        tl.store(offsets_ptr, 0)
        tl.store(offsets_ptr + 1 + cols, (starts + totals).to(tl.int64), mask=cols < E)
    offs, mask, ids, hot = _one_hot(ids_ptr, c, R, CHUNK, E_P2)
    i = tl.arange(0, CHUNK)  # the chunk's earlier assignments of the same expert
    same = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None]) & mask[None, :]
    rank = tl.sum(same.to(tl.int32), axis=1)
    base = tl.sum(hot * (starts + before)[None, :], axis=1)
    pos = (base + rank).to(tl.int64)
    tl.store(inverse_ptr + offs, pos, mask=mask)
    tl.store(tokens_ptr + pos, (offs // K).to(tl.int64), mask=mask)
    tl.store(experts_ptr + pos, ids.to(tl.int64), mask=mask)


def serves(assignments: int, num_experts: int) -> bool:
    """Whether `sort_by_expert` takes this many assignments and experts."""
    return 0 < assignments <= MAX_CHUNKS * CHUNK and num_experts <= MAX_EXPERTS


def router_chunk(top_k: int, assignments: int, num_experts: int) -> int | None:
    """The chunk the router's kernel counts in for this sort (step 1 in its launch), or None where
    the sort counts itself: top-k divides CHUNK into a power of two of at most 32 tokens a program,
    and the router's expert columns are the sort's (at least 16 experts)."""
    tokens = CHUNK // top_k
    if not serves(assignments, num_experts) or CHUNK % top_k or tokens > 32 or \
            tokens != next_power_of_2(tokens) or next_power_of_2(num_experts) < 16:
        return None
    return CHUNK


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, counts: torch.Tensor | None = None):
    """topk_ids [T, k] int (ids below num_experts) -> (tokens, experts, offsets, inverse): the
    reference's tensors (module docstring), in two launches, no host sync. `counts`: the router's
    per-chunk counts (`router_chunk`), then one launch."""
    return _sort(topk_ids, num_experts, CHUNK, counts)


def _sort(topk_ids: torch.Tensor, num_experts: int, chunk: int, counts: torch.Tensor | None = None):
    if topk_ids.ndim != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_ids.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {topk_ids.device}")
    flat = topk_ids.reshape(-1).contiguous()
    r = flat.numel()
    if not serves(r, num_experts):
        raise ValueError(f"sort_by_expert serves 1 to {MAX_CHUNKS * CHUNK} assignments and at most "
                         f"{MAX_EXPERTS} experts; got {r} and {num_experts}")
    chunks, e_p2 = cdiv(r, chunk), max(16, next_power_of_2(num_experts))
    if counts is not None and (counts.shape != (chunks, e_p2) or counts.dtype != torch.int32):
        raise ValueError(f"counts must be int32 [{chunks}, {e_p2}] (chunks of {chunk}), got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    tokens, experts, inverse = (torch.empty(r, dtype=torch.int64, device=flat.device) for _ in range(3))
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
    warps = 4 if e_p2 <= 128 else 8
    if counts is None:
        counts = torch.empty(chunks, e_p2, dtype=torch.int32, device=flat.device)
        launch_kernel(_count_kernel, (chunks,), (flat, counts, r), CHUNK=chunk, E_P2=e_p2, num_warps=warps)
    block = min(COUNT_BLOCK, max(2, next_power_of_2(chunks)))
    launch_kernel(_place_kernel, (chunks,), (flat, counts, tokens, experts, offsets, inverse, r, chunks,
                                             num_experts),
                  K=topk_ids.shape[1], CHUNK=chunk, E_P2=e_p2, CB=block, num_warps=warps)
    return tokens, experts, offsets, inverse
