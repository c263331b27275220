"""The learner's batch: whole sequences (prompt then response) plus per-response-token RL fields.

`SequenceBatch` holds S variable-length token sequences; sequence s is `prompt_lens[s]` prompt tokens
followed by R_s = len(sequences[s]) - prompt_lens[s] response tokens. Per-token fields are [S, T]
over *response positions* (T = the longest response, right-padded), the layout of
`minite.loss_batch.RLBatch`, so `to_rl_batch(logprobs)` converts without reshuffling:

- `sampler_logprobs`  log mu(y_t) reported by the sampler (None: taken equal to old_logprobs);
- `old_logprobs`      log pi_theta_old(y_t) (None: the current log-probs, detached; exact for the
                      first update on a rollout batch, where theta == theta_old);
- `advantages`        [S] per sequence or [S, T] per token;
- `ref_logprobs`      optional reference policy log-probs for a KL penalty;
- `params`            the SamplingParams the tokens were drawn with (temperature / top-k / top-p are
                      mirrored by the learner's log-probs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from minite.loss_batch import RLBatch
from minite.sampling import SamplingParams

PER_TOKEN = ("sampler_logprobs", "old_logprobs", "ref_logprobs", "token_mask")


@dataclass(frozen=True)
class SequenceBatch:
    sequences: tuple[Tensor, ...]  # S x [L_s] int64
    prompt_lens: tuple[int, ...]  # S
    sampler_logprobs: Tensor | None = None  # [S, T] fp32
    advantages: Tensor | None = None  # [S] or [S, T]
    old_logprobs: Tensor | None = None  # [S, T]
    ref_logprobs: Tensor | None = None  # [S, T]
    params: SamplingParams = SamplingParams()
    width: int | None = None  # T; None: the longest response
    token_mask: Tensor | None = None  # [S, T] bool; False drops a response token from loss and metrics

    def __post_init__(self):
        seqs = tuple(torch.as_tensor(s, dtype=torch.long) for s in self.sequences)
        object.__setattr__(self, "sequences", seqs)
        object.__setattr__(self, "prompt_lens", tuple(int(p) for p in self.prompt_lens))
        if not seqs:
            raise ValueError("a SequenceBatch needs at least one sequence")
        if len(self.prompt_lens) != len(seqs):
            raise ValueError(f"{len(seqs)} sequences but {len(self.prompt_lens)} prompt lengths")
        for i, (s, p) in enumerate(zip(seqs, self.prompt_lens)):
            if s.dim() != 1:
                raise ValueError(f"sequence {i} must be 1-D token ids, got shape {tuple(s.shape)}")
            if not 1 <= p <= s.numel():
                raise ValueError(f"sequence {i}: prompt length {p} must be in [1, {s.numel()}] "
                                 "(the first response token needs a prompt token to be predicted from)")
        if self.width is None:
            object.__setattr__(self, "width", max(self.response_lens))
        if self.width < max(self.response_lens):
            raise ValueError(f"width={self.width} is shorter than the longest response "
                             f"({max(self.response_lens)} tokens)")
        shape = (len(seqs), self.width)
        for name in PER_TOKEN:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise ValueError(f"{name} must be [S, T]={shape} (response positions), "
                                 f"got {tuple(value.shape)}")
        a = self.advantages
        if a is not None and tuple(a.shape) not in (shape[:1], shape):
            raise ValueError(f"advantages must be [S]={shape[:1]} or [S, T]={shape}, got {tuple(a.shape)}")

    @classmethod
    def from_samples(cls, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     sampler_logprobs: Sequence[Sequence[float]] | None = None,
                     advantages: Sequence[float] | Tensor | None = None,
                     params: SamplingParams | None = None) -> SequenceBatch:
        """Build from per-sequence prompt and response token lists (and the sampler's log-probs)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        ids = lambda x: torch.as_tensor(x, dtype=torch.long).reshape(-1)
        seqs = [torch.cat([ids(p), ids(r)]) for p, r in zip(prompts, responses)]
        lp = None
        if sampler_logprobs is not None:
            lp = [torch.as_tensor(x, dtype=torch.float32).reshape(-1) for x in sampler_logprobs]
            for i, (x, r) in enumerate(zip(lp, responses)):
                if x.numel() != len(r):
                    raise ValueError(f"sequence {i}: {len(r)} response tokens, {x.numel()} sampler log-probs")
            lp = pad_rows(lp, max(len(r) for r in responses))
        adv = None if advantages is None else torch.as_tensor(advantages, dtype=torch.float32)
        return cls(tuple(seqs), tuple(len(p) for p in prompts), lp, adv, params=params or SamplingParams())

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    @property
    def response_lens(self) -> list[int]:
        return [s.numel() - p for s, p in zip(self.sequences, self.prompt_lens)]

    def mask(self, device=None) -> Tensor:
        """[S, T] bool, True on response tokens (and, with `token_mask`, only where it is True)."""
        lens = to_device(torch.tensor(self.response_lens), device)
        mask = torch.arange(self.width, device=device)[None] < lens[:, None]
        return mask if self.token_mask is None else mask & to_device(self.token_mask, device)

    def rows(self, index: Sequence[int]) -> SequenceBatch:
        """The sub-batch of sequences `index`; per-token fields keep the full width T."""
        index = list(index)
        pick = lambda x: None if x is None else x[index]
        return SequenceBatch(tuple(self.sequences[i] for i in index),
                             tuple(self.prompt_lens[i] for i in index), pick(self.sampler_logprobs),
                             pick(self.advantages), pick(self.old_logprobs), pick(self.ref_logprobs),
                             self.params, self.width, pick(self.token_mask))

    def to_rl_batch(self, logprobs: Tensor) -> RLBatch:
        """RLBatch for the losses from the current log-probs `logprobs` [S, T]."""
        if tuple(logprobs.shape) != (self.num_sequences, self.width):
            raise ValueError(f"logprobs must be [S, T]={(self.num_sequences, self.width)}, "
                             f"got {tuple(logprobs.shape)}")
        if self.advantages is None:
            raise ValueError("the loss needs advantages: build the SequenceBatch with advantages=...")
        dev = logprobs.device
        on = lambda x: None if x is None else to_device(x, dev)
        old = on(self.old_logprobs)
        old = logprobs.detach() if old is None else old
        sampler = on(self.sampler_logprobs)
        return RLBatch(logprobs, old, old if sampler is None else sampler, self.mask(dev),
                       on(self.advantages), on(self.ref_logprobs))


def to_device(t: Tensor, device) -> Tensor:
    """`t.to(device)`; a CPU tensor goes to a GPU from pinned memory, asynchronously: a copy from
    pageable memory waits for all the GPU's queued work first (a host sync in the learner's step)."""
    if device is None or t.device == torch.device(device) or t.device.type != "cpu" or \
            torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def pad_rows(rows: Sequence[Tensor], width: int, value: float = 0.0) -> Tensor:
    """1-D tensors -> [len(rows), width], right-padded with `value`."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out
