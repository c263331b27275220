"""Sampled tokens the learner gives probability 0 (outside its top-k set) leave the loss, nothing else."""

from dataclasses import replace
from functools import partial

import torch

from minite.learner import Learner
from minite.rl.losses import LossConfig, policy_loss
from minite.rl.trainer import drop_unsupported
from minite.sampling import SamplingParams
from tests.learner.helpers import random_batch, tiny_model


def test_tokens_outside_the_learner_top_k_are_dropped_and_the_step_trains():
    model = tiny_model(False, "aligned")
    batch = random_batch(params=SamplingParams(temperature=1.0, top_k=4))  # random tokens: most outside
    old = Learner(model).logprobs(batch)
    response = batch.mask()
    assert torch.isinf(old[response]).any()
    kept, share = drop_unsupported(replace(batch, old_logprobs=old))
    assert share == (torch.isinf(old) & response).sum().item() / response.sum().item() > 0
    assert torch.equal(kept.mask(), response & torch.isfinite(old))
    assert torch.equal(kept.rows([1, 0]).mask(), kept.mask()[[1, 0]])
    metrics = Learner(model, lr=1e-3).step(kept, partial(policy_loss, cfg=LossConfig()))
    assert metrics["skipped"] == 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fully_supported_batch_is_returned_unchanged():
    model = tiny_model(False, "aligned")
    batch = random_batch()
    batch = replace(batch, old_logprobs=Learner(model).logprobs(batch))
    kept, share = drop_unsupported(batch)
    assert kept is batch and share == 0.0
