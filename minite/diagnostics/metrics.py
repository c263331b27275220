"""Token-level learner-vs-sampler mismatch metrics (verl's `rollout_corr/*` names; docs/facts.md).

Inputs are per-token log-probs of the same sampled tokens under the learner (pi) and the sampler (mu),
shaped [..., T] (leading dims are sequences), and a mask of the tokens that count (response tokens).
Masked-out positions never enter any metric and may hold anything (padding, -inf, NaN). Everything is
computed in float64. With g_t = log pi_t - log mu_t and rho_t = exp(g_t), over the N unmasked tokens:

    kl                 = mean_t(log mu_t - log pi_t) = -mean_t g_t     (k1 estimate of KL(mu || pi))
    k3_kl              = mean_t(rho_t - g_t - 1)                       (k3 estimate, >= 0)
    chi2_token         = mean_t(rho_t^2) - 1
    ess                = 1 / mean_t(w~_t^2), w~ = rho / mean_t(rho)    (token level, in (0, 1])
                       = mean_t(rho)^2 / mean_t(rho^2)

Perplexities are per sequence first, then averaged over the S sequences that have unmasked tokens:

    training_ppl       = mean_s exp(-mean_{t in s} log pi_t)
    rollout_ppl        = mean_s exp(-mean_{t in s} log mu_t)
    log_ppl_diff       = mean_s d_s,   d_s = mean_{t in s} log mu_t - mean_{t in s} log pi_t
                                           = log training_ppl_s - log rollout_ppl_s
    log_ppl_abs_diff   = mean_s |d_s|
    ppl_ratio          = mean_s exp(d_s) = mean_s training_ppl_s / rollout_ppl_s

Probabilities (given, or exp of the log-probs) p_pi, p_mu:

    prob_diff_mean     = mean_t(p_pi - p_mu)      prob_abs_diff_mean = mean_t |p_pi - p_mu|
    prob_pearson       = Pearson correlation of p_pi and p_mu over tokens (NaN if either is constant)

Log-prob differences: `logprob_abs_diff_mean` (slime's train_rollout_logprob_abs_diff), `_max`, and the
quantiles `_p50`, `_p90`, `_p99`, `_p999` of |g_t| (linear interpolation between order statistics,
as numpy's default). `bitwise_equal_frac`: share of tokens whose two log-probs have identical bits
(compared in the inputs' dtype when both share one, else by value). `n_tokens` = N, `n_sequences` = S.
"""

import math

import torch

METRIC_NAMES = (
    "kl", "k3_kl", "training_ppl", "rollout_ppl", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio",
    "chi2_token", "ess", "prob_diff_mean", "prob_abs_diff_mean", "prob_pearson", "logprob_abs_diff_mean",
    "logprob_abs_diff_max", "logprob_abs_diff_p50", "logprob_abs_diff_p90", "logprob_abs_diff_p99",
    "logprob_abs_diff_p999", "bitwise_equal_frac", "n_tokens", "n_sequences",
)
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "p999": 0.999}

_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def quantile(sorted_values: torch.Tensor, q: float) -> float:
    """q-quantile of an ascending 1-D tensor, linear interpolation (no size limit, unlike torch.quantile)."""
    pos = q * (sorted_values.numel() - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    a, b = sorted_values[lo].item(), sorted_values[hi].item()
    return a + (b - a) * (pos - lo)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype == b.dtype and a.dtype in _INT_VIEW:
        return a.view(_INT_VIEW[a.dtype]) == b.view(_INT_VIEW[b.dtype])
    return a.double() == b.double()


def _check(name: str, t: torch.Tensor, shape: torch.Size, mask: torch.Tensor) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} (as learner_logprobs)")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    bad = ~torch.isfinite(t) & mask
    if bad.any():
        raise ValueError(f"{name} is non-finite at {int(bad.sum())} unmasked token(s), e.g. index "
                         f"{tuple(bad.nonzero()[0].tolist())}")


def mismatch_metrics(learner_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                     mask: torch.Tensor | None = None, learner_probs: torch.Tensor | None = None,
                     sampler_probs: torch.Tensor | None = None) -> dict[str, float]:
    """Mismatch metrics of the unmasked tokens (definitions in the module docstring).

    Args:
        learner_logprobs: log pi of the sampled tokens, [..., T] float.
        sampler_logprobs: log mu of the same tokens, same shape.
        mask: nonzero/True for tokens that count, same shape; None means all tokens.
        learner_probs, sampler_probs: optional per-token probabilities for the probability metrics
            (default: exp of the log-probs).

    Returns:
        dict of Python floats keyed by `METRIC_NAMES`.
    """
    shape = learner_logprobs.shape
    if learner_logprobs.dim() == 0:
        raise ValueError("learner_logprobs must have at least one (token) dimension")
    if mask is None:
        mask = torch.ones(shape, dtype=torch.bool, device=learner_logprobs.device)
    if mask.shape != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(shape)} (as learner_logprobs)")
    mask = mask != 0
    if not mask.any():
        raise ValueError("mask selects no tokens: mismatch metrics need at least one unmasked token")
    _check("learner_logprobs", learner_logprobs, shape, mask)
    _check("sampler_logprobs", sampler_logprobs, shape, mask)
    for name, p in (("learner_probs", learner_probs), ("sampler_probs", sampler_probs)):
        if p is not None:
            _check(name, p, shape, mask)

    lp = torch.where(mask, learner_logprobs.double(), 0.0).reshape(-1, shape[-1])
    lm = torch.where(mask, sampler_logprobs.double(), 0.0).reshape(-1, shape[-1])
    m2 = mask.reshape(-1, shape[-1])
    g = (lp - lm)[m2]  # [N]
    rho = torch.exp(g)
    n = g.numel()

    counts = m2.sum(-1)
    has = counts > 0
    mean_lp = (lp.sum(-1)[has] / counts[has])  # [S]
    mean_lm = (lm.sum(-1)[has] / counts[has])
    d = mean_lm - mean_lp

    p_pi = (learner_probs.double()[mask] if learner_probs is not None else torch.exp(lp[m2]))
    p_mu = (sampler_probs.double()[mask] if sampler_probs is not None else torch.exp(lm[m2]))
    dp = p_pi - p_mu
    x, y = p_pi - p_pi.mean(), p_mu - p_mu.mean()
    sx, sy = x.pow(2).sum().sqrt(), y.pow(2).sum().sqrt()
    pearson = (x * y).sum() / (sx * sy) if sx > 0 and sy > 0 else float("nan")

    abs_g = g.abs().sort().values
    mean_rho, mean_rho2 = rho.mean(), rho.pow(2).mean()
    out = {
        "kl": -g.mean(),
        "k3_kl": (rho - g - 1).mean(),
        "training_ppl": torch.exp(-mean_lp).mean(),
        "rollout_ppl": torch.exp(-mean_lm).mean(),
        "log_ppl_diff": d.mean(),
        "log_ppl_abs_diff": d.abs().mean(),
        "ppl_ratio": torch.exp(d).mean(),
        "chi2_token": mean_rho2 - 1,
        "ess": mean_rho**2 / mean_rho2,
        "prob_diff_mean": dp.mean(),
        "prob_abs_diff_mean": dp.abs().mean(),
        "prob_pearson": pearson,
        "logprob_abs_diff_mean": abs_g.mean(),
        "logprob_abs_diff_max": abs_g[-1],
        **{f"logprob_abs_diff_{k}": quantile(abs_g, q) for k, q in QUANTILES.items()},
        "bitwise_equal_frac": _bitwise_equal(learner_logprobs[mask], sampler_logprobs[mask]).double().mean(),
        "n_tokens": n,
        "n_sequences": int(has.sum()),
    }
    return {k: float(out[k]) for k in METRIC_NAMES}
