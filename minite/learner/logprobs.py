"""Learner log-probs of sampled tokens: packed variable-length forward and a chunked LM head.

For sequence s (prompt length P, total length L) the response token at position p (P <= p < L) is
predicted by the hidden state at position p - 1, so the model runs on `tokens[:L - 1]`. The S inputs
are packed back to back into one row `[1, N]` with `cu_seqlens` (no padding; attention stays within
each sequence); sequences without response tokens are left out of the forward, which is the model's
own (`Qwen3.hidden_states`, optionally with activation checkpointing).

Only the R rows that predict response tokens go through the LM head, `chunk_rows` rows at a time:
`logits = model.logits(h)` (the model's own head, as the sampler calls it), then
`minite.sampling.token_logprobs` (temperature, top-k, top-p, log-softmax in fp32: the sampler's
definition of the distribution it drew from). Under autograd each chunk is checkpointed, so the
backward recomputes one chunk's logits at a time: at most `chunk_rows x V` fp32 logits exist at once
in the forward and in the backward.

Result: fp32 `[S, T]` over response positions (the layout of `RLBatch`), 0 off the response.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from minite.learner.batch import SequenceBatch, to_device
from minite.sampling import token_logprobs

DEFAULT_CHUNK_ROWS = 1024


class Packed(NamedTuple):
    input_ids: torch.Tensor  # [1, N] int64
    cu_seqlens: torch.Tensor  # [S' + 1] int64 (sequences with a response only)
    rows: torch.Tensor  # [R] packed row predicting each response token
    targets: torch.Tensor  # [R] the response tokens
    seq_index: torch.Tensor  # [R] which sequence of the batch
    position: torch.Tensor  # [R] response position t (column of the [S, T] output)


def pack(batch: SequenceBatch, device=None) -> Packed:
    """Pack the sequences that have response tokens (see the module docstring)."""
    inputs, bounds, rows, targets, seq_index, position = [], [0], [], [], [], []
    for s, (seq, p) in enumerate(zip(batch.sequences, batch.prompt_lens)):
        r = seq.numel() - p
        if r == 0:
            continue
        offset = bounds[-1]
        inputs.append(seq[:-1])
        bounds.append(offset + seq.numel() - 1)
        rows.append(torch.arange(offset + p - 1, offset + seq.numel() - 1))
        targets.append(seq[p:])
        seq_index.append(torch.full((r,), s))
        position.append(torch.arange(r))
    if not inputs:
        raise ValueError("the batch has no response tokens")
    parts = [torch.cat(inputs), torch.tensor(bounds), *map(torch.cat, (rows, targets, seq_index, position))]
    flat = to_device(torch.cat([p.to(torch.int64) for p in parts]), device)  # one copy, no host sync
    ids, cu, *rest = flat.split([p.numel() for p in parts])
    return Packed(ids[None], cu, *rest)


def chunked_token_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                           top_k: int = 0, top_p: float = 1.0,
                           chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """hidden [R, H] (final-norm states), targets [R] -> fp32 [R] log-probs through `model.logits`,
    `chunk_rows` rows at a time (checkpointed per chunk when gradients are needed)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1")

    def head(h, t):
        return token_logprobs(model.logits(h), t, temperature, top_k, top_p, chunk=h.shape[0],
                              execution=model.recipe.execution)

    grad = torch.is_grad_enabled()
    outs = []
    for s in range(0, hidden.shape[0], chunk_rows):
        h, t = hidden[s: s + chunk_rows], targets[s: s + chunk_rows]
        outs.append(checkpoint(head, h, t, use_reentrant=False) if grad else head(h, t))
    return torch.cat(outs)  # [R]


def sequence_logprobs(model, batch: SequenceBatch, chunk_rows: int = DEFAULT_CHUNK_ROWS,
                      activation_checkpointing: bool = False) -> torch.Tensor:
    """log pi of every response token under `batch.params`' temperature / top-k / top-p:
    fp32 [S, T] (T = batch.width), 0 off the response. Differentiable when grad is enabled;
    `activation_checkpointing` keeps only each decoder layer's input for the backward."""
    device = model.embed_tokens.weight.device
    packed = pack(batch, device)
    # `pack` made cu_seqlens valid: the model need not check it (a host sync on the GPU)
    hidden = model.hidden_states(packed.input_ids, cu_seqlens=packed.cu_seqlens, check=False,
                                 activation_checkpointing=activation_checkpointing)[0]  # [N, H]
    sp = batch.params
    lp = chunked_token_logprobs(model, hidden[packed.rows], packed.targets, sp.temperature, sp.top_k,
                                sp.top_p, chunk_rows)  # [R]
    out = torch.zeros(batch.num_sequences, batch.width, dtype=torch.float32, device=device)
    return out.index_put((packed.seq_index, packed.position), lp)  # [S, T]
