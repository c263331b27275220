"""Draw tokens from `processed_logprobs` (the one definition in `minite.sampling`) with per-sample
counter-based uniforms, and return each drawn token's log-prob under that same distribution.

The draw is the inverse-CDF one of `minite.ref.sample.draw`; on CUDA it runs as two Triton launches
(`minite.kernels.sample`, one read of the [B, V] log-probs instead of three passes) where the model's
execution runs the element-wise kernels (`Execution.elementwise`). The plain distribution (no top-k /
top-p) on the kernels writes no [B, V] log-probs at all: the row's log-sum-exp, the draw from the
logits, and the token's log-prob by the learner's formula (`minite.nn.token_logprobs`). temperature 0
takes the argmax (log-prob 0), as `processed_logprobs` defines.
"""

from __future__ import annotations

import torch

from minite import kernels
from minite.execution import DEFAULT, Execution
from minite.nn import token_logprobs as kernel_path
from minite.ref.sample import draw as draw_reference
from minite.sampler.rng import uniforms
from minite.sampling import SamplingParams, processed_logprobs


def draw(logp: torch.Tensor, u: torch.Tensor, execution: Execution = DEFAULT) -> torch.Tensor:
    """logp [B, V] fp32 (-inf where dropped), u [B] in [0, 1) -> tokens [B] int64 (the kernel on CUDA)."""
    if logp.is_cuda and execution.elementwise_kernels(logp):
        return kernels.lazy.sample.draw(logp, u)
    return draw_reference(logp, u)


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: torch.Tensor,
           steps: torch.Tensor, execution: Execution = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], one SamplingParams per row, keys/steps [B] int64 -> tokens [B] int64, logprobs
    [B] fp32. Rows with the same (temperature, top_k, top_p) are processed together."""
    B = logits.shape[0]
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        idx = None if len(rows) == B else torch.tensor(rows, device=logits.device)
        sub = logits if idx is None else logits[idx]
        u = None if temperature == 0 else uniforms(keys if idx is None else keys[idx],
                                                    steps if idx is None else steps[idx], execution)
        if kernel_path.plain_applies(sub, temperature, top_k, top_p, execution):
            # the learner's formula on the kernels (minite.nn.token_logprobs); no [b, V] log-probs
            sub = sub.contiguous()
            lse = kernel_path.row_lse(sub, temperature)
            tok = kernels.lazy.sample.draw_from_logits(sub, lse, temperature, u)
            lp = kernel_path.token_logprob(sub, tok, lse, temperature)
        else:
            logp = processed_logprobs(sub, temperature, top_k, top_p)  # [b, V] fp32
            tok = logp.argmax(-1) if temperature == 0 else draw(logp, u, execution)
            lp = logp.gather(-1, tok[:, None])[:, 0]
        if idx is None:
            tokens, logprobs = tok, lp
        else:
            tokens[idx], logprobs[idx] = tok, lp
    return tokens, logprobs
