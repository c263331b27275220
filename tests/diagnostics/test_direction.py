"""Direction analysis on a hand-built batch whose regions, masses, tails and segments are known exactly."""

import pytest
import torch

from minite.diagnostics.direction import direction, heatmap_rows
from minite.rl.batch import RLBatch
from minite.rl.triage import TriageConfig, triage

# Binary fractions, so every |g| and |A g| is exact in fp32 and fp64.
GAP = torch.tensor([[0.5, -0.25, 0.0, 0.125], [-0.375, 0.75, 0.25, 9.0]])
MASK = torch.tensor([[True, True, True, True], [True, True, True, False]])
ADV = torch.tensor([1.0, -2.0])
CFG = TriageConfig(segment_len=2, tail_quantile=0.5, tail_floor=0.05, min_tail_tokens=1,
                   top_segment_frac=0.25)


def test_regions_masses_and_tails_exact():
    d = direction(GAP, ADV, MASK, CFG)
    # row 0 (A=+1): amp_pos, contracting, neutral, amp_pos; row 1 (A=-2): amp_neg, contracting, contracting
    assert d["n_tokens"] == 7
    assert (d["share_amp_pos"], d["share_amp_neg"]) == (2 / 7, 1 / 7)
    assert (d["share_contracting"], d["share_neutral"]) == (3 / 7, 1 / 7)
    assert (d["mass_amp_pos"], d["mass_amp_neg"], d["mass_contracting"]) == (0.625, 0.75, 2.25)
    assert d["imbalance"] == pytest.approx(0.75 / 0.625, rel=1e-10) and d["dominant"] == "amp_neg"
    # |g| sorted: 0, .125, .25, .25, .375, .5, .75 -> median tau = 0.25; 5 tail tokens, 2 amplifying
    assert d["tau"] == 0.25 and d["tail_frac"] == 5 / 7 and d["amp_tail_frac"] == 2 / 7
    # segments of 2: [.5, .25] [0, .125] | [.375, .75] [.25]; top 1 of 4 segments holds 2 of 5 tails
    assert d["n_segments"] == 4 and d["tail_concentration"] == pytest.approx(0.4)
    assert d["flagged_segment_frac"] == 0.5
    assert d["segment_profile"] == [
        {"segment": 0, "tokens": 4, "tail": 4, "amp_tail": 2, "mean_abs_gap": 0.46875},
        {"segment": 1, "tokens": 3, "tail": 1, "amp_tail": 0, "mean_abs_gap": 0.125}]


def test_matches_triage_metrics():
    batch = RLBatch(GAP.clone(), GAP, torch.zeros_like(GAP), MASK, ADV)
    m = triage(batch, CFG).metrics
    d = direction(GAP, ADV, MASK, CFG)
    for name in ("share_amp_pos", "share_amp_neg", "share_contracting", "share_neutral", "mass_amp_pos",
                 "mass_amp_neg", "mass_contracting", "imbalance", "tau", "tail_frac", "tail_concentration",
                 "flagged_segment_frac", "amp_tail_frac"):
        assert d[name] == pytest.approx(m[f"triage/{name}"].item(), rel=1e-6), name


def test_per_token_advantages_and_errors():
    d = direction(GAP, ADV[:, None].expand(2, 4), MASK, CFG)
    assert d["mass_amp_neg"] == 0.75
    with pytest.raises(ValueError, match="advantages"):
        direction(GAP, torch.ones(3), MASK)
    with pytest.raises(ValueError, match="no response token"):
        direction(GAP, ADV, torch.zeros_like(MASK))


def test_heatmap_rows_pick_largest_gap():
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    rows = heatmap_rows(GAP, MASK, tokens, lambda i: f"t{i}", ADV, n=1)
    assert rows == [{"row": 1, "tokens": ["t20", "t21", "t22"], "gap": [-0.375, 0.75, 0.25],
                     "advantage": -2.0}]
