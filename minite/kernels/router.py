"""The MoE router's top-k routing in one launch (`minite.ref.router.route`: same ids, weights to within
the GPU's exp2 approximation).

torch runs it as a softmax, a top-k (a radix select and a bitonic sort), a sum, a division and a cast:
on the H200 ~20 us a layer of a 256-sequence Qwen3-30B-A3B decode step, ~0.9 ms a step over 48 layers
(benchmarks/results/h200/profile_rollout_moe48_aligned_256seqs.json). Here a program holds BLOCK_T
rows of logits in registers and picks the k largest by k arg-max passes (equal logits: the lower
expert), so a row's result never depends on the batch.

With `chunk`, each program also counts its picks per expert: the per-chunk counts the counting sort
(`minite.kernels.moe_sort`) starts from, so the sort needs no counting launch of its own; a program
then holds chunk / k rows, one chunk of the flat assignments. 16-bit logits take one max a pick (a
key of the logit's monotonic bits above the inverted column), fp32 logits a max and a min.

`gate_route` computes the gate's logits in the same launch, in `minite.ref.router.gate_logits`'s
chunk order (the split launch's counters are per device: its launches must not overlap in time, as
on one stream).
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.moe_sort import CHUNK
from minite.ref.router import GATE_CHUNK, LOG2E

CONFIG = dict(BLOCK_T=16, num_warps=4)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _route_rows(v, rows, row_ok, w_ptr, ids_ptr, counts_ptr, block, E, K: tl.constexpr, K_P2: tl.constexpr,
                E_P2: tl.constexpr, NORMALIZE: tl.constexpr, COUNT: tl.constexpr):
    """Top-k of the fp32 logits v [BLOCK_T, E_P2] (columns from E on -inf) and their weights, stored for
    `rows`; with COUNT the block's picks per expert into counts row `block`."""
    cols = tl.arange(0, E_P2)
    slots = tl.arange(0, K_P2)
    top = tl.zeros([v.shape[0], K_P2], dtype=tl.float32)
    ids = tl.zeros([v.shape[0], K_P2], dtype=tl.int64)
    hits = tl.zeros([v.shape[0], E_P2], dtype=tl.int32)  # picks per row and expert (COUNT)
    dt: tl.constexpr = w_ptr.dtype.element_ty  # the logits' dtype
    if dt.primitive_bitwidth == 16:
        # one max a pick: a 16-bit logit's bits made monotonic (+0 for -0, which ties it) above
        # 0xFFFF - its column, so the largest key is the largest logit, equal logits the lower expert
        b = (v + 0.0).to(dt).to(tl.int16, bitcast=True).to(tl.int32)
        rest = (tl.where(b >= 0, b, b ^ 0x7FFF) << 16) | (0xFFFF - cols[None, :])
        for j in tl.static_range(K):
            mk = tl.max(rest, 1)
            pick = tl.minimum(0xFFFF - (mk & 0xFFFF), E - 1)
            o = mk >> 16
            mx = tl.where(o >= 0, o, o ^ 0x7FFF).to(tl.int16).to(dt, bitcast=True).to(tl.float32)
            top = tl.where(slots[None, :] == j, mx[:, None], top)
            ids = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], ids)
            picked = rest == mk[:, None]
            rest = tl.where(picked, -(2**31), rest)  # below every key: a column's bits are never 0xFFFF
            if COUNT:
                hits += picked.to(tl.int32)
    else:
        rest = v
        taken = cols[None, :] >= E  # and the picked experts (an expert at -inf still ties the rest)
        for j in tl.static_range(K):
            mx = tl.max(rest, 1)
            pick = tl.min(tl.where((rest == mx[:, None]) & ~taken, cols[None, :], E_P2), 1)
            pick = tl.minimum(pick, E - 1)  # NaN rows: no id out of range
            top = tl.where(slots[None, :] == j, mx[:, None], top)
            ids = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], ids)
            picked = cols[None, :] == pick[:, None]
            rest = tl.where(picked, float("-inf"), rest)
            taken = taken | picked
            if COUNT:
                hits += picked.to(tl.int32)
    m = tl.sum(tl.where(slots[None, :] == 0, top, 0.0), 1)  # the first pick: the row's largest logit
    e = tl.math.exp2((top - m[:, None]) * _LOG2E)
    if NORMALIZE:
        total = tl.sum(tl.where(slots[None, :] == 0, e, 0.0), 1)
        for j in tl.static_range(1, K):  # in top-k order, as the reference sums
            total += tl.sum(tl.where(slots[None, :] == j, e, 0.0), 1)
    else:
        total = tl.sum(tl.math.exp2((v - m[:, None]) * _LOG2E), 1)
    w = tl.math.div_rn(e, total[:, None])
    out = rows.to(tl.int64)[:, None] * K + slots[None, :]
    mask = row_ok[:, None] & (slots < K)[None, :]
    tl.store(w_ptr + out, w.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)
    if COUNT:  # one reduction across the rows, after the k passes
        counts = tl.sum(tl.where(row_ok[:, None], hits, 0), 0)
        tl.store(counts_ptr + block * E_P2 + cols, counts)


@triton.jit
def _router_kernel(logits_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_l, K: tl.constexpr,
                   K_P2: tl.constexpr, E_P2: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                   COUNT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, E_P2)
    v = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                mask=row_ok[:, None] & (cols < E)[None, :], other=float("-inf")).to(tl.float32)
    _route_rows(v, rows, row_ok, w_ptr, ids_ptr, counts_ptr, tl.program_id(0), E, K, K_P2, E_P2, NORMALIZE,
                COUNT)


@triton.jit
def _chunk_product(x_ptr, g_ptr, rows, row_ok, c, T, H, E, stride_x, stride_g, E_P2: tl.constexpr,
                   BLOCK_H: tl.constexpr, IEEE: tl.constexpr):
    """x[rows, chunk c] w[:, chunk c]^T in fp32 [BLOCK_T, E_P2]: one chunk's product, a fresh sum."""
    h = c * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, E_P2)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + h[None, :],
                mask=row_ok[:, None] & (h < H)[None, :], other=0.0)
    g = tl.load(g_ptr + cols.to(tl.int64)[:, None] * stride_g + h[None, :],
                mask=(cols < E)[:, None] & (h < H)[None, :], other=0.0)
    if IEEE:
        p = tl.dot(x, tl.trans(g), input_precision="ieee")
    else:
        p = tl.dot(x, tl.trans(g))
    # a select between the MMA and the caller's `total + p`: without it the unsplit launch gave other
    # bits than the split one on the GPU (likely the sum folded into the MMA's accumulator)
    return tl.where(row_ok[:, None], p, 0.0)


@triton.jit
def _gate_route_kernel(x_ptr, g_ptr, part_ptr, sem_ptr, logits_ptr, w_ptr, ids_ptr, counts_ptr, T, H, E,
                       stride_x, stride_g, K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                       NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                       SPLIT: tl.constexpr, COUNT: tl.constexpr, IEEE: tl.constexpr):
    chunks = tl.cdiv(H, BLOCK_H)
    block = tl.program_id(0) // chunks if SPLIT else tl.program_id(0)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, E_P2)
    tile = rows.to(tl.int64)[:, None] * E_P2 + cols[None, :]  # [BLOCK_T, E_P2] in a [T_pad, E_P2] plane
    plane = (T + BLOCK_T - 1) // BLOCK_T * BLOCK_T * E_P2  # no .to(): T == 1 compiles as a constant
    total = tl.zeros([BLOCK_T, E_P2], dtype=tl.float32)
    last = True
    if SPLIT:  # this program's chunk into the workspace; the block's last program to finish sums them
        c = tl.program_id(0) % chunks
        p = _chunk_product(x_ptr, g_ptr, rows, row_ok, c, T, H, E, stride_x, stride_g, E_P2, BLOCK_H, IEEE)
        tl.store(part_ptr + c * plane + tile, p)
        tl.debug_barrier()  # every thread's stores issued before the release below
        last = tl.atomic_add(sem_ptr + block, 1, sem="acq_rel", scope="gpu") == chunks - 1
        if last:
            for c2 in range(chunks):  # chunk order, as the reference and the unsplit loop sum
                total += tl.load(part_ptr + c2 * plane + tile, cache_modifier=".cg")
            tl.store(sem_ptr + block, 0)  # ready for the next launch
    else:
        for c in range(chunks):
            total += _chunk_product(x_ptr, g_ptr, rows, row_ok, c, T, H, E, stride_x, stride_g, E_P2,
                                    BLOCK_H, IEEE)
    if last:
        col_ok = cols < E
        dst = logits_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :]
        tl.store(dst, total.to(logits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        # routed from the logits read back, not from the sum's registers: the split and the unsplit
        # launch hold the sum in other layouts (the MMA's or a load's), and the softmax's sum over the
        # experts (NORMALIZE off) would follow them into other orders, other bits
        tl.debug_barrier()
        v = tl.load(dst, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        v = tl.where(col_ok[None, :], v, float("-inf"))
        _route_rows(v, rows, row_ok, w_ptr, ids_ptr, counts_ptr, block, E, K, K_P2, E_P2, NORMALIZE, COUNT)


def route(logits: torch.Tensor, k: int, normalize: bool, chunk: int | None = None):
    """logits [T, E] (unit stride along E) -> (weights [T, k] in logits.dtype, ids [T, k] int64), and
    with `chunk` (a multiple of k, chunk / k a power of two) the counts [cdiv(T * k, chunk), E_P2]
    int32 of each chunk of the flat ids per expert (E_P2 = next power of two of E, columns from E on
    zero)."""
    if logits.ndim != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [T, E] with unit stride along E, got {tuple(logits.shape)} "
                         f"{logits.stride()}")
    t, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"top-k must be in 1..E={e}, got {k}")
    if logits.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {logits.device}")
    weights = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    block, e_p2 = CONFIG["BLOCK_T"], next_power_of_2(e)
    counts = None
    if chunk is not None:
        if chunk % k or chunk // k != next_power_of_2(chunk // k):
            raise ValueError(f"chunk must be k={k} times a power of two, got {chunk}")
        block = chunk // k
        counts = torch.empty(cdiv(t, block), e_p2, dtype=torch.int32, device=logits.device)
    if t:
        # no FMA contraction: the reference rounds (l - m) * log2 e before the exp2
        launch_kernel(_router_kernel, (cdiv(t, block),),
                      (logits, weights, ids, ids if counts is None else counts, t, e, logits.stride(0)),
                      K=k, K_P2=next_power_of_2(k), E_P2=e_p2, NORMALIZE=normalize, BLOCK_T=block,
                      COUNT=counts is not None, num_warps=CONFIG["num_warps"], enable_fp_fusion=False)
    return (weights, ids) if chunk is None else (weights, ids, counts)


GATE_CONFIG = dict(num_warps=4)
SPLIT_MAX_BLOCKS = 64  # row blocks up to which the chunks are programs (1024 tokens at top-8)
_SEMAPHORES: dict = {}  # device -> int32 [SPLIT_MAX_BLOCKS], zero between launches


def _semaphores(device: torch.device) -> torch.Tensor | None:
    """The split launch's per-block counters (each block's last program resets its own), made once
    per device outside a CUDA graph capture; None while capturing before they exist."""
    sem = _SEMAPHORES.get(device)
    if sem is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        sem = _SEMAPHORES[device] = torch.zeros(SPLIT_MAX_BLOCKS, dtype=torch.int32, device=device)
    return sem


def gate_rows(k: int) -> int:
    """Rows a block of the gate's launch holds: the tokens of one of the sort's chunks where that is 16
    or 32 (the block then counts that chunk's picks), else 16. A function of k alone: a row's bits
    must not depend on the batch."""
    tokens = CHUNK // k if CHUNK % k == 0 else 0
    return tokens if tokens in (16, 32) else 16


def gate_route(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool, chunk: int | None = None):
    """The gate and the routing in one launch: x [T, H], the gate's weight [E, H] (unit stride along H,
    x's dtype) -> (logits [T, E] in x.dtype, `minite.ref.router.gate_logits`'s sum order; then
    `route(logits, k, normalize, chunk)`'s outputs for them).

    A row's bits never depend on the batch: its chunk products are summed in chunk order whether one
    program walks the chunks (many tokens) or each chunk is a program of its own (up to
    SPLIT_MAX_BLOCKS blocks of rows, a decode step: the gate's weight read by many SMs at once), in
    which case the block's last program to finish sums the partial products and routes."""
    if x.ndim != 2 or weight.ndim != 2 or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or \
            weight.stride(1) != 1:
        raise ValueError(f"gate_route needs x [T, H] and weight [E, H] with unit stride along H, got "
                         f"{tuple(x.shape)} {x.stride()} and {tuple(weight.shape)} {weight.stride()}")
    if weight.dtype != x.dtype:
        raise ValueError(f"the gate's weight must be in x's dtype {x.dtype}, got {weight.dtype}")
    (t, h), e = x.shape, weight.shape[0]
    if not 1 <= k <= e:
        raise ValueError(f"top-k must be in 1..E={e}, got {k}")
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {x.device}")
    block, e_p2 = gate_rows(k), max(16, next_power_of_2(e))
    if chunk is not None and chunk != block * k:
        raise ValueError(f"chunk must be k={k} times {block}, got {chunk}")
    logits = torch.empty(t, e, dtype=x.dtype, device=x.device)
    weights = torch.empty(t, k, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    blocks, chunks = cdiv(t, block), cdiv(h, GATE_CHUNK)
    counts = None if chunk is None else torch.empty(blocks, e_p2, dtype=torch.int32, device=x.device)
    if t:
        sem = _semaphores(x.device) if chunks > 1 and blocks <= SPLIT_MAX_BLOCKS else None
        part = ids if sem is None else torch.empty(chunks, blocks * block, e_p2, dtype=torch.float32,
                                                   device=x.device)
        launch_kernel(_gate_route_kernel, (blocks * chunks if sem is not None else blocks,),
                      (x, weight, part, ids if sem is None else sem, logits, weights, ids,
                       ids if counts is None else counts, t, h, e, x.stride(0), weight.stride(0)),
                      K=k, K_P2=next_power_of_2(k), E_P2=e_p2, NORMALIZE=normalize, BLOCK_T=block,
                      BLOCK_H=GATE_CHUNK, SPLIT=sem is not None, COUNT=counts is not None,
                      IEEE=x.dtype == torch.float32, num_warps=GATE_CONFIG["num_warps"],
                      enable_fp_fusion=False)
    return (logits, weights, ids) if chunk is None else (logits, weights, ids, counts)
