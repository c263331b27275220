"""What the learner hands an RL loss: `RLBatch`, the `Correction` a loss composes in, and the
aggregations a loss may average with (which the learner mirrors when it weights micro-batches).

Below both `minite.learner` (which builds an `RLBatch` per micro-batch) and `minite.rl` (whose losses
and corrections consume it), so that the learner does not import the RL package; `minite.rl.batch`
is its name on the RL side.

`RLBatch` holds one (mini)batch of B responses padded to T positions. Per-token tensors are [B, T]:

- `logprobs`          log pi_theta(y_t), the current policy; the only field that carries gradient.
- `old_logprobs`      log pi_theta_old(y_t), the learner at the weights that sampled the batch.
- `sampler_logprobs`  log mu(y_t), what the sampler reported for the same tokens.
- `mask`              True on response tokens; prompt and padding positions are False.
- `advantages`        [B] per sequence or [B, T] per token.
- `ref_logprobs`      optional log pi_ref(y_t) for a KL penalty.

Masked positions may hold any finite garbage: every consumer reads them through `masked`, which
replaces them with 0 *before* any exp/log, so neither values nor gradients depend on them.

Conventions used by every correction: gap g_t = log pi_theta_old(y_t) - log mu(y_t), ratio
rho_t = exp(g_t). A `Correction` is what a correction function returns: stop-gradient per-token
weights, a keep mask (False = rejected) and a metrics dict of 0-dim tensors with stable names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

# token_mean: the mean over all response tokens; seq_mean: the mean over non-empty sequences of each
# sequence's token mean; seq_mean_token_sum_norm: of each sequence's token sum over a constant (Dr. GRPO)
AGGREGATIONS = ("token_mean", "seq_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class RLBatch:
    logprobs: Tensor  # [B, T] float, requires grad
    old_logprobs: Tensor  # [B, T] float
    sampler_logprobs: Tensor  # [B, T] float
    mask: Tensor  # [B, T] bool (0/1 numbers are converted)
    advantages: Tensor  # [B] or [B, T] float
    ref_logprobs: Tensor | None = None  # [B, T] float

    def __post_init__(self):
        if self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(self.logprobs.shape)}")
        shape = self.logprobs.shape
        for name in ("old_logprobs", "sampler_logprobs", "mask", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, "
                                 f"got {tuple(value.shape)}")
        if self.advantages.shape not in (shape[:1], shape):
            raise ValueError(f"advantages must be [B]={tuple(shape[:1])} or [B, T]={tuple(shape)}, "
                             f"got {tuple(self.advantages.shape)}")
        if self.mask.dtype != torch.bool:
            object.__setattr__(self, "mask", self.mask != 0)

    @property
    def shape(self) -> torch.Size:
        return self.logprobs.shape

    def masked(self, x: Tensor) -> Tensor:
        """x on response tokens, 0 elsewhere (garbage-safe: use before exp/log)."""
        return torch.where(self.mask, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def gap(self) -> Tensor:
        """g_t = log pi_theta_old - log mu on response tokens, 0 elsewhere; no gradient."""
        return self.masked(self.old_logprobs.detach().float() - self.sampler_logprobs.detach().float())

    def token_advantages(self) -> Tensor:
        """Advantages broadcast to [B, T], 0 off the response; no gradient."""
        a = self.advantages.detach().float()
        if a.dim() == 1:
            a = a[:, None].expand(self.shape)
        return self.masked(a)  # [B, T]

    def seq_lengths(self) -> Tensor:
        return self.mask.sum(dim=1)  # [B] int64

    def check_finite(self) -> None:
        """Raise ValueError if a response-token value is NaN or infinite (costs a device sync)."""
        for name in ("logprobs", "old_logprobs", "sampler_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None and not torch.isfinite(value.detach()[self.mask]).all():
                raise ValueError(f"{name} has non-finite values on response tokens")
        a = self.advantages.detach()
        bad = ~torch.isfinite(a if a.dim() == 1 else a[self.mask])
        if bad.any():
            raise ValueError("advantages has non-finite values")

    def rows(self, index: Tensor | slice) -> RLBatch:
        """The sub-batch of the selected rows (a minibatch)."""
        pick = lambda x: None if x is None else x[index]
        return RLBatch(self.logprobs[index], self.old_logprobs[index], self.sampler_logprobs[index],
                       self.mask[index], self.advantages[index], pick(self.ref_logprobs))


@dataclass(frozen=True)
class Correction:
    """Result of a correction: the loss multiplies each response token's term by weight * keep."""

    weights: Tensor  # [B, T] float, detached
    keep: Tensor  # [B, T] bool, False off the response and on rejected tokens
    metrics: dict[str, Tensor] = field(default_factory=dict)

    def coefficients(self) -> Tensor:
        """weight * keep, exactly 0 on rejected and masked tokens."""
        zero = torch.zeros((), dtype=self.weights.dtype, device=self.weights.device)
        return torch.where(self.keep, self.weights.detach(), zero)  # [B, T]

    def rows(self, index: Tensor | slice) -> Correction:
        """The selected rows, for minibatches; metrics stay those of the full batch."""
        return Correction(self.weights[index], self.keep[index], self.metrics)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over positions where mask is True (0 when there are none); 0-dim, detached."""
    total = torch.where(mask, x.detach().float(), torch.zeros((), device=x.device)).sum()
    return total / mask.sum().clamp(min=1)
