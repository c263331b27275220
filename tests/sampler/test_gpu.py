"""CUDA: the decode step through CUDA graphs gives the same tokens as without them."""

import pytest
import torch

from minite.sampler import Sampler
from minite.sampling import SamplingParams
from tests.sampler.common import full_forward_logprobs, prompts_of, tiny_model, tokens_of


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_give_identical_tokens(dtype):
    model = tiny_model("bf16").to("cuda", dtype)
    prompts = prompts_of([5, 30, 12, 17, 2])
    params = SamplingParams(n=3, max_tokens=24, top_k=50, top_p=0.95, seed=11)
    eager = Sampler(model, max_num_seqs=8, kv_cache_tokens=4096, cuda_graphs=False)
    graphed = Sampler(model, max_num_seqs=8, kv_cache_tokens=4096, cuda_graphs=True)
    a, b = eager.generate(prompts, params), graphed.generate(prompts, params)
    assert graphed.stats["graph_steps"] > 0 and eager.stats["graph_steps"] == 0
    assert tokens_of(a) == tokens_of(b)
    # Graphs are reused on a second call, and still agree.
    assert tokens_of(graphed.generate(prompts, params)) == tokens_of(a)
    if dtype == torch.float32:
        for prompt, r in zip(prompts, b):
            for s in r.samples:
                ref = full_forward_logprobs(model, prompt, s.token_ids, params)
                torch.testing.assert_close(s.logprobs, ref.cpu(), rtol=0, atol=1e-4)


@pytest.mark.gpu
def test_graphs_are_recaptured_after_a_weight_update():
    model = tiny_model("bf16").cuda()
    prompts = prompts_of([9, 4])
    params = SamplingParams(n=2, max_tokens=8, seed=3)
    graphed = Sampler(model, max_num_seqs=4, kv_cache_tokens=1024, cuda_graphs=True)
    graphed.generate(prompts, params)
    with torch.no_grad():
        model.layers[0].mlp.gate_up_proj.segments()[1].mul_(-1.0)  # up
    fresh = Sampler(model, max_num_seqs=4, kv_cache_tokens=1024, cuda_graphs=False)
    assert tokens_of(graphed.generate(prompts, params)) == tokens_of(fresh.generate(prompts, params))
