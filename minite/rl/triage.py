"""TRIAGE: direction-aware diagnosis, rebalancing and bounded repair of the learner-sampler gap.

Per response token, with gap g_t = log pi_theta_old(y_t) - log mu(y_t) and advantage A (of the
sequence, or of the token when advantages are per token):

regions (an update with advantage A moves log pi(y_t) in the direction of sign(A)):
    amp_pos      A > 0 and g > eps       (pushes pi further above mu)
    amp_neg      A < 0 and g < -eps      (pushes pi further below mu)
    contracting  A * g < 0 and |g| > eps
    neutral      |g| <= eps or A = 0
masses: M_+ = sum_{amp_pos} |A g|, M_- = sum_{amp_neg} |A g|, M_c = sum_{contracting} |A g| (batch sums).

tail tokens: |g| >= tau, tau = max(tail_floor, quantile_q(|g| over the batch's response tokens)),
    with the linearly interpolated quantile (torch.quantile's default).
segments: each response is cut into consecutive segments of L = segment_len response tokens (counted
    over mask == True positions, so a prompt prefix and padding do not shift them; the last may be
    shorter). A segment is flagged when it holds >= k = min_tail_tokens amplifying tail tokens.
    tail concentration = share of all tail tokens that lie in the top ceil(top_segment_frac * #segments)
    segments ranked by tail-token count (about top_segment_frac when tails are spread evenly, 1 when
    they all sit in so few segments).
rebalancing: major = the amplifying region with the larger mass, minor the other;
    w_reb = clip((M_minor / M_major) ** beta, w_min, 1) for the major region's tokens in flagged
    segments, 1 for every other token (w_reb = 1 when M_major = 0).
bounded repair: tokens with |g| > severe get w_rep = clip(exp(g), 1 / cap, cap), others 1.
weight w_t = w_reb * w_rep (stop-gradient); TRIAGE never rejects a token (keep = mask).
Switches: rebalance=False gives repair-only, repair=False rebalance-only; both False keeps the
metrics and leaves every weight at 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from minite.rl.batch import Correction, RLBatch, masked_mean

PAD, NEUTRAL, AMP_POS, AMP_NEG, CONTRACTING = -1, 0, 1, 2, 3
REGION_NAMES = {NEUTRAL: "neutral", AMP_POS: "amp_pos", AMP_NEG: "amp_neg", CONTRACTING: "contracting"}
_TINY = 1e-12


@dataclass(frozen=True)
class TriageConfig:
    """Defaults and their reasons are in docs/triage.md."""

    eps: float = 1e-3
    tail_quantile: float = 0.99
    tail_floor: float = 0.05
    segment_len: int = 32
    min_tail_tokens: int = 2
    top_segment_frac: float = 0.1
    beta: float = 0.5
    w_min: float = 0.25
    severe: float = math.log(2.0)
    cap: float = 4.0
    rebalance: bool = True
    repair: bool = True

    def __post_init__(self):
        checks = {
            "eps": self.eps >= 0,
            "tail_quantile": 0 <= self.tail_quantile <= 1,
            "tail_floor": self.tail_floor > 0,
            "segment_len": isinstance(self.segment_len, int) and self.segment_len >= 1,
            "min_tail_tokens": isinstance(self.min_tail_tokens, int) and self.min_tail_tokens >= 1,
            "top_segment_frac": 0 < self.top_segment_frac <= 1,
            "beta": self.beta >= 0,
            "w_min": 0 < self.w_min <= 1,
            "severe": self.severe >= 0,
            "cap": self.cap >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"TriageConfig.{name}={getattr(self, name)!r} is out of range "
                                 "(see docs/triage.md)")


def regions(g: Tensor, a: Tensor, mask: Tensor, eps: float) -> Tensor:
    """Region code per token (PAD off the response); g, a, mask [B, T]."""
    code = lambda c: torch.tensor(c, dtype=torch.int8, device=g.device)
    out = torch.where((g.abs() > eps) & (a * g < 0), code(CONTRACTING), code(NEUTRAL))
    out = torch.where((a > 0) & (g > eps), code(AMP_POS), out)
    out = torch.where((a < 0) & (g < -eps), code(AMP_NEG), out)
    return torch.where(mask, out, code(PAD))  # [B, T] int8


def tail_threshold(abs_g: Tensor, mask: Tensor, q: float, floor: float) -> Tensor:
    """tau = max(floor, linear-interpolated q-quantile of |g| over response tokens); 0-dim."""
    values = abs_g[mask].float().sort().values
    if values.numel() == 0:
        return torch.tensor(floor, device=abs_g.device)
    pos = q * (values.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    quantile = values[lo] + (values[hi] - values[lo]) * (pos - lo)
    return quantile.clamp(min=floor)


def segment_index(mask: Tensor, segment_len: int) -> tuple[Tensor, int]:
    """Flat segment id b * S + (response position // L) per token (-1 off the response), and S."""
    n_seg = max(1, math.ceil(mask.shape[1] / segment_len))
    pos = mask.long().cumsum(dim=1) - 1  # [B, T] position among the row's response tokens
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None]
    flat = rows * n_seg + torch.div(pos, segment_len, rounding_mode="floor")
    return torch.where(mask, flat, -1), n_seg  # [B, T] int64


def segment_sums(values: Tensor, seg: Tensor, n_total: int) -> Tensor:
    """Sum of values per flat segment id (ids < 0 ignored)."""
    v = torch.where(seg >= 0, values.float(), 0.0)
    out = torch.zeros(n_total, dtype=torch.float32, device=values.device)
    return out.index_add_(0, seg.clamp(min=0).flatten(), v.flatten())  # [B * S]


def triage(batch: RLBatch, cfg: TriageConfig = TriageConfig()) -> Correction:
    mask = batch.mask
    g, a = batch.gap(), batch.token_advantages()  # [B, T] each, 0 off the response
    region = regions(g, a, mask, cfg.eps)
    amp = (region == AMP_POS) | (region == AMP_NEG)
    mass = (a * g).abs()
    m_pos, m_neg, m_con = (torch.where(region == r, mass, 0.0).sum() for r in (AMP_POS, AMP_NEG, CONTRACTING))

    tau = tail_threshold(g.abs(), mask, cfg.tail_quantile, cfg.tail_floor)
    tail = mask & (g.abs() >= tau)
    seg, n_seg = segment_index(mask, cfg.segment_len)
    n_total = mask.shape[0] * n_seg
    seg_tokens = segment_sums(mask.float(), seg, n_total)  # [B * S]
    seg_tail = segment_sums(tail.float(), seg, n_total)
    flagged_seg = segment_sums((tail & amp).float(), seg, n_total) >= cfg.min_tail_tokens
    in_flagged = mask & flagged_seg[seg.clamp(min=0)]  # [B, T]

    pos_major = m_pos >= m_neg
    major, minor = torch.where(pos_major, m_pos, m_neg), torch.where(pos_major, m_neg, m_pos)
    ratio = torch.where(major > 0, minor / major.clamp(min=_TINY), torch.ones_like(major))
    w_reb = (ratio ** cfg.beta).clamp(cfg.w_min, 1.0)
    dominant = torch.where(pos_major, AMP_POS, AMP_NEG).to(region.dtype)
    down = in_flagged & (region == dominant) & (major > 0) & (w_reb < 1)

    severe = mask & (g.abs() > cfg.severe)
    w_rep = torch.exp(g).clamp(1.0 / cfg.cap, cfg.cap)  # [B, T]

    one = torch.ones_like(g)
    weights = one
    if cfg.rebalance:
        weights = weights * torch.where(down, w_reb, one)
    if cfg.repair:
        weights = weights * torch.where(severe, w_rep, one)
    weights = torch.where(mask, weights, one).detach()

    n_segments = (seg_tokens > 0).sum()
    zero = torch.zeros((), device=g.device)
    metrics = {f"triage/share_{name}": masked_mean(region == code, mask)
               for code, name in REGION_NAMES.items()}
    metrics |= {
        "triage/mass_amp_pos": m_pos,
        "triage/mass_amp_neg": m_neg,
        "triage/mass_contracting": m_con,
        "triage/imbalance": (m_neg + _TINY) / (m_pos + _TINY),
        "triage/dominant": torch.where(major > 0, torch.where(pos_major, 1.0, -1.0), 0.0),
        "triage/tau": tau,
        "triage/tail_frac": masked_mean(tail, mask),
        "triage/amp_tail_frac": masked_mean(tail & amp, mask),
        "triage/flagged_segment_frac": flagged_seg.sum() / n_segments.clamp(min=1),
        "triage/tail_concentration": tail_concentration(seg_tail, int(n_segments), cfg.top_segment_frac),
        "triage/rebalance_weight": w_reb,
        "triage/rebalanced_frac": masked_mean(down, mask) if cfg.rebalance else zero,
        "triage/severe_frac": masked_mean(severe, mask),
        "triage/repaired_frac": masked_mean(severe, mask) if cfg.repair else zero,
        "triage/mean_weight": masked_mean(weights, mask),
    }
    return Correction(weights, mask.clone(), {k: v.detach().float() for k, v in metrics.items()})


def tail_concentration(seg_tail: Tensor, n_segments: int, top_frac: float) -> Tensor:
    """Share of tail tokens in the ceil(top_frac * n_segments) segments holding the most of them."""
    total = seg_tail.sum()
    top = max(1, math.ceil(round(top_frac * n_segments, 9)))
    best = seg_tail.sort(descending=True).values[:top].sum()
    return torch.where(total > 0, best / total.clamp(min=1), torch.zeros_like(total))
