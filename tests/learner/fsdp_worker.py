"""One rank of the sharded-learner check:

    torchrun --nproc-per-node=N tests/learner/fsdp_worker.py OUT TMP [cuda]

On the tiny dense and MoE models under the aligned recipe (CPU: fp32 compute, gloo; cuda: bf16 on
the kernels, NCCL): the sharded learner's
log-probs against one process's, the sampler's codes and scales gathered from the shards against the
whole model's quantization, and one learner step against one process's step on the same batch.
Rank 0 writes what it measured to OUT (JSON); a failed check raises on every rank.
"""

import json
import sys
from dataclasses import replace
from functools import partial

import torch

from minite import distributed
from minite.learner import Learner, batch_logprobs, quantized_weights
from minite.learner.fsdp import ShardedLearner, load_sharded, save_sharded, shard_model
from minite.learner.sharded_weight_sync import gather_quantized_weights
from minite.models import Qwen3
from minite.rl.losses import LossConfig, policy_loss
from minite.sampling import SamplingParams
from tests.learner.helpers import sampled_batch, tiny_model

LR = 1e-3
# one sequence per micro-batch: on the CPU the reference forward is not batch invariant (torch's fp32
# GEMMs depend on the row count), so bitwise log-probs need the same micro-batches in both runs; the
# ranks get 3 and 2 micro-batches with responses (one sequence has none): the filler runs
MICRO_TOKENS = 1
# the sharded step vs one process's: the updates' difference, relative RMS over all weights (the
# largest single difference is reported too: a weight whose gradient nearly cancels can move by a
# good part of lr either way, as AdamW's first step is about lr * sign(gradient))
STEP_TOLERANCE = 1e-3


def check(moe: bool, group, tmp: str) -> dict:
    device, dtype = group.device, torch.float32 if group.device.type == "cpu" else torch.bfloat16

    def model(seed: int = 0):
        return tiny_model(moe, seed=seed).to(device=device, dtype=dtype)

    batch = sampled_batch(tiny_model(moe), SamplingParams(temperature=1.0))
    single = model()
    sharded = shard_model(model(), dtype)
    one = Learner(single, lr=LR, micro_batch_tokens=MICRO_TOKENS)
    many = ShardedLearner(sharded, group, lr=LR, micro_batch_tokens=MICRO_TOKENS)
    sampler = Qwen3(single.config, "aligned").to(device=device, dtype=dtype)
    gather_quantized_weights(sharded, sampler, dtype)
    out = {}

    def aligned(when: str) -> None:
        whole = model()
        with torch.no_grad():
            for p, q in zip(sharded.parameters(), whole.parameters()):
                q.copy_(p.full_tensor())
        for name, qw in quantized_weights(whole).items():
            mine = quantized_weights(sampler)[name].q
            for field in ("codes", "block_scales", "global_scale", "amax"):
                a, b = getattr(qw.q, field), getattr(mine, field)
                assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), \
                    f"{when}: {name}.{field}"
        lp_many = many.logprobs(batch)
        assert torch.equal(lp_many, batch_logprobs(whole, batch, MICRO_TOKENS)), f"{when}: != one process"
        assert torch.equal(lp_many, batch_logprobs(sampler, batch, MICRO_TOKENS)), f"{when}: != the sampler"

    aligned("before the step")
    old = one.logprobs(batch)
    assert torch.equal(old, many.logprobs(batch))
    loss_fn = partial(policy_loss, cfg=LossConfig())
    masters = one.optimizer.masters  # fp32, in the parameters' order (the parameters themselves in fp32)
    before = [m.detach().clone() for m in masters]
    m_one = one.step(replace(batch, old_logprobs=old), loss_fn)
    m_many = many.step(replace(batch, old_logprobs=old), loss_fn)
    worst, diff2, update2 = 0.0, 0.0, 0.0
    for (name, p), q, q0 in zip(sharded.named_parameters(), masters, before):
        diff = p.full_tensor() - q.detach()
        worst = max(worst, float(diff.abs().max()) / LR)
        diff2 += float(diff.double().square().sum())
        update2 += float((q.detach() - q0).double().square().sum())
        moved = not torch.equal(q.detach(), q0)
        assert moved or name.endswith("norm.weight"), f"{name} did not move"
    rel = (diff2 / update2) ** 0.5
    assert rel <= STEP_TOLERANCE, f"sharded step differs from one process's by {rel} (relative RMS)"
    out["step_rel_rms_diff"] = rel
    out["step_max_abs_diff_over_lr"] = worst
    out["grad_norm_rel_diff"] = abs(m_one["grad_norm"] - m_many["grad_norm"]) / m_one["grad_norm"]
    out["loss_abs_diff"] = abs(m_one["loss"] - m_many["loss"])
    gather_quantized_weights(sharded, sampler, dtype)
    aligned("after the step")
    lp_one, lp_many = one.logprobs(batch), many.logprobs(batch)
    out["logprob_max_abs_diff_after_step"] = float((lp_one - lp_many).abs().max())
    # masters and moments through torch.distributed.checkpoint, back into a fresh sharded learner
    save_sharded(f"{tmp}/{'moe' if moe else 'dense'}", many)
    again = ShardedLearner(shard_model(model(seed=5), dtype), group, lr=LR)
    load_sharded(f"{tmp}/{'moe' if moe else 'dense'}", again)
    for p, q in zip(sharded.parameters(), again.model.parameters()):
        assert torch.equal(p.to_local(), q.to_local())
    return out


def main(path: str, tmp: str, device: str = "cpu") -> None:
    torch.set_num_threads(1)
    group = distributed.init(device)
    results = {"world_size": group.world_size, "dense": check(False, group, tmp),
               "moe": check(True, group, tmp)}
    if group.main:
        with open(path, "w") as f:
            json.dump(results, f)
    distributed.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
