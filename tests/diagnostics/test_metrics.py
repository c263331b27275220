import math

import pytest
import torch

from minite.diagnostics.metrics import METRIC_NAMES, mismatch_metrics

TOL = 1e-12


def test_identical_logprobs_have_no_gap():
    lp = torch.log(torch.rand(3, 7, dtype=torch.float32) * 0.9 + 0.05)
    m = mismatch_metrics(lp, lp.clone(), torch.ones(3, 7))
    assert tuple(m) == METRIC_NAMES
    assert all(isinstance(v, float) for v in m.values())
    for k in ("kl", "k3_kl", "chi2_token", "log_ppl_diff", "log_ppl_abs_diff", "prob_diff_mean",
              "prob_abs_diff_mean", "logprob_abs_diff_mean", "logprob_abs_diff_max", "logprob_abs_diff_p999"):
        assert m[k] == 0.0, k
    assert m["ess"] == 1.0
    assert m["ppl_ratio"] == 1.0
    assert m["bitwise_equal_frac"] == 1.0
    assert m["training_ppl"] == m["rollout_ppl"]
    assert m["prob_pearson"] == pytest.approx(1.0, abs=TOL)
    assert (m["n_tokens"], m["n_sequences"]) == (21.0, 3.0)


@pytest.mark.parametrize("c", [0.25, -0.5])
def test_constant_shift_gives_known_kl_k3_chi2(c):
    mu = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.3]], dtype=torch.float64))
    pi = mu + c
    m = mismatch_metrics(pi, mu, torch.ones_like(mu, dtype=torch.bool))
    assert m["kl"] == pytest.approx(-c, abs=TOL)
    assert m["k3_kl"] == pytest.approx(math.exp(c) - c - 1, abs=TOL)
    assert m["chi2_token"] == pytest.approx(math.exp(2 * c) - 1, abs=TOL)
    assert m["ess"] == pytest.approx(1.0, abs=TOL)
    assert m["log_ppl_diff"] == pytest.approx(-c, abs=TOL)
    assert m["log_ppl_abs_diff"] == pytest.approx(abs(c), abs=TOL)
    assert m["ppl_ratio"] == pytest.approx(math.exp(-c), abs=TOL)
    assert m["training_ppl"] == pytest.approx(m["rollout_ppl"] * math.exp(-c), rel=TOL)
    for q in ("p50", "p90", "p99", "p999"):
        assert m[f"logprob_abs_diff_{q}"] == pytest.approx(abs(c), abs=TOL)
    assert m["logprob_abs_diff_max"] == pytest.approx(abs(c), abs=TOL)
    assert m["bitwise_equal_frac"] == 0.0


def test_two_point_ess_and_correlation():
    # rho = 1 on one token, 3 on the other: ESS = mean(rho)^2 / mean(rho^2) = 4 / 5.
    mu = torch.tensor([math.log(0.1), math.log(0.2)], dtype=torch.float64)
    pi = mu + torch.tensor([0.0, math.log(3.0)], dtype=torch.float64)
    m = mismatch_metrics(pi, mu)
    assert m["ess"] == pytest.approx(0.8, abs=TOL)
    assert m["chi2_token"] == pytest.approx(5.0 - 1.0, abs=TOL)
    assert m["prob_pearson"] == pytest.approx(1.0, abs=TOL)  # p_pi = (0.1, 0.6), p_mu = (0.1, 0.2)
    assert m["prob_diff_mean"] == pytest.approx(0.2, abs=TOL)
    anti = mismatch_metrics(pi, mu, learner_probs=torch.tensor([0.3, 0.1]),
                            sampler_probs=torch.tensor([0.1, 0.3]))
    assert anti["prob_pearson"] == pytest.approx(-1.0, abs=1e-7)


def test_pearson_three_points_and_constant():
    lp = torch.zeros(3)
    m = mismatch_metrics(lp, lp, learner_probs=torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64),
                         sampler_probs=torch.tensor([0.1, 0.3, 0.2], dtype=torch.float64))
    assert m["prob_pearson"] == pytest.approx(0.5, abs=TOL)
    assert math.isnan(mismatch_metrics(lp, lp)["prob_pearson"])  # constant probabilities


def test_masked_tokens_never_count():
    pi = torch.tensor([[-1.0, -1.0, float("nan")], [-2.0, -float("inf"), 7.0], [5.0, 5.0, 5.0]])
    mu = torch.tensor([[-1.5, -0.5, 3.0], [-2.0, 0.0, float("nan")], [1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    m = mismatch_metrics(pi, mu, mask)
    ref = mismatch_metrics(torch.tensor([-1.0, -1.0, -2.0]), torch.tensor([-1.5, -0.5, -2.0]))
    for k in ("kl", "k3_kl", "chi2_token", "ess", "prob_diff_mean", "logprob_abs_diff_max",
              "bitwise_equal_frac"):
        assert m[k] == pytest.approx(ref[k], abs=TOL), k
    assert (m["n_tokens"], m["n_sequences"]) == (3.0, 2.0)
    # Per-sequence perplexities: sequence means of log pi are -1 and -2.
    assert m["training_ppl"] == pytest.approx((math.e + math.e**2) / 2, rel=TOL)
    assert m["rollout_ppl"] == pytest.approx((math.e + math.e**2) / 2, rel=TOL)
    assert m["bitwise_equal_frac"] == pytest.approx(1 / 3, abs=TOL)


def test_quantiles_of_abs_gap():
    g = torch.arange(1001, dtype=torch.float64) / 1000
    m = mismatch_metrics(-g, torch.zeros_like(g))
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
        assert m[f"logprob_abs_diff_{name}"] == pytest.approx(q, abs=TOL)
    assert m["logprob_abs_diff_max"] == 1.0
    assert m["logprob_abs_diff_mean"] == pytest.approx(0.5, abs=TOL)


def test_bitwise_equal_is_bitwise():
    a = torch.tensor([-0.5, -1.25, 0.0, -3.0], dtype=torch.bfloat16)
    b = a.clone()
    b[2] = -0.0  # equal as numbers, different bits
    b[3] = -2.984375  # one bf16 ulp from -3
    assert mismatch_metrics(a, b)["bitwise_equal_frac"] == 0.5
    assert mismatch_metrics(a.float(), b.double())["bitwise_equal_frac"] == 0.75  # mixed dtypes: by value


def test_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="no tokens"):
        mismatch_metrics(x, x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="shape"):
        mismatch_metrics(x, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="mask has shape"):
        mismatch_metrics(x, x, torch.ones(3))
    with pytest.raises(ValueError, match="sampler_logprobs is non-finite"):
        mismatch_metrics(x, torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(TypeError, match="floating-point"):
        mismatch_metrics(x, torch.zeros(2, 3, dtype=torch.long))
