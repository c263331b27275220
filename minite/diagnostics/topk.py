"""Distribution-level learner-vs-sampler metrics over the sampler's top-k log-probs per position.

Where a rollout file carries the engine's top-k (`top_token_ids`, `top_logprobs`;
`minite.diagnostics.rollouts`), each response position t has the sampler's set S_t with mu(i), and
the learner gives its whole processed distribution pi(.) at t (same temperature / top-k / top-p).
Over the positions with a set (fp64):

    topk_mass_sampler   = mean_t sum_{i in S_t} mu(i)
    topk_mass_learner   = mean_t sum_{i in S_t} pi(i)             (the learner's mass on the same ids)
    topk_tv             = mean_t 1/2 sum_{i in S_t} |mu(i) - pi(i)|  (total variation on S_t: a lower
                                                                 bound of the full distributions')
    topk_kl             = mean_t sum_{i in S_t} mu(i) (log mu(i) - log pi(i))   (KL(mu || pi)'s terms
                                                                 on S_t; the rest of the sum is missing)
    topk_overlap        = mean_t |S_t & L_t| / |S_t|, L_t the learner's |S_t| most likely ids
    top1_agree          = share of positions whose most likely id is the same on both sides

Ids outside the learner's support (log pi = -inf under its top-k / top-p cut) are counted in
`topk_outside_learner_support` and left out of the mass, TV and KL terms.
"""

from __future__ import annotations

import torch

from minite.diagnostics.localize import Sequences, Side, side_logits
from minite.diagnostics.rollouts import Rollout
from minite.sampling import processed_logprobs

TOPK_METRICS = ("topk_mass_sampler", "topk_mass_learner", "topk_tv", "topk_kl", "topk_overlap", "top1_agree")


def has_topk(rollouts: list[Rollout]) -> bool:
    return any(r.top_token_ids for r in rollouts)


@torch.no_grad()
def learner_distributions(model, side: Side, rollouts: list[Rollout], temperature: float, top_k: int = 0,
                          top_p: float = 1.0) -> list[torch.Tensor]:
    """The learner side's processed log-probs [R_i, V] (fp32, CPU) at each record's response positions."""
    seqs = Sequences([r.prompt_token_ids + r.response_token_ids for r in rollouts],
                     [len(r.prompt_token_ids) for r in rollouts])
    out = []
    for lg, r in zip(side_logits(model, side, seqs), rollouts):
        p, n = len(r.prompt_token_ids), len(r.response_token_ids)
        out.append(processed_logprobs(lg[p - 1: p - 1 + n], temperature, top_k, top_p).cpu())
    return out


def topk_metrics(learner: list[torch.Tensor], rollouts: list[Rollout]) -> dict:
    """The module docstring's metrics; `n_positions` counts the positions with a top-k set."""
    sums = dict.fromkeys(TOPK_METRICS, 0.0)
    positions = outside = 0
    for lp, r in zip(learner, rollouts):
        if not r.top_token_ids:
            continue
        for t, (ids, mus) in enumerate(zip(r.top_token_ids, r.top_logprobs)):
            if not ids:
                continue
            positions += 1
            row = lp[t].double()
            ids_t = torch.tensor(ids, dtype=torch.long)
            log_mu, log_pi = torch.tensor(mus, dtype=torch.float64), row[ids_t]
            ok = torch.isfinite(log_pi)
            outside += int((~ok).sum())
            mu, pi = log_mu.exp(), torch.where(ok, log_pi, -torch.inf).exp()
            sums["topk_mass_sampler"] += float(mu.sum())
            sums["topk_mass_learner"] += float(pi.sum())
            sums["topk_tv"] += 0.5 * float((mu - pi)[ok].abs().sum())
            sums["topk_kl"] += float((mu * (log_mu - log_pi))[ok].sum())
            learner_top = torch.topk(row, len(ids)).indices
            sums["topk_overlap"] += len(set(ids) & set(learner_top.tolist())) / len(ids)
            sums["top1_agree"] += float(ids[int(torch.argmax(log_mu))] == int(learner_top[0]))
    if not positions:
        return {"n_positions": 0}
    return {**{k: v / positions for k, v in sums.items()}, "n_positions": positions,
            "topk_outside_learner_support": outside}
