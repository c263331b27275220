"""The sampler's log-probs equal a full-sequence forward's processed log-probs of the same tokens."""

import pytest
import torch

from minite.sampler import Sampler
from minite.sampling import SamplingParams
from tests.sampler.common import full_forward_logprobs, prompts_of, tiny_model

TOL = 1e-5  # fp32: the cached forward differs from the full one only in reduction lengths


@pytest.mark.parametrize("recipe", ["bf16", "aligned"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("params", [
    SamplingParams(n=2, max_tokens=8, temperature=0.8, top_k=30, top_p=0.85, seed=1),
    SamplingParams(n=2, max_tokens=8, temperature=1.3, top_p=0.7, seed=2),
], ids=["topk-topp", "topp"])
def test_sampler_logprobs_match_full_forward(recipe, moe, params):
    model = tiny_model(recipe, moe=moe)
    prompts = prompts_of([7, 19, 3])
    # A small budget also sends some tokens through preemption and re-prefill.
    sampler = Sampler(model, max_num_seqs=4, kv_cache_tokens=48, block_size=4)
    out = sampler.generate(prompts, params)
    worst = 0.0
    for prompt, r in zip(prompts, out):
        for s in r.samples:
            ref = full_forward_logprobs(model, prompt, s.token_ids, params)
            assert torch.isfinite(s.logprobs).all()
            worst = max(worst, (ref - s.logprobs).abs().max().item())
    assert worst <= TOL, f"max |sampler - full forward| = {worst:.3g}"
