"""What one model forward needs to know about its step, beyond the token ids.

Every engine runs the same `Qwen3.forward(input_ids, context=...)`; only the context differs:

- full sequences (the learner, the diagnostics, `model(ids)`; `sequence_context`): positions `[B, T]`,
  or one packed row `[1, N]` of sequences back to back with `cu_seqlens`, and `SequenceAttention`
  over the keys of this forward;
- a cached step (the sampler; `minite.sampler.runner.cached_context`): the new tokens flattened
  `[N]`, the KV cache and each token's slot in it (every attention layer stores its new keys and
  values there before attending), a paged backend reading the cache's blocks, and the rows whose
  hidden states leave the model (each sequence's last token).

The context is made once per forward, outside the layers, so whatever it precomputes (query tiles,
the packed layout, key positions) serves every layer and, under activation checkpointing, every
layer's recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from minite.execution import DEFAULT, Execution
from minite.nn.attention_backends import SequenceAttention


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s attention of q over its visible keys -> o_proj's input (heads flattened)."""


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # [B, T] int64, or [N] for a cached step
    attention: AttentionBackend
    kv_cache: Any = None  # `minite.sampler.kv_cache.KVCache`: the layers store their new k/v at `slots`
    slots: torch.Tensor | None = None  # [N] int64 flat cache slot of each new token
    output_rows: torch.Tensor | None = None  # [B] int64 rows that go through the final norm (None: all)


def default_positions(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """0, 1, 2, ... per row, or per packed sequence when `cu_seqlens` is given; `[B, T]` int64."""
    B, T = input_ids.shape
    if cu_seqlens is None:
        return torch.arange(T, device=input_ids.device).expand(B, T)
    cu = cu_seqlens.to(input_ids.device)
    # output_size: no host sync to learn it (the packed length is T)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T)
    return (torch.arange(T, device=input_ids.device) - starts)[None]


def sequence_context(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, check: bool = True,
                     execution: Execution = DEFAULT, kv_format: str = "bf16") -> ForwardContext:
    """The context of a forward over whole sequences: input_ids `[B, T]`, or with `cu_seqlens`
    `[S + 1]` one row `[1, N]` of S sequences packed back to back, attending only within themselves.
    `check=False` skips the check that cu_seqlens runs from 0 to N (a host sync on the GPU) for
    callers that built it (the learner's packing). `execution`: the model's (which attention runs);
    `kv_format`: its recipe's `kv_cache` (how attention stores k and v)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    if cu_seqlens is not None and input_ids.shape[0] != 1:
        raise ValueError(
            f"packed input (cu_seqlens) needs input_ids of shape [1, N], got {tuple(input_ids.shape)}")
    if check and cu_seqlens is not None and (cu_seqlens[0] != 0 or cu_seqlens[-1] != input_ids.shape[1]):
        raise ValueError(f"cu_seqlens must run from 0 to the packed length {input_ids.shape[1]}, "
                         f"got {cu_seqlens.tolist()}")
    default = position_ids is None
    if default:
        position_ids = default_positions(input_ids, cu_seqlens)
    position_ids = position_ids.expand(input_ids.shape)
    # positions the model made are 0, 1, ... per sequence: the kernel's layout, known without a check
    backend = SequenceAttention(position_ids, cu_seqlens, kernel_layout=default and cu_seqlens is not None,
                                execution=execution, kv_format=kv_format)
    return ForwardContext(position_ids, backend)
