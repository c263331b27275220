"""The rollout engine: paged KV cache, continuous batching, prefix sharing, preemption, CUDA graphs."""

from minite.sampler.engine import Sampler
from minite.sampler.sequence import RequestOutput, SampleOutput


def generate(model, prompts: list[list[int]], params, **sampler_kwargs) -> list[RequestOutput]:
    """One-shot `Sampler(model, **sampler_kwargs).generate(prompts, params)`."""
    return Sampler(model, **sampler_kwargs).generate(prompts, params)


__all__ = ["RequestOutput", "SampleOutput", "Sampler", "generate"]
