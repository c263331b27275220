"""Learner throughput: packed tokens per second of one `Learner.step` (forward + backward over
micro-batches, AdamW on fp32 masters, weight re-quantization), per recipe and model shape.

Models (random weights, bf16 parameters on the GPU): the shapes of the rollout benchmark, Qwen3-1.7B
(dense, 28 layers) and Qwen3-30B-A3B (MoE: 128 experts, top-8) with fewer layers (--moe-layers,
default 4: the fp32 masters and Adam moments of all 48 layers would not fit one GPU). Batch: --seqs
sequences of --seq-len tokens (--prompt-len prompt, the rest response), PPO-clipped policy loss with
random advantages. Time: median over --steps steps after --warmup steps (CUDA synchronized).

    python -m benchmarks.e2e.bench_learner --out OUT.json [--kernels]
    python -m benchmarks.e2e.bench_learner --tiny          # CPU smoke run on the tiny presets
"""

import argparse
import gc
import json
import statistics
import time
from functools import partial

import torch

from benchmarks.common import env_info, print_profile, profile_table, report, sync, write_json
from minite.learner import Learner, SequenceBatch
from minite.models import Qwen3
from minite.models.presets import model_preset
from minite.recipe import get_recipe
from minite.rl.losses import LossConfig, policy_loss


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, tiny batch, fp32")
    p.add_argument("--models", default="dense,moe", help="comma list of dense,moe")
    p.add_argument("--recipes", default="bf16,aligned", help="comma list of recipe names")
    p.add_argument("--backend", default="auto", choices=["auto", "ref", "triton"],
                   help="backend of the NVFP4 recipes (auto: the kernels on CUDA, the reference elsewhere)")
    p.add_argument("--dense-layers", type=int, default=28)
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--keep-grads", action="store_true",
                   help="Learner(release_grads=False): the grads stay allocated between steps")
    p.add_argument("--kernels", action="store_true",
                   help="also profile one step: the kernels (CPU: ops) with the most time, per recipe")
    p.add_argument("--out", default=None, help="JSON file to write")
    args = p.parse_args(argv)
    if args.tiny:
        args.dense_layers = args.moe_layers = 2
        args.seqs, args.seq_len, args.prompt_len, args.micro_batch_tokens = 3, 12, 4, 16
        args.steps, args.warmup, args.backend = 1, 0, "ref"
    return args


def build(kind: str, recipe: str, args) -> Qwen3:
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        config = model_preset("tiny-qwen3" if kind == "dense" else "tiny-qwen3-moe")
    else:
        config = model_preset("qwen3-1.7b", args.dense_layers) if kind == "dense" \
            else model_preset("qwen3-30b-a3b", args.moe_layers)
    with torch.device(device):
        model = Qwen3(config, get_recipe(recipe).with_execution(backend=args.backend))
    model.init_weights(0.02, torch.Generator().manual_seed(0))  # drawn on the model's device
    return model.to(dtype)


def make_batch(vocab: int, args) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (args.seqs, args.seq_len), generator=g)
    prompts, responses = ids[:, : args.prompt_len], ids[:, args.prompt_len:]
    advantages = torch.randn(args.seqs, generator=g)
    return SequenceBatch.from_samples(list(prompts), list(responses), advantages=advantages)


class GcTimer:
    """Time spent in Python's garbage collector between start() and stop(), and collections by generation."""

    def __init__(self):
        self.seconds, self.collections, self._t0 = 0.0, [0, 0, 0], None

    def _callback(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections[info["generation"]] += 1
            self._t0 = None

    def start(self):
        gc.callbacks.append(self._callback)

    def stop(self):
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def bench_one(kind: str, recipe: str, args) -> dict:
    model = build(kind, recipe, args)
    learner = Learner(model, lr=1e-6, micro_batch_tokens=args.micro_batch_tokens,
                      activation_checkpointing=args.activation_checkpointing,
                      release_grads=not args.keep_grads)
    batch = make_batch(model.config.vocab_size, args)
    loss_fn = partial(policy_loss, cfg=LossConfig())
    times, gc_time = [], GcTimer()
    for i in range(args.warmup + args.steps):
        sync()
        if i == args.warmup:
            gc_time.start()
        t0 = time.perf_counter()
        m = learner.step(batch, loss_fn)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    gc_time.stop()
    seconds = statistics.median(times)
    row = dict(model=kind, layers=model.config.num_hidden_layers, recipe=recipe,
               params_m=sum(p.numel() for p in model.parameters()) / 1e6, tokens=int(m["tokens"]),
               micro_batches=int(m["micro_batches"]), step_s=seconds, tokens_per_s=m["tokens"] / seconds,
               steps_s=[round(t, 4) for t in times], gc_ms_per_step=gc_time.seconds * 1e3 / len(times),
               gc_collections=gc_time.collections)
    if torch.cuda.is_available() and not args.tiny:
        row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 2**30
        # what the step leaves allocated for the rollout that follows it (grads freed: Learner docstring)
        row["between_steps_mem_gb"] = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    del learner, model
    release_frozen()
    return row


def release_frozen() -> None:
    """Undo the learner's gc.freeze() (the next model's learner freezes its own objects) and collect."""
    gc.unfreeze()
    gc.collect()


def profile_one(kind: str, recipe: str, args) -> list[dict]:
    """The kernels of one learner step (after one unprofiled step), on a model of its own: run after every
    timing, since a CUDA profile slows the launches that follow it in the process (an aligned dense step
    timed after the bf16 step's profile reads slower than unprofiled)."""
    model = build(kind, recipe, args)
    learner = Learner(model, lr=1e-6, micro_batch_tokens=args.micro_batch_tokens,
                      activation_checkpointing=args.activation_checkpointing)
    batch = make_batch(model.config.vocab_size, args)
    step = partial(learner.step, batch, partial(policy_loss, cfg=LossConfig()))
    step()
    table = profile_table(step)
    print_profile(f"{kind} {recipe}: one learner step", table)
    del learner, model
    release_frozen()
    return table


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench_learner needs CUDA (or --tiny for a CPU smoke run)")
    rows = []
    for kind in args.models.split(","):
        for recipe in args.recipes.split(","):
            rows.append(bench_one(kind, recipe, args))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for row in rows if args.kernels else []:
        row["kernels"] = profile_one(row["model"], row["recipe"], args)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for kind in {r["model"] for r in rows}:
        base = next((r for r in rows if r["model"] == kind and r["recipe"] == "bf16"), None)
        for r in rows:
            if base and r["model"] == kind:
                r["vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
    setup = {k: getattr(args, k) for k in ("seqs", "seq_len", "prompt_len", "micro_batch_tokens", "backend",
                                           "activation_checkpointing", "keep_grads", "steps", "warmup",
                                           "tiny")}
    table_rows = [{k: v for k, v in r.items() if k != "kernels"} for r in rows]
    report("learner train step (tokens/s)", table_rows, None)
    if args.out:
        write_json(args.out, dict(benchmark="learner", setup=setup, rows=rows))
    print(json.dumps({"benchmark": "learner", "env": env_info(), "setup": setup, "rows": table_rows}))
    return rows


if __name__ == "__main__":
    main()
