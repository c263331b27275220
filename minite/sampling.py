"""Sampling parameters and the one definition of "the distribution sampled from", shared by engines.

The sampler draws token y_t from, and reports log mu(y_t) under, the *processed* distribution:

1. scale: z = logits (fp32) / temperature;
2. top-k (k > 0): keep the k largest z (ties broken by lower token id);
3. top-p (p < 1): of what remains, sorted by z descending (ties by lower id), keep the shortest
   prefix whose softmax mass reaches p (the token that crosses p is kept);
4. log-softmax over the kept tokens; dropped tokens get -inf. With a cut, the masses of steps 3-4 are
   summed as integers (`MASS_BITS`), so a row's result does not depend on its batch.

temperature == 0 means greedy: the distribution is one-hot on the argmax (lowest id among ties), so
the sampled token's log-prob is 0. The learner recomputes its log-probs with this same function on
its own logits (docs/facts.md, "Learner-sampler mismatch in RL", lists an unmirrored truncation
among the usual log-prob definition bugs).

Where the fused kernels run (CUDA by default) the plain distribution (no top-k / top-p) takes a
kernel path in both engines (`minite.nn.token_logprobs`): log-probs within a few fp32 ulps of this
function's, and the same bits in sampler and learner.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minite.execution import DEFAULT, Execution
from minite.nn import token_logprobs as kernel_path


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


# Truncated distributions sum probabilities as integers: exp(z - max) in units of 2^-MASS_BITS. Integer
# sums and prefix sums are exact in any order, so the kept set and the normalizer of a row never depend
# on how many rows share the call (torch's float reductions and scans change their order with the row
# count on CUDA). 40 bits: the sum over a 152k vocabulary stays below 2^63; a token's mass is off by
# at most 2^-41 of the largest one's.
MASS_BITS = 40


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                       top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> fp32 log-probs [..., V] of the processed distribution (-inf where dropped).

    With a top-k / top-p cut, every row is computed with exact integer sums (`MASS_BITS`): the kept set
    and log-probs are bitwise the same whichever rows are computed together (sampler decode batches,
    learner chunks); they equal the float definition up to the rounding of each mass to 2^-40."""
    z = logits.float()
    vocab = z.shape[-1]
    if temperature == 0:
        hot = torch.nn.functional.one_hot(z.argmax(-1), vocab).bool()
        return torch.where(hot, 0.0, float("-inf"))
    if temperature != 1:  # z / 1 == z exactly: skip a pass over [.., V]
        z = z / temperature
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1:
        return torch.log_softmax(z, dim=-1)
    # Stable sort of -z: descending z, ties in ascending token id.
    order = torch.sort(-z, dim=-1, stable=True).indices
    zs = torch.gather(z, -1, order)
    top = zs[..., :1]
    mass = torch.round(torch.exp(zs - top) * 2.0**MASS_BITS).to(torch.int64)  # [..., V], top: 2^40
    if 0 < top_k < vocab:
        mass[..., top_k:] = 0
    if top_p < 1:
        before = torch.cumsum(mass, dim=-1) - mass
        total = mass.sum(dim=-1, keepdim=True)
        mass = torch.where(before.double() < top_p * total.double(), mass, 0)
    keep = mass > 0
    keep[..., 0] = True
    total = mass.sum(dim=-1, keepdim=True).double() * 2.0**-MASS_BITS
    lse = (top.double() + torch.log(total)).float()
    kept = torch.zeros_like(keep).scatter(-1, order, keep)
    return torch.where(kept, z - lse, float("-inf"))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   top_k: int = 0, top_p: float = 1.0, chunk: int = 1024,
                   execution: Execution = DEFAULT) -> torch.Tensor:
    """log-probs of `tokens` [N] under the processed distribution of logits [N, V], in row chunks so
    that no more than `chunk` rows of fp32 [., V] exist at once (the plain distribution on the kernels
    where `execution` runs the element-wise ones). Returns fp32 [N]."""
    if kernel_path.plain_applies(logits, temperature, top_k, top_p, execution):
        return kernel_path.plain_token_logprobs(logits, tokens, temperature)
    out = torch.empty(tokens.shape, dtype=torch.float32, device=logits.device)
    for s in range(0, tokens.shape[0], chunk):
        lp = processed_logprobs(logits[s: s + chunk], temperature, top_k, top_p)
        out[s: s + chunk] = lp.gather(-1, tokens[s: s + chunk, None].long())[:, 0]
    return out
