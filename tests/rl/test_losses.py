import math

import pytest
import torch

from minite.rl.batch import Correction, RLBatch
from minite.rl.corrections import CorrectionConfig, apply_correction, icepop, token_tis
from minite.rl.losses import LossConfig, aggregate, loss_with_correction, policy_loss

OLD_LP = -1.0


def make_batch(ratios, adv, sampler_gap=None, ref_delta=None, garbage=5.0e3):
    """Rows of current/old ratios (one per response token) + one padded position of finite garbage."""
    b, t = len(ratios), max(len(r) for r in ratios) + 1
    mask = torch.zeros(b, t, dtype=torch.bool)
    log_r = torch.full((b, t), garbage)
    for i, row in enumerate(ratios):
        mask[i, : len(row)] = True
        log_r[i, : len(row)] = torch.tensor([math.log(r) for r in row])
    old = torch.where(mask, OLD_LP, -garbage)
    lp = (old + log_r).requires_grad_()
    sampler = old - (0.0 if sampler_gap is None else sampler_gap)
    ref = None if ref_delta is None else torch.where(mask, lp.detach() + ref_delta, garbage)
    return RLBatch(lp, old, torch.where(mask, sampler, garbage), mask, torch.as_tensor(adv), ref)


def grad_of(loss, batch):
    (grad,) = torch.autograd.grad(loss, batch.logprobs)
    return grad


def test_token_mean_vs_seq_mean_known_values():
    # ratio 1: per-token pg = -A; row 0 has 3 tokens with A = 1, row 1 one token with A = -1
    batch = make_batch([[1.0, 1.0, 1.0], [1.0]], [1.0, -1.0])
    tok, _ = policy_loss(batch, LossConfig(aggregation="token_mean"))
    seq, _ = policy_loss(batch, LossConfig(aggregation="seq_mean"))
    assert float(tok.detach()) == pytest.approx((-3 + 1) / 4)
    assert float(seq.detach()) == pytest.approx((-1 + 1) / 2)
    # gradients: token_mean d/dlp_t = -A r / 4; seq_mean = -A r / (2 * len_row)
    g_tok = grad_of(policy_loss(batch, LossConfig(aggregation="token_mean"))[0], batch)
    g_seq = grad_of(policy_loss(batch, LossConfig(aggregation="seq_mean"))[0], batch)
    torch.testing.assert_close(g_tok[batch.mask], torch.tensor([-0.25, -0.25, -0.25, 0.25]))
    torch.testing.assert_close(g_seq[batch.mask], torch.tensor([-1 / 6, -1 / 6, -1 / 6, 0.5]))


def test_aggregate_skips_empty_rows_and_rejects_unknown():
    values = torch.tensor([[2.0, 4.0], [7.0, 7.0], [1.0, 9.0]])
    mask = torch.tensor([[True, True], [False, False], [True, False]])
    assert float(aggregate(values, mask, "seq_mean")) == pytest.approx((3.0 + 1.0) / 2)
    assert float(aggregate(values, mask, "token_mean")) == pytest.approx(7.0 / 3)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(values, mask, "sum")


@pytest.mark.parametrize("ratio,adv,clipped", [
    (1.2 - 1e-3, 1.0, False), (1.2 + 1e-3, 1.0, True),    # A > 0: clipped above 1 + eps_high
    (0.8 + 1e-3, -1.0, False), (0.8 - 1e-3, -1.0, True),  # A < 0: clipped below 1 - eps_low
    (0.5, 1.0, False), (1.5, -1.0, False),                # the other side is never clipped
])
def test_ppo_clipping_at_the_boundaries(ratio, adv, clipped):
    batch = make_batch([[ratio]], [adv])
    loss, metrics = policy_loss(batch, LossConfig(eps_low=0.2, eps_high=0.2))
    bound = min(max(ratio, 0.8), 1.2)
    assert float(loss.detach()) == pytest.approx(-adv * (bound if clipped else ratio), rel=1e-6)
    expected_grad = 0.0 if clipped else -adv * ratio
    assert float(grad_of(loss, batch)[0, 0]) == pytest.approx(expected_grad, rel=1e-5)
    assert float(metrics["loss/clip_frac"]) == float(clipped)
    side = "loss/clip_high_frac" if adv > 0 else "loss/clip_low_frac"
    assert float(metrics[side]) == float(clipped)


def test_asymmetric_epsilons():
    batch = make_batch([[1.25, 1.35], [0.85, 0.75]], [1.0, -1.0])
    _, metrics = policy_loss(batch, LossConfig(eps_low=0.2, eps_high=0.28))
    # 1.25 < 1.28 unclipped, 1.35 clipped high; 0.85 > 0.8 unclipped, 0.75 clipped low
    assert float(metrics["loss/clip_high_frac"]) == 0.25
    assert float(metrics["loss/clip_low_frac"]) == 0.25


def test_correction_weights_scale_gradient_and_carry_none():
    gaps = torch.tensor([[math.log(3.0), math.log(0.5), 0.0], [math.log(3.0), 0.0, 0.0]])
    batch = make_batch([[1.1, 0.9], [1.0]], [2.0, -1.0], sampler_gap=gaps)
    batch = RLBatch(batch.logprobs, batch.old_logprobs.clone().requires_grad_(),
                    batch.sampler_logprobs.clone().requires_grad_(), batch.mask, batch.advantages)
    loss, _ = policy_loss(batch, LossConfig(), token_tis(batch, cap=2.0))
    loss.backward()
    # weights min(rho, 2): row 0 -> [2, 0.5], row 1 -> [2]; d/dlp = -A r w / 3
    expected = torch.tensor([-2 * 1.1 * 2 / 3, -2 * 0.9 * 0.5 / 3, 1 * 1.0 * 2 / 3])
    torch.testing.assert_close(batch.logprobs.grad[batch.mask], expected)
    assert batch.old_logprobs.grad is None and batch.sampler_logprobs.grad is None
    assert float(loss.detach()) == pytest.approx(float(-(2 * 1.1 * 2 + 2 * 0.9 * 0.5 - 1 * 1.0 * 2) / 3))


def test_rejected_tokens_count_in_denominator():
    batch = make_batch([[1.0, 1.0, 1.0, 1.0]], [1.0], sampler_gap=torch.tensor([[0.0, 0.0, 0.0, 3.0, 0.0]]))
    correction = icepop(batch, low=0.5, high=5.0)  # rho = exp(3) > 5: last token rejected
    loss, metrics = policy_loss(batch, LossConfig(), correction)
    assert float(loss.detach()) == pytest.approx(-3 / 4)
    assert float(metrics["icepop/masked_frac"]) == 0.25


def test_k3_kl_value_and_gradient():
    d = 0.5  # log ref - log pi on both tokens
    batch = make_batch([[1.0, 1.0]], [0.0], ref_delta=d)
    loss, metrics = policy_loss(batch, LossConfig(kl_coef=0.1))
    k3 = math.exp(d) - d - 1
    assert float(metrics["loss/kl"]) == pytest.approx(k3, rel=1e-6)
    assert float(loss.detach()) == pytest.approx(0.1 * k3, rel=1e-6)
    # d k3 / d log pi = 1 - exp(d), averaged over 2 tokens
    expected = torch.full((2,), 0.1 * (1 - math.exp(d)) / 2)
    torch.testing.assert_close(grad_of(loss, batch)[batch.mask], expected)


def test_kl_needs_reference():
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(make_batch([[1.0]], [1.0]), LossConfig(kl_coef=0.1))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_padding_garbage_never_matters(aggregation):
    cfg = LossConfig(kl_coef=0.05, aggregation=aggregation)
    results = []
    for garbage in (5.0e3, -7.0e4):
        batch = make_batch([[1.1, 0.7, 1.3], [0.95]], torch.tensor([[1.0, 1.0, 1.0, garbage], [-1.0] * 4]),
                           sampler_gap=0.3, ref_delta=0.2, garbage=garbage)
        loss, metrics = loss_with_correction(batch, cfg, CorrectionConfig(name="triage"))
        grad = grad_of(loss, batch)
        assert torch.isfinite(grad).all() and torch.isfinite(loss)
        assert torch.equal(grad[~batch.mask], torch.zeros((~batch.mask).sum()))
        results.append((loss.detach(), grad, metrics))
    (l0, g0, m0), (l1, g1, m1) = results
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert all(torch.equal(m0[k], m1[k]) for k in m0)


def test_metrics_are_detached_scalars_with_stable_names():
    batch = make_batch([[1.1, 0.7]], [1.0], ref_delta=0.1)
    _, metrics = policy_loss(batch, LossConfig(kl_coef=0.1), apply_correction(batch, CorrectionConfig("tis")))
    expected = {"loss/total", "loss/pg", "loss/kl", "loss/clip_frac", "loss/clip_high_frac",
                "loss/clip_low_frac", "loss/ratio_mean", "loss/policy_k3", "tis/clip_frac",
                "correction/keep_frac", "correction/mean_weight"}
    assert set(metrics) == expected
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    assert float(metrics["loss/ratio_mean"]) == pytest.approx(0.9, rel=1e-6)


def test_plain_coefficient_correction_matches_no_correction():
    batch = make_batch([[1.1, 0.7], [1.3]], [1.0, -2.0])
    ones = Correction(torch.ones(batch.shape), batch.mask.clone())
    assert torch.equal(policy_loss(batch)[0], policy_loss(batch, correction=ones)[0])


@pytest.mark.parametrize("field,value", [("eps_low", 1.0), ("eps_low", -0.1), ("eps_high", -0.1),
                                         ("aggregation", "sum"), ("kl_coef", -1.0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        LossConfig(**{field: value})


def test_minibatch_rows_of_batch_and_correction():
    batch = make_batch([[1.1, 0.7], [1.3], [0.9, 1.0]], [1.0, -2.0, 0.5], sampler_gap=0.2)
    correction = apply_correction(batch, CorrectionConfig(name="tis", tis_cap=1.1))
    idx = torch.tensor([0, 2])
    loss, _ = policy_loss(batch.rows(idx), LossConfig(), correction.rows(idx))
    # rows 0 and 2: ratios [1.1, 0.7] (A = 1) and [0.9, 1.0] (A = 0.5); every weight min(exp(0.2), 1.1) = 1.1
    expected = -1.1 * (1.1 + 0.7 + 0.5 * 0.9 + 0.5 * 1.0) / 4
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)


def test_batch_validation():
    batch = make_batch([[1.1, 0.7]], [1.0])
    batch.check_finite()  # garbage in the padded position is allowed
    with pytest.raises(ValueError, match="old_logprobs"):
        RLBatch(batch.logprobs, batch.old_logprobs[:, :1], batch.sampler_logprobs, batch.mask,
                batch.advantages)
    with pytest.raises(ValueError, match="advantages"):
        RLBatch(batch.logprobs, batch.old_logprobs, batch.sampler_logprobs, batch.mask, torch.zeros(3))
    bad = batch.sampler_logprobs.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="sampler_logprobs"):
        RLBatch(batch.logprobs, batch.old_logprobs, bad, batch.mask, batch.advantages).check_finite()
    as_float = RLBatch(batch.logprobs, batch.old_logprobs, batch.sampler_logprobs, batch.mask.float(),
                       batch.advantages)
    assert as_float.mask.dtype == torch.bool


def test_gspo_sequence_ratio_value_gradient_and_clipping():
    # row 0: token ratios 2 and 0.5 -> sequence ratio exp(mean log) = 1; row 1: one token at ratio 1.5
    batch = make_batch([[2.0, 0.5], [1.5]], [1.0, 1.0])
    cfg = LossConfig(ratio="sequence", aggregation="seq_mean", eps_high=0.2)
    loss, metrics = policy_loss(batch, cfg)
    # row 0 unclipped (s = 1): pg = -1 per token; row 1 clipped at 1.2 (A > 0, s > 1.2): pg = -1.2
    assert float(loss.detach()) == pytest.approx((-1.0 - 1.2) / 2)
    assert float(metrics["loss/clip_frac"]) == pytest.approx(1 / 3)
    # gradient: -A * s / len at each token of an unclipped sequence, none for a clipped one
    g = grad_of(policy_loss(batch, cfg)[0], batch)
    torch.testing.assert_close(g[batch.mask], torch.tensor([-0.25, -0.25, 0.0]))


def test_dr_grpo_constant_normalizer():
    batch = make_batch([[1.0, 1.0, 1.0], [1.0]], [1.0, -1.0])
    cfg = LossConfig(aggregation="seq_mean_token_sum_norm", normalizer=10)
    loss, _ = policy_loss(batch, cfg)
    assert float(loss.detach()) == pytest.approx((-3 / 10 + 1 / 10) / 2)
    g = grad_of(policy_loss(batch, cfg)[0], batch)
    torch.testing.assert_close(g[batch.mask], torch.tensor([-0.05, -0.05, -0.05, 0.05]))
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(batch, LossConfig(aggregation="seq_mean_token_sum_norm"))
