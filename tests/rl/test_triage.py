import dataclasses
import math

import pytest
import torch

from minite.rl.batch import RLBatch
from minite.rl.triage import (
    AMP_NEG,
    AMP_POS,
    CONTRACTING,
    NEUTRAL,
    PAD,
    TriageConfig,
    regions,
    segment_index,
    tail_threshold,
    triage,
)

SAMPLER_LP = -2.0

# Two rows of 8 response tokens (two segments of L = 4 each) + one padded column.
# row 0, A = +1:  seg 0 [0.6, 0.6, 0.01, -0.01]  two amplifying tails -> flagged
#                 seg 1 [0.6, 0.01, 0.01, 0.0]   one amplifying tail  -> not flagged
# row 1, A = -1:  seg 2 [-0.1, -0.1, 0.02, 0.0]  no tails
#                 seg 3 [-0.9, 0.01, 0.0, 0.0]   one amplifying tail (also severe: 0.9 > log 2)
GAPS = [[0.6, 0.6, 0.01, -0.01, 0.6, 0.01, 0.01, 0.0], [-0.1, -0.1, 0.02, 0.0, -0.9, 0.01, 0.0, 0.0]]
ADV = [1.0, -1.0]
# |g| sorted: 4 x 0, 5 x 0.01, 0.02, 2 x 0.1, 3 x 0.6, 0.9 -> median (q = 0.5) = 0.01 < floor 0.5
CFG = TriageConfig(tail_quantile=0.5, tail_floor=0.5, segment_len=4, min_tail_tokens=2)
M_POS = 0.6 * 3 + 0.01 * 3
M_NEG = 0.1 + 0.1 + 0.9
W_REB = math.sqrt(M_NEG / M_POS)  # beta = 0.5, inside [w_min, 1]
W_REP = math.exp(-0.9)  # inside [1/4, 4]


def make_batch(gaps, adv, garbage=3.0e4, prefix=0, pad=1):
    """Response gaps g = old - sampler after `prefix` prompt positions, then `pad` garbage positions."""
    b, n = len(gaps), max(len(r) for r in gaps)
    t = prefix + n + pad
    mask = torch.zeros(b, t, dtype=torch.bool)
    g = torch.full((b, t), garbage)
    for i, row in enumerate(gaps):
        mask[i, prefix: prefix + len(row)] = True
        g[i, prefix: prefix + len(row)] = torch.tensor(row, dtype=torch.float64).float()
    sampler = torch.where(mask, SAMPLER_LP, -garbage)
    old = sampler + g
    adv_t = torch.as_tensor(adv, dtype=torch.float32)
    return RLBatch(old.clone(), old, sampler, mask, adv_t)


def test_regions_by_hand():
    g = torch.tensor([[0.5, -0.5, 0.0005, -0.002, 7.0],
                      [-0.5, 0.5, -0.0002, 0.01, 7.0],
                      [0.5, -0.5, 0.0, 0.0, 0.0]])
    a = torch.tensor([[1.0], [-1.0], [0.0]]).expand(3, 5)
    mask = torch.tensor([[True] * 4 + [False], [True] * 4 + [False], [True] * 5])
    expected = [[AMP_POS, CONTRACTING, NEUTRAL, CONTRACTING, PAD],
                [AMP_NEG, CONTRACTING, NEUTRAL, CONTRACTING, PAD],
                [NEUTRAL] * 5]
    assert regions(g, a, mask, eps=1e-3).tolist() == expected


def test_tail_threshold_quantile_and_floor():
    abs_g = torch.arange(11.0)[None, :].repeat(2, 1)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[0] = True  # the second row is garbage-free but masked out
    abs_g[1] = 1e6
    # 11 values 0..10: position 0.99 * 10 = 9.9 -> 9 + 0.9 * (10 - 9)
    assert float(tail_threshold(abs_g, mask, q=0.99, floor=0.5)) == pytest.approx(9.9)
    assert float(tail_threshold(abs_g, mask, q=0.99, floor=12.0)) == 12.0
    assert float(tail_threshold(abs_g, mask, q=0.5, floor=0.1)) == 5.0


def test_segments_count_response_tokens_not_positions():
    mask = torch.tensor([[False, False, True, True, True, True, True], [True, True, True] + [False] * 4])
    seg, n_seg = segment_index(mask, segment_len=2)
    assert n_seg == 4
    assert seg.tolist() == [[-1, -1, 0, 0, 1, 1, 2], [4, 4, 5, -1, -1, -1, -1]]


def test_triage_full_scenario_by_hand():
    batch = make_batch(GAPS, ADV)
    c = triage(batch, CFG)
    w = c.weights[batch.mask].view(2, 8)
    expected = torch.ones(2, 8)
    expected[0, :3] = W_REB  # dominant (positive) amplifying tokens of the flagged segment 0
    expected[1, 4] = W_REP  # the severe token is repaired, not dropped
    torch.testing.assert_close(w, expected)
    assert torch.equal(c.keep, batch.mask)

    m = {k: float(v) for k, v in c.metrics.items()}
    expect = {
        "triage/share_amp_pos": 6 / 16, "triage/share_amp_neg": 3 / 16,
        "triage/share_contracting": 3 / 16, "triage/share_neutral": 4 / 16,
        "triage/mass_amp_pos": M_POS, "triage/mass_amp_neg": M_NEG, "triage/mass_contracting": 0.04,
        "triage/imbalance": M_NEG / M_POS, "triage/dominant": 1.0, "triage/tau": 0.5,
        "triage/tail_frac": 4 / 16, "triage/amp_tail_frac": 4 / 16,
        "triage/flagged_segment_frac": 1 / 4,
        "triage/tail_concentration": 2 / 4,  # top ceil(0.1 * 4) = 1 segment holds 2 of the 4 tails
        "triage/rebalance_weight": W_REB, "triage/rebalanced_frac": 3 / 16,
        "triage/severe_frac": 1 / 16, "triage/repaired_frac": 1 / 16,
        "triage/mean_weight": (3 * W_REB + W_REP + 12) / 16,
    }
    assert set(m) == set(expect)
    for key, value in expect.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("rebalance,repair", [(True, False), (False, True), (False, False)])
def test_ablation_switches(rebalance, repair):
    batch = make_batch(GAPS, ADV)
    c = triage(batch, dataclasses.replace(CFG, rebalance=rebalance, repair=repair))
    w = c.weights[batch.mask].view(2, 8)
    expected = torch.ones(2, 8)
    if rebalance:
        expected[0, :3] = W_REB
    if repair:
        expected[1, 4] = W_REP
    torch.testing.assert_close(w, expected)
    assert float(c.metrics["triage/rebalanced_frac"]) == pytest.approx(3 / 16 if rebalance else 0.0)
    assert float(c.metrics["triage/repaired_frac"]) == pytest.approx(1 / 16 if repair else 0.0)
    # the diagnosis does not depend on the switches
    assert float(c.metrics["triage/flagged_segment_frac"]) == 0.25
    assert float(c.metrics["triage/severe_frac"]) == pytest.approx(1 / 16)


def test_negative_dominant_clipped_at_w_min_and_capped_repair():
    # row 0 (A = -2): two amplifying-negative tails in segment 0 -> flagged; -1.6 is severe, exp(-1.6) < 1/4
    # row 1 (A = +1): one small amplifying-positive token, mass 0.01
    batch = make_batch([[-0.6, -1.6, 0.0, 0.0], [0.01, 0.0, 0.0, 0.0]], [-2.0, 1.0])
    c = triage(batch, CFG)
    m_neg, m_pos = 2 * (0.6 + 1.6), 0.01
    assert math.sqrt(m_pos / m_neg) < CFG.w_min
    w = c.weights[batch.mask].view(2, 4)
    expected = torch.ones(2, 4)
    expected[0, 0] = CFG.w_min
    expected[0, 1] = CFG.w_min * (1 / CFG.cap)
    torch.testing.assert_close(w, expected)
    assert float(c.metrics["triage/dominant"]) == -1.0
    assert float(c.metrics["triage/imbalance"]) == pytest.approx(m_neg / m_pos, rel=1e-5)
    assert float(c.metrics["triage/rebalance_weight"]) == CFG.w_min


def test_upward_repair_is_capped():
    batch = make_batch([[2.0, 0.0]], [0.0])  # A = 0: neutral, so no rebalancing, but still repaired
    c = triage(batch, CFG)
    torch.testing.assert_close(c.weights[batch.mask], torch.tensor([CFG.cap, 1.0]))


def test_aligned_batch_is_untouched():
    batch = make_batch([[0.0] * 8, [0.0] * 8], ADV)
    c = triage(batch)
    assert torch.equal(c.weights[batch.mask], torch.ones(16))
    m = {k: float(v) for k, v in c.metrics.items()}
    assert m["triage/share_neutral"] == 1.0 and m["triage/tail_frac"] == 0.0
    assert m["triage/flagged_segment_frac"] == 0.0 and m["triage/tail_concentration"] == 0.0
    assert m["triage/imbalance"] == 1.0 and m["triage/dominant"] == 0.0
    assert m["triage/tau"] == pytest.approx(0.05)


def test_segments_follow_response_positions_under_a_prompt_prefix():
    # two amplifying tails at response positions 1 and 2 of a row: different segments when L = 2
    gaps = [[0.0, 0.6, 0.6, 0.0]]
    cfg = dataclasses.replace(CFG, segment_len=2)
    for prefix in (0, 1, 3):
        c = triage(make_batch(gaps, [1.0], prefix=prefix), cfg)
        assert float(c.metrics["triage/flagged_segment_frac"]) == 0.0
    c = triage(make_batch([[0.6, 0.6, 0.0, 0.0]], [1.0], prefix=3), cfg)
    assert float(c.metrics["triage/flagged_segment_frac"]) == 0.5


def test_per_token_advantages_match_broadcast():
    seq = make_batch(GAPS, ADV)
    tok = RLBatch(seq.logprobs, seq.old_logprobs, seq.sampler_logprobs, seq.mask,
                  torch.tensor(ADV)[:, None].expand(seq.shape).clone())
    a, b = triage(seq, CFG), triage(tok, CFG)
    assert torch.equal(a.weights, b.weights)
    assert all(torch.equal(a.metrics[k], b.metrics[k]) for k in a.metrics)


def test_padding_garbage_never_matters_and_weights_carry_no_grad():
    outs = []
    for garbage in (3.0e4, -8.0e4):
        batch = make_batch(GAPS, ADV, garbage=garbage, pad=5)
        batch = RLBatch(batch.logprobs.requires_grad_(), batch.old_logprobs.requires_grad_(),
                        batch.sampler_logprobs, batch.mask, batch.advantages)
        c = triage(batch, CFG)
        assert not c.weights.requires_grad and torch.isfinite(c.weights).all()
        outs.append((c.weights[batch.mask], c.metrics))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(outs[0][1][k], outs[1][1][k]) for k in outs[0][1])


@pytest.mark.parametrize("field,value", [
    ("eps", -1e-3), ("tail_quantile", 1.5), ("tail_floor", 0.0), ("segment_len", 0),
    ("min_tail_tokens", 0), ("top_segment_frac", 0.0), ("beta", -1.0), ("w_min", 0.0), ("w_min", 1.5),
    ("severe", -0.1), ("cap", 0.5),
])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TriageConfig(**{field: value})
