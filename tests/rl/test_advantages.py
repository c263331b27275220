import math

import pytest
import torch

from minite.rl.advantages import AdvantageConfig, advantage_metrics, group_advantages


def test_grpo_std_normalized_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(rewards, group_size=4)
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3); group 2: all equal -> 0
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(a, torch.tensor([s, -s, -s, s, 0.0, 0.0, 0.0, 0.0]))


def test_dr_grpo_no_std():
    rewards = torch.tensor([3.0, 0.0, 0.0, 1.0, 0.0, 2.0])
    a = group_advantages(rewards, group_size=3, cfg=AdvantageConfig(normalize_std=False))
    torch.testing.assert_close(a, torch.tensor([2.0, -1.0, -1.0, 0.0, -1.0, 1.0]))


def test_grouped_shape_kept_and_group_means_zero():
    rewards = torch.rand(5, 8)
    a = group_advantages(rewards, group_size=8)
    assert a.shape == (5, 8)
    torch.testing.assert_close(a.mean(dim=1), torch.zeros(5), atol=1e-6, rtol=0)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), group_size=1)
    with pytest.raises(ValueError, match="group_size=3"):
        group_advantages(torch.zeros(4), group_size=3)
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages(torch.tensor([0.0, float("nan")]), group_size=2)
    with pytest.raises(ValueError, match="eps"):
        AdvantageConfig(eps=0.0)


def test_metrics():
    m = advantage_metrics(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=2)
    assert float(m["adv/reward_mean"]) == 0.75
    assert float(m["adv/zero_std_frac"]) == 0.5
