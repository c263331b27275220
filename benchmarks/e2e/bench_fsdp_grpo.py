"""A GRPO step of Qwen3-30B-A3B across the GPUs of one host: FSDP2 learner, one sampler per GPU.

Run under torchrun, one process per GPU (NCCL):

    torchrun --nproc-per-node=8 -m benchmarks.e2e.bench_fsdp_grpo --out OUT.json           # 48 layers
    torchrun --nproc-per-node=N -m benchmarks.e2e.bench_fsdp_grpo --layers 4 --out OUT.json # scaling
    torchrun --nproc-per-node=2 -m benchmarks.e2e.bench_fsdp_grpo --tiny                    # CPU smoke

Model: random weights of the Qwen3-30B-A3B shape (`--layers`, default all 48), made on the meta
device and sharded before any memory is allocated (`minite.learner.fsdp.shard_model`: fp32 master
shards, bf16 compute), under the `aligned` recipe. Every rank also holds a whole sampler model that
receives the learner's codes and scales (`gather_quantized_weights`, timed as `sync_s`).

One GRPO step, end to end: each rank samples its share of `--prompts` random prompts x `--n`
responses (`--max-tokens`), the outputs are gathered, random rewards give group advantages, the
learner recomputes log pi_old (sharded, data parallel), takes one policy-gradient step, and the
samplers are synced. Measured: the rollout, learner and sync seconds; `aligned`: the share of sampled
tokens whose learner log-prob is bitwise the sampler's (the target is 1.0), on this rank's samples
and on all; and whether every rank's sampler got the same codes (a checksum per rank).

Learner throughput: `Learner.step` on a fixed batch (`--seqs` x `--seq-len`), median of `--steps`
steps after `--warmup`, global packed tokens/s and per GPU. Scaling from 1 to N GPUs: run this at
N = 1, 2, 4, 8 with the same `--layers` (at 48 layers the fp32 masters and moments, ~16 bytes a
parameter, need 4 or more H200s) and compare `learner_tokens_per_s`.
"""

import argparse
import hashlib
import statistics
import time
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from benchmarks.common import report
from minite import distributed
from minite.diagnostics.metrics import mismatch_metrics
from minite.learner import SequenceBatch
from minite.learner.fsdp import ShardedLearner, shard_model
from minite.learner.sharded_weight_sync import gather_quantized_weights
from minite.models import Qwen3
from minite.models.presets import model_preset
from minite.rl.advantages import AdvantageConfig, group_advantages
from minite.rl.losses import LossConfig, policy_loss
from minite.sampler import Sampler
from minite.sampling import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (gloo): the tiny MoE preset, fp32")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--prompts", type=int, default=64, help="prompts of the GRPO step, all ranks together")
    p.add_argument("--n", type=int, default=8, help="responses per prompt")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seqs", type=int, default=64, help="sequences of the learner throughput batch")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int, default=0, help="0: a share of free memory")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON file to write (rank 0)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.prompts, args.n, args.prompt_len, args.max_tokens = 2, 4, 2, 5, 4
        args.seqs, args.seq_len, args.micro_batch_tokens, args.steps, args.warmup = 4, 12, 16, 1, 0
        args.max_num_seqs, args.kv_cache_tokens = 16, 512
    return args


def sync(group) -> None:
    if group.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


@torch.no_grad()
def init_local(model, std: float = 0.02, seed: int = 0) -> None:
    """Random weights drawn per shard on its device (norms 1): no rank ever holds a whole tensor."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + dist.get_rank())
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if name.endswith("norm.weight"):
            local.fill_(1.0)
        else:
            local.copy_(torch.randn(local.shape, generator=g, device=local.device) * std)


def build(args, group):
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = model_preset("tiny-qwen3-moe" if args.tiny else "qwen3-30b-a3b",
                          None if args.tiny else args.layers)
    with torch.device("meta"):
        model = Qwen3(config, "aligned")
        sampler_model = Qwen3(config, "aligned")
    model = shard_model(model, dtype)
    model.to_empty(device=group.device)
    init_local(model)
    sampler_model = sampler_model.to(dtype).to_empty(device=group.device)  # never whole in fp32
    return model, sampler_model, dtype


def codes_checksum(sampler_model) -> str:
    """A digest of every quantized weight's codes and scales on this rank (equal on all ranks)."""
    from minite.learner import quantized_weights

    h = hashlib.blake2b(digest_size=8)
    for _, qw in sorted(quantized_weights(sampler_model).items()):
        for t in (qw.q.codes, qw.q.block_scales.view(torch.uint8), qw.q.global_scale):
            h.update(t.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def grpo_step(args, group, learner, sampler, sampler_model, dtype) -> dict:
    g = torch.Generator().manual_seed(1)
    vocab = sampler_model.config.vocab_size
    prompts = [torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=7)
    sync(group)
    t0 = time.perf_counter()
    mine = group.share(len(prompts))
    outs = sampler.generate([prompts[i] for i in mine], params, first_index=mine.start)
    local_samples = sum(len(o.samples) for o in outs)
    outs = sorted((o for part in group.gather(outs) for o in part), key=lambda o: o.index)
    sync(group)
    t_rollout = time.perf_counter() - t0
    samples = [(o.prompt_token_ids, s) for o in outs for s in o.samples]
    rewards = torch.randint(0, 2, (len(samples),), generator=g).float()
    batch = SequenceBatch.from_samples([p for p, _ in samples], [s.token_ids for _, s in samples],
                                       [s.logprobs for _, s in samples],
                                       group_advantages(rewards, args.n, AdvantageConfig()), params)
    t0 = time.perf_counter()
    old = learner.logprobs(batch)
    m = learner.step(replace(batch, old_logprobs=old), partial(policy_loss, cfg=LossConfig()))
    sync(group)
    t_learner = time.perf_counter() - t0
    t0 = time.perf_counter()
    gather_quantized_weights(learner.model, sampler_model, dtype)
    sync(group)
    t_sync = time.perf_counter() - t0
    mask = batch.mask(old.device)
    mu = batch.sampler_logprobs.to(old.device)
    # this rank's own samples: the rows it generated, in the gathered order
    start = sum(len(o.samples) for o in outs if o.index < mine.start)
    rows = slice(start, start + local_samples)
    return dict(rollout_s=t_rollout, learner_s=t_learner, sync_s=t_sync, tokens=int(mask.sum()),
                aligned_all=mismatch_metrics(old, mu, mask)["bitwise_equal_frac"],
                aligned_rank=mismatch_metrics(old[rows], mu[rows], mask[rows])["bitwise_equal_frac"],
                loss=m["loss"])


def learner_throughput(args, learner, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (args.seqs, args.seq_len), generator=g)
    batch = SequenceBatch.from_samples(list(ids[:, : args.prompt_len]), list(ids[:, args.prompt_len:]),
                                       advantages=torch.randn(args.seqs, generator=g))
    loss_fn = partial(policy_loss, cfg=LossConfig())
    times = []
    for i in range(args.warmup + args.steps):
        sync(learner.group)
        t0 = time.perf_counter()
        m = learner.step(batch, loss_fn)
        sync(learner.group)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    seconds = statistics.median(times)
    world = learner.group.world_size
    return dict(learner_tokens=int(m["tokens"]), learner_step_s=seconds,
                learner_tokens_per_s=m["tokens"] / seconds,
                learner_tokens_per_s_per_gpu=m["tokens"] / seconds / world)


def main(argv=None) -> None:
    args = parse_args(argv)
    group = distributed.init("cpu" if args.tiny else "cuda")
    if args.tiny:
        torch.set_num_threads(1)
    model, sampler_model, dtype = build(args, group)
    learner = ShardedLearner(model, group, lr=1e-6, micro_batch_tokens=args.micro_batch_tokens,
                             activation_checkpointing=not args.tiny)
    t0 = time.perf_counter()
    gather_quantized_weights(model, sampler_model, dtype)
    first_sync = time.perf_counter() - t0
    sampler = Sampler(sampler_model, max_num_seqs=args.max_num_seqs,
                      kv_cache_tokens=args.kv_cache_tokens or None)
    step = grpo_step(args, group, learner, sampler, sampler_model, dtype)
    checksums = group.gather(codes_checksum(sampler_model))
    row = dict(world_size=group.world_size, layers=model.config.num_hidden_layers,
               params_b=sum(p.numel() for p in model.parameters()) / 1e9, **step,
               same_codes_on_all_ranks=len(set(checksums)) == 1, first_sync_s=first_sync,
               **learner_throughput(args, learner, model.config.vocab_size))
    if group.device.type == "cuda":
        peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=group.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row["peak_mem_gb_max_rank"] = float(peak)
    if group.main:
        report("fsdp_grpo", [row], args.out)
    distributed.close()


if __name__ == "__main__":
    main()
