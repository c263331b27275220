"""Learner-sampler mismatch corrections: one pure function each, selected by name through a registry.

With g_t = log pi_theta_old(y_t) - log mu(y_t), rho_t = exp(g_t), sequence log-ratio S = sum_t g_t over
the response and |y| its length, each function returns a `Correction` (stop-gradient weights w_t, keep
mask k_t, metrics); the loss multiplies each token's term by w_t * k_t:

- none:     w = 1, k = 1.
- tis:      w = min(rho_t, C)                                    token TIS, C = tis_cap (2).
- icepop:   w = rho_t, k = [alpha <= rho_t <= beta]              masked IS, (0.5, 5).
- seq_tis:  w = min(exp(S), C)                                   sequence TIS, C = seq_tis_cap (2).
- seq_mis:  w = exp(S), k = [lo <= exp(S) <= hi]                 masked sequence IS, (0.5, 2).
- geo_rs:   w = 1, k = [lo <= exp(S / |y|) <= hi]                geometric-mean rejection, (0.999, 1.001).
- opsm:     w = 1, k = not (A_t < 0 and mean_t (log mu - log pi_theta) > delta)   DeepSeek-V3.2, 1e-4.
- adv_mask: w = 1, k = not ((A_t > 0 and p - q > thr) or (A_t < 0 and p - q < -thr)),
            p = pi_theta_old(y_t), q = mu(y_t), thr = 0.2                           prime-rl's default.
- triage:   see `minite.rl.triage`.

OPSM follows DeepSeek-V3.2 and reads the *current* policy (`batch.logprobs`, detached), so it must be
recomputed per minibatch; every other correction reads only rollout-time quantities and can be
computed once on the whole rollout batch and sliced with `Correction.rows`.
Sequence-level metrics count sequences with at least one response token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from minite.rl.batch import Correction, RLBatch, masked_mean
from minite.rl.triage import TriageConfig, triage


def no_correction(batch: RLBatch) -> Correction:
    return Correction(torch.ones(batch.shape, device=batch.mask.device), batch.mask.clone(), {})


def token_tis(batch: RLBatch, cap: float = 2.0) -> Correction:
    rho = torch.exp(batch.gap())  # [B, T]
    weights = rho.clamp(max=cap)
    return Correction(weights, batch.mask.clone(), {"tis/clip_frac": masked_mean(rho > cap, batch.mask)})


def icepop(batch: RLBatch, low: float = 0.5, high: float = 5.0) -> Correction:
    rho = torch.exp(batch.gap())  # [B, T]
    too_low, too_high = (rho < low) & batch.mask, (rho > high) & batch.mask
    keep = batch.mask & ~too_low & ~too_high
    weights = torch.where(keep, rho, torch.zeros_like(rho))
    metrics = {"icepop/masked_frac": masked_mean(too_low | too_high, batch.mask),
               "icepop/low_frac": masked_mean(too_low, batch.mask),
               "icepop/high_frac": masked_mean(too_high, batch.mask)}
    return Correction(weights, keep, metrics)


def seq_tis(batch: RLBatch, cap: float = 2.0) -> Correction:
    log_seq = batch.gap().sum(dim=1)  # [B]
    seq_w = torch.exp(log_seq.clamp(max=math.log(cap)))
    present = batch.seq_lengths() > 0
    metrics = {"seq_tis/clip_frac": masked_mean(log_seq > math.log(cap), present),
               "seq_tis/mean_seq_weight": masked_mean(seq_w, present)}
    return Correction(_per_token(seq_w, batch), batch.mask.clone(), metrics)


def seq_mis(batch: RLBatch, low: float = 0.5, high: float = 2.0) -> Correction:
    log_seq = batch.gap().sum(dim=1)  # [B]
    kept = (log_seq >= _log(low)) & (log_seq <= math.log(high))
    seq_w = torch.where(kept, torch.exp(log_seq.clamp(max=math.log(high))), torch.zeros_like(log_seq))
    metrics = {"seq_mis/reject_frac": masked_mean(~kept, batch.seq_lengths() > 0)}
    return Correction(_per_token(seq_w, batch), batch.mask & kept[:, None], metrics)


def geo_rs(batch: RLBatch, low: float = 0.999, high: float = 1.001) -> Correction:
    lengths = batch.seq_lengths()
    log_geo = batch.gap().sum(dim=1) / lengths.clamp(min=1)  # [B]
    kept = (log_geo >= _log(low)) & (log_geo <= math.log(high))
    present = lengths > 0
    metrics = {"geo_rs/reject_frac": masked_mean(~kept, present),
               "geo_rs/mean_abs_log_geo": masked_mean(log_geo.abs(), present)}
    return Correction(torch.ones(batch.shape, device=lengths.device), batch.mask & kept[:, None], metrics)


def opsm(batch: RLBatch, delta: float = 1e-4) -> Correction:
    lengths = batch.seq_lengths()
    diverge = batch.masked(batch.sampler_logprobs.detach().float() - batch.logprobs.detach().float())
    seq_kl = diverge.sum(dim=1) / lengths.clamp(min=1)  # [B]
    dropped = batch.mask & (batch.token_advantages() < 0) & (seq_kl > delta)[:, None]
    metrics = {"opsm/masked_frac": masked_mean(dropped, batch.mask),
               "opsm/reject_frac": masked_mean(dropped.any(dim=1), lengths > 0)}
    return Correction(torch.ones(batch.shape, device=lengths.device), batch.mask & ~dropped, metrics)


def adv_mask(batch: RLBatch, threshold: float = 0.2) -> Correction:
    p = torch.exp(batch.masked(batch.old_logprobs.detach().float()))  # [B, T]
    q = torch.exp(batch.masked(batch.sampler_logprobs.detach().float()))
    a = batch.token_advantages()
    dropped = batch.mask & (((a > 0) & (p - q > threshold)) | ((a < 0) & (p - q < -threshold)))
    metrics = {"adv_mask/masked_frac": masked_mean(dropped, batch.mask)}
    return Correction(torch.ones(batch.shape, device=p.device), batch.mask & ~dropped, metrics)


CORRECTIONS: dict[str, Callable[[RLBatch, CorrectionConfig], Correction]] = {
    "none": lambda b, c: no_correction(b),
    "tis": lambda b, c: token_tis(b, c.tis_cap),
    "icepop": lambda b, c: icepop(b, c.icepop_low, c.icepop_high),
    "seq_tis": lambda b, c: seq_tis(b, c.seq_tis_cap),
    "seq_mis": lambda b, c: seq_mis(b, c.seq_mis_low, c.seq_mis_high),
    "geo_rs": lambda b, c: geo_rs(b, c.geo_rs_low, c.geo_rs_high),
    "opsm": lambda b, c: opsm(b, c.opsm_delta),
    "adv_mask": lambda b, c: adv_mask(b, c.adv_mask_threshold),
    "triage": lambda b, c: triage(b, c.triage),
}


@dataclass(frozen=True)
class CorrectionConfig:
    """Which correction (`name`, a key of CORRECTIONS) and the parameters of every correction."""

    name: str = "none"
    tis_cap: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_tis_cap: float = 2.0
    seq_mis_low: float = 0.5
    seq_mis_high: float = 2.0
    geo_rs_low: float = 0.999
    geo_rs_high: float = 1.001
    opsm_delta: float = 1e-4
    adv_mask_threshold: float = 0.2
    triage: TriageConfig = field(default_factory=TriageConfig)

    def __post_init__(self):
        if self.name not in CORRECTIONS:
            raise ValueError(f"name={self.name!r} is not a correction; choose one of {sorted(CORRECTIONS)}")
        for cap in ("tis_cap", "seq_tis_cap"):
            if not getattr(self, cap) > 0:
                raise ValueError(f"{cap} must be > 0, got {getattr(self, cap)}")
        for lo, hi in (("icepop_low", "icepop_high"), ("seq_mis_low", "seq_mis_high"),
                       ("geo_rs_low", "geo_rs_high")):
            if not 0 <= getattr(self, lo) < getattr(self, hi):
                raise ValueError(f"need 0 <= {lo} < {hi}, got {lo}={getattr(self, lo)}, "
                                 f"{hi}={getattr(self, hi)}")
        if not self.opsm_delta >= 0:
            raise ValueError(f"opsm_delta must be >= 0, got {self.opsm_delta}")
        if not self.adv_mask_threshold >= 0:
            raise ValueError(f"adv_mask_threshold must be >= 0, got {self.adv_mask_threshold}")
        if not isinstance(self.triage, TriageConfig):
            raise ValueError(f"triage must be a TriageConfig, got {type(self.triage).__name__}")


def apply_correction(batch: RLBatch, cfg: CorrectionConfig) -> Correction:
    """Run the configured correction and add `correction/keep_frac` and `correction/mean_weight`."""
    out = CORRECTIONS[cfg.name](batch, cfg)
    metrics = dict(out.metrics)
    metrics["correction/keep_frac"] = masked_mean(out.keep, batch.mask)
    metrics["correction/mean_weight"] = masked_mean(out.coefficients(), batch.mask)
    return Correction(out.weights.detach(), out.keep, metrics)


def _per_token(seq_values: Tensor, batch: RLBatch) -> Tensor:
    return seq_values[:, None].expand(batch.shape).contiguous()  # [B, T]


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf
