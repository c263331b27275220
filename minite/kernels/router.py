"""The MoE router's top-k routing in one launch (`minite.ref.router.route`: same ids, weights to within
the GPU's exp2 approximation).

torch runs it as a softmax, a top-k (a radix select and a bitonic sort), a sum, a division and a cast:
on the H200 ~20 us a layer of a 256-sequence Qwen3-30B-A3B decode step, ~0.9 ms a step over 48 layers
(benchmarks/results/h200/profile_rollout_moe48_aligned_256seqs.json). Here a program holds BLOCK_T
rows of logits in registers and picks the k largest by k arg-max passes (equal logits: the lower
expert), so a row's result never depends on the batch.

With `chunk`, each program also counts its picks per expert: the per-chunk counts the counting sort
(`minite.kernels.moe_sort`) starts from, so the sort needs no counting launch of its own; a program
then holds chunk / k rows, one chunk of the flat assignments.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.ref.router import LOG2E

CONFIG = dict(BLOCK_T=16, num_warps=4)
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _router_kernel(logits_ptr, w_ptr, ids_ptr, counts_ptr, T, E, stride_l, K: tl.constexpr,
                   K_P2: tl.constexpr, E_P2: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                   COUNT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, E_P2)
    v = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                mask=row_ok[:, None] & (cols < E)[None, :], other=float("-inf")).to(tl.float32)
    slots = tl.arange(0, K_P2)
    top = tl.zeros([BLOCK_T, K_P2], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_P2], dtype=tl.int64)
    rest = v
    hits = tl.zeros([BLOCK_T, E_P2], dtype=tl.int32)  # picks per row and expert (COUNT)
    for j in tl.static_range(K):
        mx = tl.max(rest, 1)
        pick = tl.min(tl.where(rest == mx[:, None], cols[None, :], E_P2), 1)
        pick = tl.minimum(pick, E - 1)  # NaN rows: no id out of range
        top = tl.where(slots[None, :] == j, mx[:, None], top)
        ids = tl.where(slots[None, :] == j, pick.to(tl.int64)[:, None], ids)
        picked = cols[None, :] == pick[:, None]
        rest = tl.where(picked, float("-inf"), rest)
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
        tl.store(counts_ptr + tl.program_id(0) * E_P2 + cols, counts)


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
