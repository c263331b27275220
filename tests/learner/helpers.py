"""Tiny models, a naive full-recompute sampler and the unpacked full-logits log-prob reference."""

import torch

from minite.learner import SequenceBatch
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.sampling import SamplingParams, processed_logprobs

LENGTHS = ((3, 5), (1, 7), (6, 1), (4, 4), (2, 0), (5, 3))  # (prompt, response) per sequence


def tiny_model(moe: bool = False, recipe: str = "aligned", seed: int = 0, dtype=torch.float32) -> Qwen3:
    torch.manual_seed(seed)
    model = Qwen3(tiny_qwen3_moe() if moe else tiny_qwen3(), recipe=recipe)
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(seed))
    return model.to(dtype)


@torch.no_grad()
def naive_generate(model, prompt: torch.Tensor, steps: int, params: SamplingParams, generator):
    """Full recompute per token; returns (response [steps], log mu [steps])."""
    seq, lps = prompt.clone(), []
    for _ in range(steps):
        lp = processed_logprobs(model(seq[None])[0, -1], params.temperature, params.top_k, params.top_p)
        tok = torch.multinomial(lp.exp(), 1, generator=generator)
        seq = torch.cat([seq, tok])
        lps.append(lp[tok])
    return seq[prompt.numel():], torch.cat(lps) if lps else torch.zeros(0)


def sampled_batch(model, params: SamplingParams, lengths=LENGTHS, seed: int = 1) -> SequenceBatch:
    """Prompts of random tokens, responses sampled from `model` under `params`, random advantages."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [torch.randint(2, vocab, (p,), generator=g) for p, _ in lengths]
    out = [naive_generate(model, p, r, params, g) for p, (_, r) in zip(prompts, lengths)]
    adv = torch.randn(len(lengths), generator=g)
    return SequenceBatch.from_samples(prompts, [r for r, _ in out], [lp for _, lp in out], adv, params)


def random_batch(vocab: int = 128, params: SamplingParams | None = None, lengths=LENGTHS,
                 seed: int = 1) -> SequenceBatch:
    """Random prompt and response tokens (finite log-probs: no truncation), random advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, vocab, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(2, vocab, (r,), generator=g) for _, r in lengths]
    adv = torch.randn(len(lengths), generator=g)
    params = params or SamplingParams(temperature=0.9)
    return SequenceBatch.from_samples(prompts, responses, None, adv, params)


def reference_logprobs(model, batch: SequenceBatch) -> torch.Tensor:
    """One unpacked forward per sequence, full [L, V] logits, processed_logprobs without chunks."""
    sp = batch.params
    out = torch.zeros(batch.num_sequences, batch.width)
    for i, (seq, p) in enumerate(zip(batch.sequences, batch.prompt_lens)):
        if seq.numel() == p:
            continue
        full = processed_logprobs(model(seq[None, :-1])[0], sp.temperature, sp.top_k, sp.top_p)
        out[i, : seq.numel() - p] = full[p - 1:].gather(-1, seq[p:, None])[:, 0]
    return out
