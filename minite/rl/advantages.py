"""Group-normalized advantages (GRPO), with the std division optional (Dr. GRPO).

Rewards come prompt-major: the n samples of prompt p sit at rows p*n .. p*n + n - 1. Within a group,

    A_i = r_i - mean_j r_j                          (normalize_std=False, Dr. GRPO)
    A_i = (r_i - mean_j r_j) / (std_j r_j + eps)    (normalize_std=True, GRPO)

with the unbiased (Bessel-corrected) std over the n samples. A group whose rewards are all equal
gets A = 0 for every sample in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdvantageConfig:
    normalize_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")


def group_advantages(rewards: Tensor, group_size: int, cfg: AdvantageConfig = AdvantageConfig()) -> Tensor:
    """Per-sequence advantages [B] from rewards [B] (B = prompts * group_size) or [P, n]."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 to normalize within a group, got {group_size}")
    r = rewards.detach().float()
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of group_size={group_size}")
    if not torch.isfinite(r).all():
        raise ValueError("rewards has non-finite values")
    groups = r.reshape(-1, group_size)  # [P, n]
    centered = groups - groups.mean(dim=1, keepdim=True)
    if cfg.normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True) + cfg.eps)
    return centered.reshape(rewards.shape)


def advantage_metrics(rewards: Tensor, group_size: int) -> dict[str, Tensor]:
    """`adv/reward_mean`, `adv/zero_std_frac` (share of groups whose samples all scored the same)."""
    groups = rewards.detach().float().reshape(-1, group_size)  # [P, n]
    flat = (groups.max(dim=1).values == groups.min(dim=1).values).float()
    return {"adv/reward_mean": groups.mean(), "adv/zero_std_frac": flat.mean()}
