"""The MoE router's top-k routing from the router logits (HF Qwen3-MoE's softmax / top-k / renormalize,
stated on the logits).

    ids[t]   = the k experts of largest logit, largest first; equal logits: the lower expert first
    e[t, j]  = exp(l[t, ids[t, j]] - max_e l[t, e])                (fp32, l the logits widened)
    w[t, j]  = e[t, j] / (e[t, 0] + e[t, 1] + ... + e[t, k - 1])    normalize: summed in top-k order
             = e[t, j] / sum_e exp(l[t, e] - max_e l[t, e])          otherwise (the softmax probability)

cast to the logits' dtype. The softmax is monotonic, so these are the top-k of the probabilities and
the renormalized weights HF computes (the softmax's denominator cancels), up to rounding.
`minite.kernels.router.route` gives the same ids and these weights to within the GPU's exp2
approximation (a few fp32 ulps before the cast); both engines run the kernel, so they share its bits.
The exponential is written exp2(d * log2 e), the kernel's form.

The logits themselves (`gate_logits`, where the kernels compute the gate too) are the bf16 gate
linear with its sum over the hidden size in a fixed order, so a row's logits never depend on the
batch (cuBLAS promises no such thing):

    l[t, e] = cast(((0 + p_0) + p_1) + ... + p_{C-1}),   p_c = sum over chunk c of x[t, h] w[e, h]

with chunks of GATE_CHUNK hidden units in order, each p_c in fp32 (its order within the chunk is the
MMA's), and the cast to x's dtype.
"""

import torch

LOG2E = 1.4426950408889634
GATE_CHUNK = 128


def gate_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H], the gate's weight [E, H] -> logits [T, E] in x.dtype: fp32 chunk products summed in
    chunk order (module docstring)."""
    total = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for h in range(0, x.shape[1], GATE_CHUNK):
        total = total + x[:, h:h + GATE_CHUNK].float() @ weight[:, h:h + GATE_CHUNK].float().t()
    return total.to(x.dtype)


def route(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits.dtype, ids [T, k] int64)."""
    lf = logits.float()
    order = torch.sort(lf, dim=-1, descending=True, stable=True).indices  # ties: lower index first
    ids = order[:, :k]
    top = lf.gather(-1, ids)
    m = top[:, :1]
    e = torch.exp2((top - m) * LOG2E)
    if normalize:
        total = e[:, 0]
        for j in range(1, k):
            total = total + e[:, j]
    else:
        total = torch.exp2((lf - m) * LOG2E).sum(-1)
    return (e / total[:, None]).to(logits.dtype), ids
