"""Requests, their samples (sequences) and what `generate` returns.

A request (`Group`) is one prompt with its `SamplingParams`; it owns `n` `Sequence`s, one per sample.
A sequence's `tokens` are prompt + generated tokens; the last generated token is fed at the next
step, so the KV cache holds `len(tokens) - 1` positions between steps. `group.shared_blocks` are the
prompt's full blocks that the group's samples share (None when no sample holds them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minite.sampling import SamplingParams

PENDING = -1  # a sampled token still on the GPU (lookahead decode, see `minite.sampler.engine`)


@dataclass
class Group:
    index: int
    prompt: list[int]
    params: SamplingParams
    seqs: list[Sequence] = field(default_factory=list)
    shared_blocks: list[int] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass(eq=False)
class Sequence:
    group: Group
    sample: int
    key: int  # 64-bit random key (see rng.sample_key)
    tokens: list[int]
    num_prompt: int
    logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def params(self) -> SamplingParams:
        return self.group.params


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: torch.Tensor  # [T] fp32: log mu of each sampled token under `processed_logprobs`
    finish_reason: str  # "stop" (stop token, included in token_ids) or "length" (max_tokens)


@dataclass
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    samples: list[SampleOutput]


def request_output(group: Group) -> RequestOutput:
    samples = [SampleOutput(s.tokens[s.num_prompt:], torch.tensor(s.logprobs, dtype=torch.float32),
                            s.finish_reason) for s in group.seqs]
    return RequestOutput(group.index, list(group.prompt), samples)
