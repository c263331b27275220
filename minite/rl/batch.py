"""The loss's typed inputs and outputs, `RLBatch` and `Correction`, on the RL side.

They are defined in `minite.loss_batch`, below the learner, which builds an `RLBatch` for every
micro-batch without importing `minite.rl`.
"""

from minite.loss_batch import Correction, RLBatch, masked_mean

__all__ = ["Correction", "RLBatch", "masked_mean"]
