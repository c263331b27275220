"""PPO-style clipped policy-gradient loss with a composed correction and an optional k3 KL penalty.

Per response token, with r_t = exp(log pi_theta - log pi_theta_old) (`ratio = "token"`, PPO/GRPO) or
the sequence's ratio s = exp(mean_t (log pi_theta - log pi_theta_old)) at every token of it
(`ratio = "sequence"`, GSPO: r_t = stopgrad(s) * pi_theta / stopgrad(pi_theta), value s, gradient
s * grad log pi_theta(y_t); the whole sequence is clipped or not), advantage A, the correction's
stop-gradient coefficient c_t = w_t * keep_t (1 without a correction) and reference log-probs:

    pg_t = -A * r_t                              unless clipped
    pg_t = -A * stopgrad(clip(r_t, 1 - eps_low, 1 + eps_high))   when clipped,
    clipped  <=>  (A > 0 and r_t > 1 + eps_high) or (A < 0 and r_t < 1 - eps_low)

which equals -min(r A, clip(r) A) everywhere; exactly at a boundary the token is not clipped and
keeps its gradient.
    k3_t = exp(d_t) - d_t - 1,  d_t = log pi_ref - log pi_theta      (Schulman's k3 for KL(pi || ref))
    loss_t = c_t * pg_t + kl_coef * k3_t                               (the KL term is not reweighted)

Aggregation over response tokens m_bt (rejected tokens count in the denominators, with c = 0):
    token_mean:  sum_{b,t} m loss / sum_{b,t} m
    seq_mean:    mean over sequences with >= 1 token of (sum_t m loss / sum_t m)
    seq_mean_token_sum_norm:  mean over sequences with >= 1 token of (sum_t m loss / normalizer)
                 (Dr. GRPO's constant normalizer, no length bias; `normalizer` = the generation
                 budget, which the trainer fills in from sampling.max_tokens when it is 0)
GSPO pairs `ratio = "sequence"` with `seq_mean` and small clip ranges (eps 3e-4 / 4e-4 in its paper);
Dr. GRPO pairs `seq_mean_token_sum_norm` with advantages not divided by the std.
Only `batch.logprobs` receives gradient; old/sampler/reference log-probs and advantages are detached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from minite.loss_batch import AGGREGATIONS
from minite.rl.batch import Correction, RLBatch, masked_mean
from minite.rl.corrections import CorrectionConfig, apply_correction

RATIOS = ("token", "sequence")


@dataclass(frozen=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "token_mean"
    kl_coef: float = 0.0
    ratio: str = "token"
    normalizer: int = 0

    def __post_init__(self):
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={self.aggregation!r} is not supported; "
                             f"choose one of {AGGREGATIONS}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.ratio not in RATIOS:
            raise ValueError(f"ratio={self.ratio!r} is not supported; choose one of {RATIOS}")
        if self.normalizer < 0:
            raise ValueError(f"normalizer must be >= 0 (0: the generation budget), got {self.normalizer}")


def _normalizer(cfg: LossConfig) -> int:
    if cfg.normalizer < 1:
        raise ValueError("aggregation 'seq_mean_token_sum_norm' needs normalizer >= 1 "
                         "(the generation budget)")
    return cfg.normalizer


def aggregate(values: Tensor, mask: Tensor, how: str, normalizer: int = 0) -> Tensor:
    """Reduce per-token values [B, T] over response tokens to a 0-dim tensor (see module doc)."""
    v = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if how == "token_mean":
        return v.sum() / mask.sum().clamp(min=1)
    if how in ("seq_mean", "seq_mean_token_sum_norm"):
        lengths = mask.sum(dim=1)  # [B]
        per_seq = v.sum(dim=1) / (lengths.clamp(min=1) if how == "seq_mean" else normalizer)
        return per_seq.sum() / (lengths > 0).sum().clamp(min=1)
    raise ValueError(f"aggregation={how!r} is not supported; choose one of {AGGREGATIONS}")


def k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref), 0 off the response; gradient flows into logprobs."""
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    d = torch.where(mask, ref_logprobs.detach().float() - logprobs.float(), zero)
    return torch.exp(d) - d - 1  # [B, T]


def sequence_ratio(batch: RLBatch, log_ratio: Tensor) -> Tensor:
    """GSPO's ratio at every token: value exp(mean_t log_ratio) of its sequence, gradient that value
    times grad log pi_theta(y_t) (see the module docstring); 0 off the response."""
    mask = batch.mask
    seq = log_ratio.detach().sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [B]
    lp = batch.logprobs.float()
    token = torch.where(mask, lp - lp.detach(), torch.zeros((), dtype=lp.dtype, device=lp.device))
    return torch.exp(seq[:, None] + token) * mask  # [B, T]


def policy_loss(batch: RLBatch, cfg: LossConfig = LossConfig(),
                correction: Correction | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (+ kl_coef * k3) and its metrics; metrics of `correction` are merged."""
    mask = batch.mask
    log_ratio = batch.masked(batch.logprobs.float() - batch.old_logprobs.detach().float())
    ratio = torch.exp(log_ratio) if cfg.ratio == "token" else sequence_ratio(batch, log_ratio)  # [B, T]
    normalizer = _normalizer(cfg) if cfg.aggregation == "seq_mean_token_sum_norm" else 0
    a = batch.token_advantages()
    clip_high = mask & (a > 0) & (ratio > 1 + cfg.eps_high)
    clip_low = mask & (a < 0) & (ratio < 1 - cfg.eps_low)
    bounded = ratio.detach().clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = -a * torch.where(clip_high | clip_low, bounded, ratio)  # [B, T]
    coef = mask.float() if correction is None else correction.coefficients()
    pg_loss = aggregate(coef * pg, mask, cfg.aggregation, normalizer)
    loss = pg_loss
    metrics: dict[str, Tensor] = {}
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs batch.ref_logprobs")
        kl = aggregate(k3(batch.logprobs, batch.ref_logprobs, mask), mask, cfg.aggregation, normalizer)
        loss = loss + cfg.kl_coef * kl
        metrics["loss/kl"] = kl.detach()
    metrics |= {
        "loss/total": loss.detach(),
        "loss/pg": pg_loss.detach(),
        "loss/clip_frac": masked_mean(clip_high | clip_low, mask),
        "loss/clip_high_frac": masked_mean(clip_high, mask),
        "loss/clip_low_frac": masked_mean(clip_low, mask),
        "loss/ratio_mean": masked_mean(ratio, mask),
        "loss/policy_k3": masked_mean(torch.exp(-log_ratio) + log_ratio - 1, mask),
    }
    if correction is not None:
        metrics |= correction.metrics
    return loss, metrics


def loss_with_correction(batch: RLBatch, loss_cfg: LossConfig,
                         correction_cfg: CorrectionConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Correction computed on this batch, then `policy_loss` (for single-batch use and tests)."""
    return policy_loss(batch, loss_cfg, apply_correction(batch, correction_cfg))
