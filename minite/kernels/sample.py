"""Inverse-CDF draw of one token per row (`minite.ref.sample.draw`, same arguments), in two launches.

The cdf runs over blocks of BLOCK token ids in order:

1. `_block_totals_kernel`, one program per (row, block): the block's total, the last element of
   `tl.cumsum(exp(logp))` over the block;
2. `_pick_kernel`, one program per row: total = the block totals summed in order; target =
   min(u * total, nextafter(total, 0)); the first block whose running sum exceeds the target; in it,
   the first token with nonzero probability whose cdf (the running sum before the block plus the
   block's cumsum) exceeds the target.

So a draw reads the row once, plus one block. The reference's `exp` + `cumsum` + `searchsorted` pass
over [B, V] fp32 three times. A parallel scan is not monotone to the last bit in fp32, hence the
nonzero-probability test: a dropped token is never picked. The token equals the reference's except
where the target lies within fp32 rounding of a cdf step (`tl.exp` is within 2 ulp on the GPU, the
sums run in another order; H200, 512 x 151936 random rows: 512 and 510 of 512 tokens the reference's,
63 of 64 at 64 rows: benchmarks/ops/bench_sample.py at d748e01 and 0950f46,
benchmarks/results/h200/sample.json). One program per row: a row's token never depends on the
other rows. `draw_from_logits` draws from logits and their row log-sum-exp (`kernels.logprobs`)
without writing log-probs.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel

CONFIG = dict(BLOCK=4096, num_warps=8)
INTERPRETED_BLOCK = 64  # small blocks under the CPU interpreter: rows of a few hundred ids span several


@triton.jit
def _block_cdf(row_ptr, lse_ptr, row, b, V, inv_t, LOGITS: tl.constexpr, SCALE: tl.constexpr,
               BLOCK: tl.constexpr):
    """Block b of a row: (token ids, probabilities, their cumsum). The row holds log-probs, or with
    LOGITS logits whose probabilities are exp(logits * inv_t - lse[row]) (`kernels.logprobs`)."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if LOGITS:
        x = (x * inv_t if SCALE else x) - tl.load(lse_ptr + row)
    p = tl.exp(x)
    return offs, p, tl.cumsum(p, 0)


@triton.jit
def _block_totals_kernel(logp_ptr, lse_ptr, totals_ptr, V, NB, stride_row, inv_t, LOGITS: tl.constexpr,
                         SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row, b = tl.program_id(0), tl.program_id(1)
    offs, p, c = _block_cdf(logp_ptr + row.to(tl.int64) * stride_row, lse_ptr, row, b, V, inv_t, LOGITS,
                            SCALE, BLOCK)
    last = tl.sum(tl.where(offs == b * BLOCK + BLOCK - 1, c, 0.0), 0)
    tl.store(totals_ptr + row * NB + b, last)


@triton.jit
def _pick_kernel(logp_ptr, lse_ptr, totals_ptr, u_ptr, out_ptr, V, NB, stride_row, inv_t,
                 LOGITS: tl.constexpr, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tot = totals_ptr + row * NB
    total = tl.load(tot)
    for b in range(1, NB):
        total += tl.load(tot + b)
    target = tl.load(u_ptr + row) * total
    below_total = (total.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True)
    target = tl.where(target < total, target, below_total)
    # the first block whose running sum passes the target (the same additions as `total`'s)
    run = tl.load(tot)
    chosen = tl.where(run > target, 0, NB - 1)
    base = tl.full((), 0.0, tl.float32)
    found = (run > target).to(tl.int32)
    for b in range(1, NB):
        t = tl.load(tot + b)
        hit = (found == 0) & (run + t > target)
        chosen = tl.where(hit, b, chosen)
        base = tl.where(hit, run, base)
        found = found | hit.to(tl.int32)
        run += t
    offs, p, c = _block_cdf(logp_ptr + row.to(tl.int64) * stride_row, lse_ptr, row, chosen, V, inv_t, LOGITS,
                            SCALE, BLOCK)
    live = p > 0
    first = tl.min(tl.where(live & (base + c > target), offs, V), 0)
    # no crossing inside the block (its cumsum's rounding): its last token with nonzero probability
    last = tl.max(tl.where(live, offs, -1), 0)
    tok = tl.where(first < V, first, last)
    tl.store(out_ptr + row, tl.minimum(tl.maximum(tok, 0), V - 1).to(tl.int64))


def draw(logp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logp [B, V] fp32 (-inf where dropped; unit stride along V), u [B] fp32 in [0, 1) -> tokens [B]
    int64. Every row needs a token with nonzero probability."""
    if logp.dtype != torch.float32:
        raise ValueError(f"logp must be fp32, got {logp.dtype}")
    return _draw(logp, None, 1.0, u)


def draw_from_logits(logits: torch.Tensor, lse: torch.Tensor, temperature: float,
                     u: torch.Tensor) -> torch.Tensor:
    """The same draw from logits [B, V] (any float dtype): probabilities exp(logits / T - lse), lse fp32
    [B] from `kernels.logprobs.row_lse` (no [B, V] log-probs written)."""
    if lse.dtype != torch.float32 or tuple(lse.shape) != (logits.shape[0],):
        raise ValueError(f"lse must be fp32 [B={logits.shape[0]}], got {lse.dtype} {tuple(lse.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    return _draw(logits, lse.contiguous(), temperature, u)


def _draw(x: torch.Tensor, lse: torch.Tensor | None, temperature: float, u: torch.Tensor) -> torch.Tensor:
    if x.ndim != 2 or x.stride(1) != 1 or not x.is_floating_point():
        raise ValueError(f"logp / logits must be float [B, V] with unit stride along V, got {x.dtype} "
                         f"{tuple(x.shape)} strides {x.stride()}")
    b, v = x.shape
    if u.dtype != torch.float32 or tuple(u.shape) != (b,) or u.device != x.device:
        raise ValueError(f"u must be fp32 [B={b}] on {x.device}, got {u.dtype} {tuple(u.shape)} "
                         f"on {u.device}")
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {x.device}")
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    block = INTERPRETED_BLOCK if interpreted() else CONFIG["BLOCK"]
    nb = cdiv(v, block)
    totals = torch.empty(b, nb, dtype=torch.float32, device=x.device)
    logits = lse is not None
    lse = lse if logits else totals  # unread
    meta = dict(LOGITS=logits, SCALE=temperature != 1, BLOCK=block, num_warps=CONFIG["num_warps"])
    inv_t = 1.0 / temperature
    launch_kernel(_block_totals_kernel, (b, nb), (x, lse, totals, v, nb, x.stride(0), inv_t), **meta)
    args = (x, lse, totals, u.contiguous(), out, v, nb, x.stride(0), inv_t)
    launch_kernel(_pick_kernel, (b,), args, **meta)
    return out
