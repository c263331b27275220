"""Tiny random-weight models and reference computations shared by the sampler tests."""

from __future__ import annotations

import torch

from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.sampler import Sampler
from minite.sampler.sequence import request_output
from minite.sampling import token_logprobs


def tiny_model(recipe: str = "bf16", moe: bool = False, seed: int = 0, **config) -> Qwen3:
    """fp32 tiny Qwen3 with weights large enough (std 0.2) that the distributions are not flat."""
    cfg = (tiny_qwen3_moe if moe else tiny_qwen3)(**config)
    model = Qwen3(cfg, recipe=recipe).float()
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model


def prompts_of(lengths: list[int], vocab: int = 128, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def tokens_of(outputs) -> list[list[list[int]]]:
    return [[s.token_ids for s in r.samples] for r in outputs]


def one_at_a_time(model, prompts, params, **kwargs):
    """Each request alone in a fresh sampler, with its index in `prompts` (so the same random keys
    as in one `generate` call); `params` is one SamplingParams or one per prompt."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    outs = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        sampler = Sampler(model, **kwargs)
        group = sampler.add_request(prompt, sp, index=i)
        while sampler.has_unfinished():
            sampler.step()
        outs.append(request_output(group))
    return outs


@torch.no_grad()
def full_forward_logprobs(model, prompt: list[int], tokens: list[int], params) -> torch.Tensor:
    """The learner's view: one full-sequence forward, processed log-probs of `tokens` (fp32 [T])."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    logits = model(ids)[0, len(prompt) - 1: -1]  # [T, V]
    lp = token_logprobs(logits, torch.tensor(tokens, device=device), params.temperature, params.top_k,
                        params.top_p)
    return lp.cpu()
