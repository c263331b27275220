"""The learner sharded across processes: FSDP2 (`torch.distributed.fsdp.fully_shard`), data parallel.

    model = shard_model(model, torch.bfloat16)        # every rank: the same model, then sharded
    learner = ShardedLearner(model, group, lr=1e-6)   # the `Learner` interface, on every rank

What is sharded: every parameter is held in fp32 and split along its first dimension across the
ranks (an expert tensor [E, N, K] by experts); the fp32 shards *are* `MasterAdamW`'s masters (an fp32
parameter is its own master, so there is no second copy), and AdamW's moments follow them (sharded).
Compute: FSDP all-gathers a decoder layer's parameters in the run's dtype just before the layer runs
(`MixedPrecisionPolicy(param_dtype=dtype)`: bf16(master), the very values a single-process learner's
bf16 parameters hold) and frees them after; the layer's `Linear`s quantize the gathered weight as in
one process, so a token's log-prob is the single-process value for the same weights, bitwise
(`tests/learner/test_fsdp.py`). The quantized copies are dropped after each layer's forward (a
sharded learner must not keep a whole model of them). Gradients are reduce-scattered in fp32 and
averaged; each rank weights its loss by its share of the whole batch's tokens times the world size,
so the average is the whole batch's gradient.

Data parallel: `logprobs` and `step` take the whole batch on every rank; each rank runs its
contiguous share of the sequences (`Group.share`) in micro-batches of at most `micro_batch_tokens`.
Every forward is a collective (the all-gathers), so ranks with fewer micro-batches run filler ones of
weight 0 until all ran the same number. The results come back whole on every rank: log-probs
all-reduced (each row is filled on one rank and 0 on the others), metrics summed.

What differs from one process, and why the step matches only closely: the gradient of a sequence is
reduced in another order (sums across ranks, not one accumulation), and the global norm is the norm
of per-shard norms; both are fp32 rounding (docs/distributed.md gives the measured size).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from minite.distributed import Group
from minite.learner.batch import SequenceBatch
from minite.learner.learner import Learner, LossFn, _freeze_gc, _to_floats, loss_counts, micro_batches
from minite.learner.logprobs import sequence_logprobs
from minite.loss_batch import AGGREGATIONS, Correction

# the model's methods that run parameters outside `forward` (`sequence_logprobs` calls them)
FORWARD_METHODS = ("hidden_states", "logits")


def shard_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Shard `model` (a Qwen3, the same on every rank) in place: fp32 master shards, each decoder
    layer one FSDP unit, the embeddings, final norm and LM head the root's; compute in `dtype`."""
    model.float()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
        layer.register_forward_hook(_drop_quantized_weights)
    fully_shard(model, mp_policy=policy)
    for name in FORWARD_METHODS:
        register_fsdp_forward_method(model, name)
    return model


def _drop_quantized_weights(layer: nn.Module, args, output) -> None:
    """After a sharded layer's forward: its gathered weights are freed, and so are their quantized
    copies (the backward quantizes the re-gathered weights again, to the same bits)."""
    for module in layer.modules():
        if hasattr(module, "refresh_quantized_weight"):
            module.set_recipe(module.recipe)  # the same recipe; drops the cached quantized weight


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


class ShardedLearner(Learner):
    """`Learner` on a `shard_model` model, every rank calling it with the same whole batch."""

    def __init__(self, model: nn.Module, group: Group, **kwargs):
        if not is_sharded(model):
            raise ValueError("ShardedLearner needs a model sharded by shard_model")
        super().__init__(model, sync_weights_after_step=False, **kwargs)
        self.group = group

    def _local_micro_batches(self, batch: SequenceBatch, lens: list[int]) -> list[list[int]]:
        """This rank's micro-batches (global sequence indices) that hold tokens counted by `lens`."""
        mine = list(self.group.share(batch.num_sequences))
        if not mine:
            return []
        groups = [[mine[i] for i in g] for g in micro_batches(batch.rows(mine), self.micro_batch_tokens)]
        return [g for g in groups if any(lens[i] for i in g)]

    def _rounds(self, count: int) -> int:
        """The most micro-batches any rank has: how many forwards every rank runs."""
        t = torch.tensor([count], device=self.group.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch) -> torch.Tensor:
        """log pi of the response tokens, fp32 [S, T] on every rank (each rank computes its share)."""
        lens = batch.response_lens
        out = torch.zeros(batch.num_sequences, batch.width, dtype=torch.float32, device=self.group.device)
        groups = self._local_micro_batches(batch, lens)
        rounds = self._rounds(len(groups))
        filler = _filler(lens)
        for k in range(rounds):
            if k < len(groups):
                out[groups[k]] = sequence_logprobs(self.model, batch.rows(groups[k]), self.logprob_chunk_rows)
            else:  # the all-gathers of the ranks still computing
                sequence_logprobs(self.model, batch.rows([filler]), self.logprob_chunk_rows)
        dist.all_reduce(out)  # a row is filled on one rank and 0 on the others: the sum is its value
        return out

    def step(self, batch: SequenceBatch, loss_fn: LossFn, correction: Correction | None = None,
             aggregation: str = "token_mean") -> dict[str, float]:
        """`Learner.step` data parallel: each rank's share forward/backward, gradients summed across
        ranks, one AdamW step on the shards; metrics of the whole batch on every rank."""
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation={aggregation!r} is not supported; choose one of {AGGREGATIONS}")
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad()
        counted = loss_counts(batch, aggregation)
        total = int(counted.sum())
        if total == 0:
            raise ValueError("the batch has no response tokens to train on")
        lens = counted.tolist()
        groups = self._local_micro_batches(batch, lens)
        rounds = self._rounds(len(groups))
        filler = _filler(lens)
        sums: dict[str, torch.Tensor] = {}
        for k in range(rounds):
            rows = groups[k] if k < len(groups) else [filler]
            # FSDP averages gradients over the ranks: times the world size, the sum of each rank's share
            weight = sum(lens[i] for i in rows) / total if k < len(groups) else 0.0
            loss, metrics = self.micro_batch_loss(batch, rows, loss_fn, correction)
            (loss * (weight * self.group.world_size)).backward()  # a filler's weight 0: it only kept pace
            for key, v in {"loss": loss, **metrics}.items():
                v = v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v))
                sums[key] = sums.get(key, 0.0) + weight * v.to(self.group.device)
        names = sorted(sums)
        reduced = torch.stack([sums[n].reshape(()) for n in names])
        dist.all_reduce(reduced)
        sums = dict(zip(names, reduced))
        sums.update(self.optimizer.step_queued())
        if self.release_grads:
            self.optimizer.zero_grad()
        sums = _to_floats(sums)
        self.steps += 1
        if self.steps == 1 and self.freeze_gc:
            _freeze_gc()
        seconds = time.perf_counter() - start
        tokens = sum(s.numel() - 1 for s in batch.sequences)
        return {**sums, "lr": self.optimizer.lr, "micro_batches": float(rounds), "tokens": float(tokens),
                "step_seconds": seconds, "tokens_per_s": tokens / seconds}

    def state_dict(self) -> dict:
        """The part of the state that is not sharded; the masters and moments go through
        `save_sharded` (torch.distributed.checkpoint)."""
        return {"steps": self.steps, "sharded": True}

    def load_state_dict(self, state: dict) -> None:
        """`state` as `state_dict` gave it, plus "path": the `save_sharded` folder to load from."""
        load_sharded(state["path"], self)
        self.steps = int(state["steps"])

    def nonfinite_parameter(self) -> str | None:
        return nonfinite_parameter(self.model, self.group)


def _filler(lens: list[int]) -> int:
    """A sequence with response tokens: what a rank without work of its own runs to keep pace."""
    return next((i for i, n in enumerate(lens) if n), 0)


def _sharded_state(learner: ShardedLearner) -> dict:
    model_state, optim_state = get_state_dict(learner.model, learner.optimizer.optimizer)
    return {"model": model_state, "optimizer": optim_state}


def save_sharded(path, learner: ShardedLearner) -> None:
    """The fp32 master shards and AdamW moments (by parameter name) into folder `path`, every rank
    its own shards (torch.distributed.checkpoint); loadable at any world size."""
    dcp.save(_sharded_state(learner), checkpoint_id=str(path))


def load_sharded(path, learner: ShardedLearner) -> None:
    """Masters and moments from a `save_sharded` folder of any world size, resharded onto this one."""
    state = _sharded_state(learner)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(learner.model, learner.optimizer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])


def nonfinite_parameter(model: nn.Module, group: Group) -> str | None:
    """The first parameter holding inf or NaN on any rank's shard, or None; the same on every rank."""
    params = [(name, _local(p)) for name, p in model.named_parameters()]
    bad = [i for i, (_, p) in enumerate(params) if not bool(torch.isfinite(p).all())]
    first = torch.tensor([bad[0] if bad else len(params)], device=group.device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    index = int(first.item())
    return params[index][0] if index < len(params) else None


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p
