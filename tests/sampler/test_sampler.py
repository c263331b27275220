"""Sampler behaviour on tiny fp32 models (CPU): determinism, batching, preemption, sharing, stops."""

import pytest
import torch

from minite.sampler import Sampler, generate
from minite.sampling import SamplingParams
from tests.sampler.common import one_at_a_time, prompts_of, tiny_model, tokens_of

PARAMS = SamplingParams(n=3, max_tokens=10, top_k=40, top_p=0.9, temperature=0.9, seed=7)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    """Outputs with an ample budget and everything in one batch."""
    prompts = prompts_of([5, 21, 9, 14])
    return prompts, Sampler(model, max_num_seqs=64, block_size=4).generate(prompts, PARAMS)


def test_same_seed_same_tokens_other_seed_other_tokens(model, reference):
    prompts, ref = reference
    again = generate(model, prompts, PARAMS, max_num_seqs=64, block_size=4)
    assert tokens_of(again) == tokens_of(ref)
    for a, b in zip(again, ref):
        for sa, sb in zip(a.samples, b.samples):
            assert torch.equal(sa.logprobs, sb.logprobs)
    other = generate(model, prompts, SamplingParams(**{**PARAMS.__dict__, "seed": 8}), block_size=4)
    assert tokens_of(other) != tokens_of(ref)


def test_samples_of_a_group_differ(reference):
    _, ref = reference
    assert all(len({tuple(s.token_ids) for s in r.samples}) > 1 for r in ref)


def test_continuous_batching_equals_one_at_a_time(model, reference):
    prompts, ref = reference
    mixed = [SamplingParams(**{**PARAMS.__dict__, "max_tokens": m}) for m in (10, 3, 7, 10)]
    batched = Sampler(model, max_num_seqs=2, block_size=4)
    got = batched.generate(prompts, mixed)
    assert batched.stats["prefill_steps"] > 2  # sequences joined while others ran
    alone = one_at_a_time(model, prompts, mixed, max_num_seqs=1, block_size=4, prefix_sharing=False)
    assert tokens_of(got) == tokens_of(alone)
    for r, m in zip(ref, (10, 3, 7, 10)):
        assert tokens_of(got)[r.index] == [s.token_ids[:m] for s in r.samples]


def test_preemption_under_tiny_budget_gives_same_result(model, reference):
    prompts, ref = reference
    tight = Sampler(model, max_num_seqs=12, kv_cache_tokens=32, block_size=4)
    got = tight.generate(prompts, PARAMS)
    assert tight.num_preemptions > 0
    assert tokens_of(got) == tokens_of(ref)
    for a, b in zip(got, ref):
        for sa, sb in zip(a.samples, b.samples):
            torch.testing.assert_close(sa.logprobs, sb.logprobs, rtol=0, atol=1e-5)
    assert tight.blocks.num_used == 0


def test_request_too_large_for_the_cache_is_a_clear_error(model):
    with pytest.raises(ValueError, match="whole cache holds 32"):
        Sampler(model, kv_cache_tokens=32, block_size=4).generate([[1] * 30], SamplingParams(max_tokens=8))


def test_prefix_sharing_shares_blocks_and_keeps_tokens(model):
    prompt = prompts_of([37])[0]
    params = SamplingParams(n=4, max_tokens=6, seed=3)
    counts = {}
    for sharing in (True, False):
        sampler = Sampler(model, block_size=8, prefix_sharing=sharing)
        group = sampler.add_request(prompt, params, index=0)
        sampler.step()  # prefill of the 4 samples
        counts[sharing] = sampler.blocks.num_used
        if sharing:
            shared = group.shared_blocks
            assert len(shared) == 36 // 8
            assert all(sampler.blocks.ref[b] == 4 for b in shared)
            assert all(s.block_table[:4] == shared for s in group.seqs)
        while sampler.has_unfinished():
            sampler.step()
        counts[sharing, "tokens"] = [s.tokens for s in group.seqs]
        assert sampler.blocks.num_used == 0
    assert counts[True] == 4 + 4 * 1 and counts[False] == 4 * 5
    assert counts[True, "tokens"] == counts[False, "tokens"]


def test_stop_tokens_and_max_tokens(model, reference):
    prompts, ref = reference
    stop = ref[1].samples[0].token_ids[2]
    got = generate(model, prompts, SamplingParams(**{**PARAMS.__dict__, "stop_token_ids": (stop,)}),
                   block_size=4)
    stopped = 0
    for r_ref, r in zip(ref, got):
        for s_ref, s in zip(r_ref.samples, r.samples):
            if stop in s_ref.token_ids:
                cut = s_ref.token_ids.index(stop) + 1
                assert s.token_ids == s_ref.token_ids[:cut] and s.finish_reason == "stop"
                stopped += 1
            else:
                assert s.token_ids == s_ref.token_ids and s.finish_reason == "length"
            assert len(s.logprobs) == len(s.token_ids) and s.logprobs.dtype == torch.float32
    assert stopped >= 1
    assert all(s.finish_reason == "length" and len(s.token_ids) == 10 for r in ref for s in r.samples)


def test_greedy_is_argmax_with_zero_logprob(model):
    prompts = prompts_of([6, 11], seed=1)
    out = generate(model, prompts, SamplingParams(n=2, temperature=0.0, max_tokens=5), block_size=4)
    for prompt, r in zip(prompts, out):
        assert r.samples[0].token_ids == r.samples[1].token_ids
        assert torch.all(r.samples[0].logprobs == 0)
        ids = prompt + r.samples[0].token_ids
        logits = model(torch.tensor([ids]))[0, len(prompt) - 1: -1]
        assert logits.argmax(-1).tolist() == r.samples[0].token_ids


def test_bad_prompts_are_rejected(model):
    sampler = Sampler(model)
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        sampler.generate([[500]], SamplingParams())
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        sampler.generate([[1]], [SamplingParams()] * 2)


def test_release_gives_the_cache_back_and_the_next_generate_remakes_it(model, reference):
    prompts, ref = reference
    sampler = Sampler(model, max_num_seqs=64, block_size=4)
    first = sampler.generate(prompts, PARAMS)
    blocks = sampler.cache.num_blocks
    sampler.release()
    assert sampler.released and sampler.cache is None
    sampler.release()  # releasing twice is a no-op
    again = sampler.generate(prompts, PARAMS)
    assert tokens_of(first) == tokens_of(again) == tokens_of(ref)
    assert sampler.cache.num_blocks == blocks and sampler.blocks.num_free == blocks
    assert sampler.stats["kv_remakes"] == 1 and sampler.stats["kv_remake_s"] > 0


def test_release_refuses_a_busy_sampler(model):
    sampler = Sampler(model, max_num_seqs=4, block_size=4)
    sampler.add_request([1, 2, 3], PARAMS, 0)
    with pytest.raises(RuntimeError, match="idle sampler"):
        sampler.release()
