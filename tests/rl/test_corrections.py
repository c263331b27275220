import math

import pytest
import torch

from minite.rl.batch import RLBatch
from minite.rl.corrections import (
    CORRECTIONS,
    CorrectionConfig,
    adv_mask,
    apply_correction,
    geo_rs,
    icepop,
    no_correction,
    opsm,
    seq_mis,
    seq_tis,
    token_tis,
)

SAMPLER_LP = -1.0
GARBAGE = (1.0e4, -3.0e4)


def make_batch(gaps, adv, garbage=GARBAGE[0], lp_shift=None, pad=1):
    """Rows of response gaps g (old - sampler), each followed by `pad` padded positions of garbage."""
    b, t = len(gaps), max(len(r) for r in gaps) + pad
    mask = torch.zeros(b, t, dtype=torch.bool)
    g = torch.full((b, t), garbage)
    for i, row in enumerate(gaps):
        mask[i, : len(row)] = True
        g[i, : len(row)] = torch.tensor(row)
    sampler = torch.where(mask, torch.full((b, t), SAMPLER_LP), torch.full((b, t), -garbage))
    old = sampler + g
    lp = old.clone() if lp_shift is None else torch.where(mask, sampler + lp_shift, garbage)
    return RLBatch(lp, old, sampler, mask, torch.tensor(adv))


def on_response(c, batch):
    return c.coefficients()[batch.mask]


def test_none():
    batch = make_batch([[0.3, -0.2], [0.1]], [1.0, -1.0])
    c = no_correction(batch)
    assert torch.equal(c.keep, batch.mask)
    assert torch.equal(on_response(c, batch), torch.ones(3))


def test_token_tis_caps_at_c():
    batch = make_batch([[math.log(3.0), math.log(0.5), 0.0, math.log(1.5)]], [1.0])
    c = token_tis(batch, cap=2.0)
    torch.testing.assert_close(on_response(c, batch), torch.tensor([2.0, 0.5, 1.0, 1.5]))
    assert float(c.metrics["tis/clip_frac"]) == 0.25


def test_icepop_keeps_band_with_ratio_weight():
    rhos = [6.0, 0.4, 0.51, 4.99, 1.0, 5.01, 0.49]
    batch = make_batch([[math.log(r) for r in rhos]], [1.0])
    c = icepop(batch, low=0.5, high=5.0)
    assert c.keep[0, :7].tolist() == [False, False, True, True, True, False, False]
    torch.testing.assert_close(on_response(c, batch), torch.tensor([0, 0, 0.51, 4.99, 1.0, 0, 0]))
    torch.testing.assert_close(float(c.metrics["icepop/masked_frac"]), 4 / 7)
    torch.testing.assert_close(float(c.metrics["icepop/high_frac"]), 2 / 7)
    torch.testing.assert_close(float(c.metrics["icepop/low_frac"]), 2 / 7)


def test_seq_tis_uses_product_of_ratios():
    batch = make_batch([[math.log(1.5), math.log(2.0)], [math.log(1.5), math.log(0.5), math.log(2.0)]],
                       [1.0, -1.0])
    c = seq_tis(batch, cap=2.0)
    # row 0: prod 3 -> capped at 2; row 1: prod 1.5
    torch.testing.assert_close(on_response(c, batch), torch.tensor([2.0, 2.0, 1.5, 1.5, 1.5]))
    assert float(c.metrics["seq_tis/clip_frac"]) == 0.5


def test_seq_mis_rejects_outside_band():
    batch = make_batch([[math.log(3.0)], [math.log(1.5), 0.0], [math.log(0.4)]], [1.0, 1.0, -1.0])
    c = seq_mis(batch, low=0.5, high=2.0)
    assert c.keep[batch.mask].tolist() == [False, True, True, False]
    torch.testing.assert_close(on_response(c, batch), torch.tensor([0.0, 1.5, 1.5, 0.0]))
    torch.testing.assert_close(float(c.metrics["seq_mis/reject_frac"]), 2 / 3)


def test_geo_rs_is_length_invariant_band_on_geometric_mean():
    # row 0: mean g = 0.000375 (in band); row 1: mean 0.004 / 3 (out); row 2: 400 tokens of 5e-4:
    # a product exp(0.2) that Seq-MIS-like bands on prod rho would see, but geometric mean 1.0005.
    batch = make_batch([[0.01, -0.01, 0.0005, 0.001], [0.004, 0.0, 0.0], [5e-4] * 400], [1.0, 1.0, 1.0])
    c = geo_rs(batch, low=0.999, high=1.001)
    kept_rows = [bool(c.keep[i][batch.mask[i]].all()) for i in range(3)]
    assert kept_rows == [True, False, True]
    assert not c.keep[1].any()
    torch.testing.assert_close(float(c.metrics["geo_rs/reject_frac"]), 1 / 3)


def test_opsm_drops_negative_advantage_sequences_that_diverge_from_current_policy():
    # old == sampler (no gap), the current policy moved: mean(log mu - log pi) per row = +0.01, -0.01, +0.01
    gaps = [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    shift = torch.tensor([[-0.02, 0.0, 0.0], [0.01, 0.01, 0.0], [-0.01, -0.01, 0.0]])
    batch = make_batch(gaps, [-1.0, -1.0, 1.0], lp_shift=shift)
    c = opsm(batch, delta=1e-4)
    assert c.keep[batch.mask].tolist() == [False, False, True, True, True, True]
    torch.testing.assert_close(float(c.metrics["opsm/reject_frac"]), 1 / 3)
    torch.testing.assert_close(float(c.metrics["opsm/masked_frac"]), 2 / 6)


def test_adv_mask_on_probability_difference():
    # p = exp(old), q = exp(sampler): choose p, q directly.
    q = 0.4
    ps = [[0.7, 0.5, 0.1], [0.1, 0.7, 0.3]]
    gaps = [[math.log(p) - math.log(q) for p in row] for row in ps]
    batch = make_batch(gaps, [1.0, -1.0])
    sampler = torch.where(batch.mask, math.log(q), batch.sampler_logprobs)
    old = batch.old_logprobs - SAMPLER_LP + math.log(q)
    batch = RLBatch(batch.logprobs, old, sampler, batch.mask, batch.advantages)
    c = adv_mask(batch, threshold=0.2)
    # A > 0: p - q = +0.3 masked, +0.1 kept, -0.3 kept; A < 0: -0.3 masked, +0.3 kept, -0.1 kept
    assert c.keep[batch.mask].tolist() == [False, True, True, False, True, True]
    torch.testing.assert_close(float(c.metrics["adv_mask/masked_frac"]), 2 / 6)


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_padding_garbage_never_matters(name):
    gaps = [[0.3, -0.9, 0.02, 0.8], [-0.4, 1.2], [0.0005, -0.0002, 0.001]]
    outs = []
    for garbage in GARBAGE:
        batch = make_batch(gaps, [1.0, -0.5, 0.7], garbage=garbage, pad=3)
        cfg = CorrectionConfig(name=name)
        c = apply_correction(batch, cfg)
        assert torch.isfinite(c.coefficients()).all()
        outs.append((c.coefficients()[batch.mask], c.keep[batch.mask], c.metrics))
    (w0, k0, m0), (w1, k1, m1) = outs
    assert torch.equal(w0, w1) and torch.equal(k0, k1)
    assert m0.keys() == m1.keys()
    for key in m0:
        assert torch.equal(m0[key], m1[key]), key
        assert m0[key].dim() == 0 and torch.isfinite(m0[key])


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_weights_are_stop_gradient(name):
    batch = make_batch([[0.3, -0.9, 0.02], [-0.4, 1.2]], [1.0, -1.0])
    batch = RLBatch(batch.logprobs.requires_grad_(), batch.old_logprobs.requires_grad_(),
                    batch.sampler_logprobs.requires_grad_(), batch.mask, batch.advantages)
    c = apply_correction(batch, CorrectionConfig(name=name))
    assert not c.weights.requires_grad and not c.coefficients().requires_grad
    assert all(not v.requires_grad for v in c.metrics.values())


def test_registry_and_common_metrics():
    assert set(CORRECTIONS) == {"none", "tis", "icepop", "seq_tis", "seq_mis", "geo_rs", "opsm",
                                "adv_mask", "triage"}
    batch = make_batch([[math.log(3.0), 0.0]], [1.0])
    c = apply_correction(batch, CorrectionConfig(name="tis", tis_cap=2.0))
    assert float(c.metrics["correction/keep_frac"]) == 1.0
    torch.testing.assert_close(float(c.metrics["correction/mean_weight"]), 1.5)


@pytest.mark.parametrize("field,value", [("name", "bogus"), ("tis_cap", 0.0), ("seq_tis_cap", -1.0),
                                         ("icepop_high", 0.4), ("seq_mis_low", -0.1),
                                         ("geo_rs_high", 0.99), ("opsm_delta", -1.0),
                                         ("adv_mask_threshold", -0.1), ("triage", {})])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CorrectionConfig(**{field: value})
