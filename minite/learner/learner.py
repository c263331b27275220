"""The learner: log-probs of sampled tokens and one optimizer step per call, on the model it is given.

    learner = Learner(model, lr=1e-6, micro_batch_tokens=8192)
    old = learner.logprobs(batch)                                  # [S, T] fp32, theta_old
    metrics = learner.step(replace(batch, old_logprobs=old), partial(policy_loss, cfg=LossConfig()))

`step` splits the batch into micro-batches of whole sequences holding at most `micro_batch_tokens`
packed tokens each (a longer sequence gets a micro-batch of its own), runs forward + backward on each
and accumulates gradients, then takes one `MasterAdamW` step and re-quantizes the model's weights
once (`minite.learner.weight_sync.sync_weights`), so the next forward of the learner, and a sampler
running the same model object, use the same fresh `QuantizedWeight`s. The learner also quantizes them
when it is made, so the first step runs like the later ones.

Host syncs: none inside a micro-batch (the packed batch and the RL fields reach the GPU by pinned,
asynchronous copies); a step waits on the GPU for the gradient norm (clipping, skipping a non-finite
step) and for the weight refresh's finiteness check.

The loss: `loss_fn(rl_batch) -> (loss, metrics)` on each micro-batch converted to
`minite.loss_batch.RLBatch` (e.g. `partial(policy_loss, cfg=cfg)`). With `correction=` (a
`Correction` computed once on the whole batch, as batch-level statistics such as TRIAGE's need),
it is called as `loss_fn(rl_batch, correction=correction.rows(rows))`. Each micro-batch's loss is
weighted by its share of the batch's response tokens (`aggregation="token_mean"`) or of its
non-empty sequences (`"seq_mean"`), so that the accumulated gradient equals the one-batch gradient.

Gradients: the parameters' grads and the fp32 master grads (6 bytes a bf16 parameter, 10 GB at 1.7B)
are freed once the update is queued (`release_grads=True`, the default, as Hugging Face's Trainer
does), so they do not hold memory while the sampler runs the next rollout. `release_grads=False`
keeps them until the next step, for inspection.

Garbage collection: after its first step the learner calls `gc.freeze()` once (`freeze_gc=True`, the
default): the objects alive then (modules, parameters, compiled kernels, imported code) move to the
collector's permanent generation, so a full collection no longer walks them. Without it the dense
1.7B learner met one full collection in 8 timed steps, which came to 22 ms a step of GC in all, most of
it that one collection (H200 at 9bd16fe; bench_learner's gc_ms_per_step). Objects made later are
collected as usual.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections.abc import Callable

import torch
from torch import nn

from minite.learner.batch import SequenceBatch
from minite.learner.logprobs import DEFAULT_CHUNK_ROWS, sequence_logprobs
from minite.learner.optimizer import MasterAdamW
from minite.learner.weight_sync import sync_weights
from minite.loss_batch import AGGREGATIONS, Correction
from minite.nn.sampler_weights import is_sampler_only

LossFn = Callable[..., tuple[torch.Tensor, dict]]


def micro_batches(batch: SequenceBatch, max_tokens: int) -> list[list[int]]:
    """Consecutive groups of sequence indices with at most `max_tokens` packed tokens (L - 1 each)."""
    groups, current, used = [], [], 0
    for i, seq in enumerate(batch.sequences):
        n = seq.numel() - 1
        if current and used + n > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    return groups + [current]


@torch.no_grad()
def batch_logprobs(model: nn.Module, batch: SequenceBatch, micro_batch_tokens: int = 8192,
                   chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """`sequence_logprobs` over micro-batches of at most `micro_batch_tokens` packed tokens; fp32 [S, T]."""
    out = torch.zeros(batch.num_sequences, batch.width, dtype=torch.float32,
                      device=model.embed_tokens.weight.device)
    for rows in micro_batches(batch, micro_batch_tokens):
        if any(batch.response_lens[i] for i in rows):
            out[rows] = sequence_logprobs(model, batch.rows(rows), chunk_rows)
    return out


def loss_counts(batch: SequenceBatch, aggregation: str) -> torch.Tensor:
    """[S] each sequence's share of the loss's normalizer: its response tokens (`token_mean`) or 1 (the
    sequence-level aggregations); a micro-batch's loss weighs its sum over the batch's total."""
    lens = batch.mask().sum(1)
    return lens if aggregation == "token_mean" else (lens > 0).long()


class Learner:
    def __init__(self, model: nn.Module, lr: float = 1e-6, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float | None = 1.0,
                 micro_batch_tokens: int = 8192, activation_checkpointing: bool = False, eps: float = 1e-8,
                 logprob_chunk_rows: int = DEFAULT_CHUNK_ROWS, sync_weights_after_step: bool = True,
                 freeze_gc: bool = True, release_grads: bool = True):
        if micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens={micro_batch_tokens} must be >= 1")
        if is_sampler_only(model):
            raise ValueError("the model is sampler-only (minite.nn.sampler_weights): its NVFP4 layers hold "
                             "codes, not trainable weights; train the full model")
        self.model = model
        self.micro_batch_tokens = micro_batch_tokens
        self.activation_checkpointing = activation_checkpointing
        self.logprob_chunk_rows = logprob_chunk_rows
        self.sync_weights_after_step = sync_weights_after_step
        self.freeze_gc = freeze_gc
        self.release_grads = release_grads
        self.optimizer = MasterAdamW(model.parameters(), lr=lr, betas=betas, eps=eps,
                                     weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self.steps = 0
        if sync_weights_after_step:
            # quantized now, as after every step (S_dec on the host): the first step's backward takes
            # the same paths as the later ones (and compiles what they use)
            sync_weights(model)

    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """log pi of the batch's response tokens, fp32 [S, T], 0 off the response (micro-batched)."""
        return batch_logprobs(self.model, batch, self.micro_batch_tokens, self.logprob_chunk_rows)

    def micro_batch_loss(self, batch: SequenceBatch, rows: list[int], loss_fn: LossFn,
                         correction: Correction | None) -> tuple[torch.Tensor, dict]:
        """The loss and metrics of the batch's sequences `rows` (one micro-batch's forward)."""
        mb = batch.rows(rows)
        rl = mb.to_rl_batch(sequence_logprobs(self.model, mb, self.logprob_chunk_rows,
                                              self.activation_checkpointing))
        if correction is None:
            return loss_fn(rl)
        return loss_fn(rl, correction=correction.rows(torch.tensor(rows)))

    def step(self, batch: SequenceBatch, loss_fn: LossFn, correction: Correction | None = None,
             aggregation: str = "token_mean") -> dict[str, float]:
        """Forward/backward over micro-batches, one AdamW step, weight sync; returns metrics
        (the loss_fn's metrics averaged with the micro-batch weights, plus grad_norm, lr, tokens/s)."""
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={aggregation!r} is not supported; choose one of {AGGREGATIONS}")
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad()
        counted = loss_counts(batch, aggregation)
        total = counted.sum()
        if total == 0:
            raise ValueError("the batch has no response tokens to train on")
        groups = micro_batches(batch, self.micro_batch_tokens)
        sums: dict[str, float] = {}
        for rows in groups:
            part = counted[rows].sum()
            if part == 0:
                continue
            weight = (part / total).item()
            loss, metrics = self.micro_batch_loss(batch, rows, loss_fn, correction)
            (loss * weight).backward()
            for k, v in {"loss": loss, **metrics}.items():  # device tensors: no sync per micro-batch
                sums[k] = sums.get(k, 0.0) + weight * (v.detach().float() if torch.is_tensor(v) else float(v))
        sums.update(self.optimizer.step_queued())  # device tensors: the host queues on (no sync)
        if self.sync_weights_after_step:
            sync_weights(self.model)
        if self.release_grads:  # after the refresh's allocations; stream-ordered: the update still reads them
            self.optimizer.zero_grad()
        sums = _to_floats(sums)  # after the updates are queued: the GPU need not drain before them
        self.steps += 1
        if self.steps == 1 and self.freeze_gc:
            _freeze_gc()
        seconds = time.perf_counter() - start
        tokens = sum(s.numel() - 1 for s in batch.sequences)
        return {**sums, "lr": self.optimizer.lr, "micro_batches": float(len(groups)),
                "tokens": float(tokens), "step_seconds": seconds, "tokens_per_s": tokens / seconds}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        if self.sync_weights_after_step:
            sync_weights(self.model)


def _freeze_gc() -> None:
    """`gc.freeze()` (module docstring), undone at exit: objects still frozen then are never freed, and
    extension modules report them as leaks (Triton 3.9's nanobind prints hundreds of lines)."""
    if not _FROZE:
        atexit.register(gc.unfreeze)
        _FROZE.append(True)
    gc.freeze()


_FROZE: list[bool] = []


def _to_floats(values: dict) -> dict[str, float]:
    """{name: float or 0-dim tensor} -> {name: float}, with one device-to-host copy for the tensors."""
    names = [k for k, v in values.items() if torch.is_tensor(v)]
    out = {k: float(v) for k, v in values.items() if not torch.is_tensor(v)}
    if names:
        dev = values[names[0]].device
        out.update(zip(names, torch.stack([values[k].reshape(()).to(dev) for k in names]).tolist()))
    return {k: out[k] for k in values}
