"""Lookahead decode (launch a step before reading the previous one back) gives the outputs of the
synchronous engine: the same tokens and finish reasons, log-probs within the batch-shape effect, with
stop tokens found one step late, continuous batching and preemption (CPU, fp32)."""

import pytest
import torch

from minite.sampler import Sampler
from minite.sampling import SamplingParams
from tests.sampler.common import prompts_of, tiny_model

STOPS = tuple(range(0, 128, 6))  # about one token in six ends a sample: stops land mid-batch


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def outputs(model, prompts, params, async_decode: bool, **kwargs):
    sampler = Sampler(model, block_size=4, async_decode=async_decode, **kwargs)
    outs = sampler.generate(prompts, params)
    return sampler, [[(s.token_ids, s.logprobs, s.finish_reason) for s in r.samples] for r in outs]


def assert_same(a, b):
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for (ta, la, fa), (tb, lb, fb) in zip(ra, rb):
            assert ta == tb and fa == fb
            # A sample that stopped stays one extra step in the batch: other batch shapes, so (on a
            # path that is not batch invariant, like the CPU's fp32 matmul) not always the same bits.
            torch.testing.assert_close(la, lb, atol=1e-5, rtol=0)
            assert len(la) == len(ta) and not la.isnan().any()


@pytest.mark.parametrize("case", ["one_batch", "continuous", "preemption"])
def test_lookahead_equals_synchronous(model, case):
    prompts = prompts_of([5, 21, 9, 14, 3])
    params = [SamplingParams(n=3, max_tokens=m, temperature=0.9, top_k=40, seed=11, stop_token_ids=STOPS)
              for m in (12, 3, 7, 12, 1)]
    kwargs = {"one_batch": dict(max_num_seqs=64), "continuous": dict(max_num_seqs=2),
              "preemption": dict(max_num_seqs=12, kv_cache_tokens=32)}[case]
    sync_sampler, want = outputs(model, prompts, params, False, **kwargs)
    lookahead, got = outputs(model, prompts, params, True, **kwargs)
    assert_same(got, want)
    reasons = [f for r in got for (_, _, f) in r]
    assert "stop" in reasons and "length" in reasons
    assert lookahead.stats["decode_steps"] >= sync_sampler.stats["decode_steps"]
    if case == "preemption":
        assert lookahead.num_preemptions > 0 and sync_sampler.num_preemptions > 0
    assert not lookahead.has_unfinished() and lookahead.blocks.num_used == 0


def test_lookahead_without_stops_and_greedy(model):
    prompts = prompts_of([4, 17])
    for params in (SamplingParams(n=2, max_tokens=9, seed=3),
                   SamplingParams(n=1, max_tokens=6, temperature=0)):
        assert_same(outputs(model, prompts, params, True)[1], outputs(model, prompts, params, False)[1])
