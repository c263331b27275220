"""Log-probs of the plain sampled distribution (temperature only, no top-k / top-p) straight from the
logits, for the sampler and the learner alike (`minite.sampling.token_logprobs`).

    z = logits / T (fp32),  lse = log sum exp(z),  log p(token) = z[token] - lse

`row_lse` (one program per row, the row's blocks of BLOCK ids in order, an online max / sum) reads the
16-bit logits once; torch's path writes them as fp32, then the fp32 log-softmax ([R, V] twice more).
`token_logprob_grad` is the backward, d logits = (onehot(token) - exp(z - lse)) * g / T, one read and
one write. A row's lse never depends on the other rows (learner chunks and sampler batches agree
bitwise); it is close to torch's logsumexp (the exp is the GPU's, the sum another order), not bitwise.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.launch import launch as launch_kernel

CONFIG = dict(BLOCK=4096, num_warps=8)
INTERPRETED_BLOCK = 64


@triton.jit
def _scaled(row_ptr, offs, V, inv_t, SCALE: tl.constexpr):
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x * inv_t if SCALE else x


@triton.jit
def _row_lse_kernel(logits_ptr, lse_ptr, V, stride_row, inv_t, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    ptr = logits_ptr + row.to(tl.int64) * stride_row
    offs = tl.arange(0, BLOCK)
    m = tl.max(_scaled(ptr, offs, V, inv_t, SCALE), 0)
    s = tl.sum(tl.exp(_scaled(ptr, offs, V, inv_t, SCALE) - m), 0)
    for start in range(BLOCK, V, BLOCK):
        z = _scaled(ptr, start + offs, V, inv_t, SCALE)
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    tl.store(lse_ptr + row, m + tl.log(s))


@triton.jit
def _grad_kernel(logits_ptr, lse_ptr, tokens_ptr, g_ptr, out_ptr, V, stride_row, stride_out, inv_t,
                 SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    z = _scaled(logits_ptr + row.to(tl.int64) * stride_row, offs, V, inv_t, SCALE)
    gs = tl.load(g_ptr + row) * inv_t
    p = tl.exp(z - tl.load(lse_ptr + row))
    d = tl.where(offs == tl.load(tokens_ptr + row), gs - p * gs, -p * gs)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, d.to(out_ptr.dtype.element_ty), mask=offs < V)


def _check(logits: torch.Tensor, temperature: float) -> None:
    if logits.ndim != 2 or logits.stride(1) != 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be float [R, V] with unit stride along V, got {logits.dtype} "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy takes the argmax path)")
    if logits.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {logits.device}")


def _block() -> int:
    return INTERPRETED_BLOCK if interpreted() else CONFIG["BLOCK"]


def row_lse(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [R, V] -> fp32 [R]: log sum exp(logits / temperature) per row."""
    _check(logits, temperature)
    r, v = logits.shape
    out = torch.empty(r, dtype=torch.float32, device=logits.device)
    if r:
        launch_kernel(_row_lse_kernel, (r,), (logits, out, v, logits.stride(0), 1.0 / temperature),
                      SCALE=temperature != 1, BLOCK=_block(), num_warps=CONFIG["num_warps"])
    return out


def token_logprob_grad(logits: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor, g: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """d logits [R, V] (logits' dtype) of sum_r g[r] * (z[r, tokens[r]] - lse[r]), z = logits / T."""
    _check(logits, temperature)
    r, v = logits.shape
    out = torch.empty(r, v, dtype=logits.dtype, device=logits.device)
    if r:
        block = _block()
        args = (logits, lse.contiguous(), tokens.contiguous(), g.float().contiguous(), out, v,
                logits.stride(0), out.stride(0), 1.0 / temperature)
        launch_kernel(_grad_kernel, (r, triton.cdiv(v, block)), args, SCALE=temperature != 1, BLOCK=block,
                      num_warps=CONFIG["num_warps"])
    return out
