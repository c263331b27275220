"""Log-probs of the plain sampled distribution (temperature T, no top-k / top-p cut):

    lse[r] = log sum_v exp(fp32(logits[r, v]) / T)
    log p(tokens[r]) = fp32(logits[r, tokens[r]]) / T - lse[r]
    d log p / d logits[r, v] = (onehot(tokens[r])[v] - exp(fp32(logits[r, v]) / T - lse[r])) / T

`minite.kernels.logprobs.row_lse` reads each row once and sums in another order: within a few fp32
ulps of `row_lse` here (not bitwise); `token_logprob_grad` within fp32 rounding of the formula.
Both engines run the kernel, so they agree bitwise with each other.
"""

import torch


def row_lse(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [R, V] -> fp32 [R]."""
    return torch.logsumexp(logits.float() / temperature, dim=-1)


def token_logprob_grad(logits: torch.Tensor, lse: torch.Tensor, tokens: torch.Tensor, g: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
    """The gradient of sum_r g[r] * log p(tokens[r]) in logits [R, V], in logits' dtype."""
    p = torch.exp(logits.float() / temperature - lse[:, None])  # [R, V] fp32
    d = -p * g[:, None]
    d.scatter_add_(1, tokens.long()[:, None], g[:, None].float())
    return (d / temperature).to(logits.dtype)
