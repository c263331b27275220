"""Log-probs of the plain sampled distribution (temperature only) on the kernels, shared by sampler and
learner (`minite.sampling.token_logprobs`, `minite.sampler.sample.sample`).

Where the execution runs the element-wise kernels (`Execution.elementwise`: CUDA by default) and the
distribution has no top-k / top-p cut, a token's log-prob is

    lse = kernels.logprobs.row_lse(logits, T)           one read of the 16-bit logits per row
    log p(token) = fp32(logits[token]) / T - lse         `token_logprob`, torch, the same ops in both

instead of torch's fp32 copy of the logits and log-softmax over [R, V] (H200: ~0.5 ms of a 512-row decode
step; benchmarks/ops/bench_sample.py, benchmarks/results/h200/sample.json). Both engines run these ops on
bitwise-equal logits rows, so they agree bitwise; against torch's log-softmax they are close (within a few
fp32 ulps of lse), not bitwise.
The learner's gradient is `kernels.logprobs.token_logprob_grad`.
"""

from __future__ import annotations

import torch

from minite.execution import Execution
from minite.kernels import lazy


def plain_applies(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  execution: Execution) -> bool:
    """Whether the kernel path computes this distribution's log-probs: no cut, T > 0, kernels on."""
    vocab = logits.shape[-1]
    plain = temperature > 0 and (top_k <= 0 or top_k >= vocab) and top_p >= 1
    return plain and logits.ndim == 2 and execution.elementwise_kernels(logits)


def row_lse(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return lazy.logprobs.row_lse(logits, temperature)


def token_logprob(logits: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """fp32 [R]: logits[r, tokens[r]] / T - lse[r] (the one formula both engines use)."""
    z = logits.gather(1, tokens.long()[:, None])[:, 0].float()
    if temperature != 1:
        z = z / temperature
    return z - lse


class _PlainTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        lse = row_lse(logits, temperature)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature = temperature
        return token_logprob(logits, tokens, lse, temperature)

    @staticmethod
    def backward(ctx, g):
        logits, tokens, lse = ctx.saved_tensors
        return lazy.logprobs.token_logprob_grad(logits, lse, tokens, g, ctx.temperature), None, None


def plain_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [R, V], tokens [R] -> fp32 [R] log-probs (differentiable in logits)."""
    return _PlainTokenLogprobs.apply(logits.contiguous(), tokens, temperature)
