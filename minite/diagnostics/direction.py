"""Direction analysis (the TRIAGE diagnosis) of a learner-sampler gap, given the update's advantages.

With g_t = log pi(y_t) - log mu(y_t) and advantage A per response token (definitions and defaults in
`minite.rl.triage` and docs/triage.md, whose functions this module reuses):

    share_<region>      share of response tokens in amp_pos, amp_neg, contracting, neutral
    mass_<region>       sum over the region's tokens of |A g| (neutral tokens included for completeness)
    imbalance           (M_- + 1e-12) / (M_+ + 1e-12), as `triage/imbalance`; > 1: the negative side dominates
    tau                 tail threshold max(tail_floor, q-quantile of |g|)
    tail_frac           share of response tokens with |g| >= tau
    tail_concentration  share of tail tokens in the top `top_segment_frac` of segments (by tail count)
    flagged_segment_frac  share of segments holding >= min_tail_tokens amplifying tail tokens
    segment_profile     per segment position k (response tokens k*L .. (k+1)*L - 1, all responses
                        together): response tokens, tail tokens, amplifying tail tokens, mean |g|

`heatmap_rows` picks the responses with the largest total |g| for a token heat-map.
"""

from __future__ import annotations

import torch
from torch import Tensor

from minite.rl.triage import (
    AMP_NEG,
    AMP_POS,
    REGION_NAMES,
    TriageConfig,
    regions,
    segment_index,
    segment_sums,
    tail_concentration,
    tail_threshold,
)

TINY = 1e-12  # as triage/imbalance


def _token_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    a = advantages.float()
    if a.shape == mask.shape[:1]:
        a = a[:, None].expand(mask.shape)
    if a.shape != mask.shape:
        raise ValueError(f"advantages must be [B] or [B, T]={tuple(mask.shape)}, "
                         f"got {tuple(advantages.shape)}")
    return torch.where(mask, a, 0.0)


def direction(gap: Tensor, advantages: Tensor, mask: Tensor, cfg: TriageConfig | None = None) -> dict:
    """Region shares and masses, imbalance, tails and their spread over segments (module docstring).

    Args:
        gap: g = log pi - log mu, [B, T] (any value off the response).
        advantages: [B] per response or [B, T] per token.
        mask: [B, T] True on response tokens.
    """
    if gap.shape != mask.shape or gap.dim() != 2:
        raise ValueError(f"gap and mask must both be [B, T]; got {tuple(gap.shape)} and {tuple(mask.shape)}")
    cfg = cfg or TriageConfig()
    mask = mask.bool()
    if not mask.any():
        raise ValueError("mask selects no response token")
    g = torch.where(mask, gap.double(), 0.0)
    a = _token_advantages(advantages, mask).double()
    region = regions(g, a, mask, cfg.eps)
    mass = (a * g).abs()
    n = mask.sum().item()
    out: dict = {"n_tokens": int(n)}
    for code, name in REGION_NAMES.items():
        sel = region == code
        out[f"share_{name}"] = sel.sum().item() / n
        out[f"mass_{name}"] = torch.where(sel, mass, 0.0).sum().item()
    m_pos, m_neg = out["mass_amp_pos"], out["mass_amp_neg"]
    out["imbalance"] = (m_neg + TINY) / (m_pos + TINY)
    out["dominant"] = "none" if max(m_pos, m_neg) == 0 else ("amp_pos" if m_pos >= m_neg else "amp_neg")

    abs_g = g.abs()
    tau = tail_threshold(abs_g, mask, cfg.tail_quantile, cfg.tail_floor)
    tail = mask & (abs_g >= tau)
    amp = (region == AMP_POS) | (region == AMP_NEG)
    seg, n_seg = segment_index(mask, cfg.segment_len)
    total = mask.shape[0] * n_seg
    seg_tokens = segment_sums(mask.float(), seg, total)
    seg_tail = segment_sums(tail.float(), seg, total)
    seg_amp_tail = segment_sums((tail & amp).float(), seg, total)
    n_segments = int((seg_tokens > 0).sum())
    out |= {
        "tau": float(tau),
        "tail_frac": tail.sum().item() / n,
        "amp_tail_frac": (tail & amp).sum().item() / n,
        "tail_concentration": float(tail_concentration(seg_tail, n_segments, cfg.top_segment_frac)),
        "flagged_segment_frac": (seg_amp_tail >= cfg.min_tail_tokens).sum().item() / max(1, n_segments),
        "n_segments": n_segments,
        "segment_len": cfg.segment_len,
    }
    by_pos = lambda v: v.view(mask.shape[0], n_seg).sum(0)  # [S]
    tokens_pos = by_pos(seg_tokens)
    abs_pos = by_pos(segment_sums(abs_g, seg, total))
    out["segment_profile"] = [
        {"segment": k, "tokens": int(tokens_pos[k]), "tail": int(by_pos(seg_tail)[k]),
         "amp_tail": int(by_pos(seg_amp_tail)[k]),
         "mean_abs_gap": float(abs_pos[k] / tokens_pos[k]) if tokens_pos[k] > 0 else 0.0}
        for k in range(n_seg)]
    return out


def heatmap_rows(gap: Tensor, mask: Tensor, tokens: Tensor, decode, advantages: Tensor | None = None,
                 n: int = 4) -> list[dict]:
    """The `n` responses with the largest total |g|: their response tokens (as text, via
    `decode(id) -> str`), gaps and advantage. tokens [B, T] are the target ids aligned with gap."""
    total = torch.where(mask, gap.abs(), 0.0).sum(-1)
    rows = []
    for b in total.argsort(descending=True)[:n].tolist():
        sel = mask[b]
        rows.append({"row": b, "tokens": [decode(int(t)) for t in tokens[b][sel]],
                     "gap": [float(x) for x in gap[b][sel]],
                     "advantage": None if advantages is None else float(advantages[b].float().mean())})
    return rows
