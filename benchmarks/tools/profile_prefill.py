"""Where a rollout's prefill step spends its time: host against GPU, per recipe.

A prefill step runs eagerly (no CUDA graph) and ends by reading its sampled tokens back, so its wall
time is the host's launch time or the GPU's work, whichever ends later, plus any wait the host makes
inside. This times, per recipe, on the workload of `benchmarks/e2e/bench_rollout.py` (one step over
all prompts, each sample of a prompt sharing its prefill): the step's wall time, the host time until
the forward returned (`forward_host_ms`, every kernel launched), the GPU time of the forward between
CUDA events; then the step under cProfile (the functions with the most host time, own and in total)
and under torch.profiler (the CPU ops and runtime calls with the most host time: a
`cudaStreamSynchronize` or `aten::item` there is a wait inside the step).

    python -m benchmarks.tools.profile_prefill --model moe --moe-layers 48 --sampler-only --prompts 16
    python -m benchmarks.tools.profile_prefill --tiny
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from functools import partial

import torch

from benchmarks.common import cprofile_top, sync, write_json
from benchmarks.e2e import bench_rollout
from minite.sampler import Sampler
from minite.sampling import SamplingParams


def build(args, recipe: str, device):
    tiny = ["--tiny"] if args.tiny else []
    bargs = bench_rollout.parse_args([*tiny, "--moe-layers", str(args.moe_layers)])
    config = bench_rollout.model_config(args.model, bargs)
    if args.sampler_only and recipe.partition("/")[0] != "bf16":
        return bench_rollout.build_sampler_only(config, recipe, device, torch.bfloat16, 0, args.backend)
    model = bench_rollout.build_model(config, device, torch.bfloat16, 0)
    model.set_recipe(bench_rollout.recipe_of(recipe, args.backend))
    return model


def prefill_step(sampler: Sampler, prompts, params, cuda: bool) -> dict:
    """One prefill step over `prompts` (max_tokens 1: it finishes them): wall and host times (ms)."""
    for i, prompt in enumerate(prompts):
        sampler.add_request(prompt, params, i)
    marks, forward = {}, sampler._forward

    def timed_forward(*a, **k):
        if cuda:
            marks["start"] = torch.cuda.Event(enable_timing=True)
            marks["start"].record()
        out = forward(*a, **k)
        marks["host"] = time.perf_counter()
        if cuda:
            marks["end"] = torch.cuda.Event(enable_timing=True)
            marks["end"].record()
        return out

    sampler._forward = timed_forward
    sync()
    t0 = time.perf_counter()
    sampler.step()
    wall = time.perf_counter() - t0
    sync()
    sampler._forward = forward
    if sampler.has_unfinished():
        raise RuntimeError("the prefill step left requests unfinished (max_tokens must be 1)")
    gpu = marks["start"].elapsed_time(marks["end"]) if cuda else None
    return dict(step_ms=1e3 * wall, forward_host_ms=1e3 * (marks["host"] - t0), forward_gpu_ms=gpu)


def host_ops(fn, cuda: bool, top: int = 25) -> list[dict]:
    """torch.profiler's CPU-side events of fn() by self host time (ops and CUDA runtime calls)."""
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CPU, act.CUDA] if cuda else [act.CPU]) as prof:
        fn()
        sync()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [dict(name=e.key[:120], calls=e.count, self_host_us=e.self_cpu_time_total) for e in events[:top]]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--recipes", default="bf16,aligned")
    p.add_argument("--model", choices=["dense", "moe"], default="moe")
    p.add_argument("--moe-layers", type=int, default=48)
    p.add_argument("--prompts", type=int, default=16, help="prompts of 8 samples each")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--sampler-only", action="store_true")
    p.add_argument("--backend", default="triton")
    p.add_argument("--reps", type=int, default=3, help="timed prefill steps after one warm-up step")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (smoke test)")
    args = p.parse_args()
    cuda = not args.tiny and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.tiny:
        args.backend, args.sampler_only = "ref", False
    rows = []
    for recipe in args.recipes.split(","):
        model = build(args, recipe, device)
        g = torch.Generator().manual_seed(1)
        shape = (args.prompts, args.prompt_len)
        prompts = torch.randint(0, model.config.vocab_size, shape, generator=g).tolist()
        params = SamplingParams(n=8, max_tokens=1, seed=0)
        sampler = Sampler(model, max_num_seqs=8 * args.prompts,
                          kv_cache_tokens=8 * args.prompts * (args.prompt_len + 16) + 4096)
        prefill_step(sampler, prompts, params, cuda)  # compiles the prefill's kernels
        steps = [prefill_step(sampler, prompts, params, cuda) for _ in range(args.reps)]
        prof = cProfile.Profile()
        prof.enable()
        prefill_step(sampler, prompts, params, cuda)
        prof.disable()
        stats = pstats.Stats(prof)
        row = dict(recipe=recipe, tokens=args.prompts * args.prompt_len, steps=steps,
                   tottime=cprofile_top(stats, "tottime"), cumtime=cprofile_top(stats, "cumulative", top=40),
                   host_ops=host_ops(partial(prefill_step, sampler, prompts, params, cuda), cuda))
        print(f"== {recipe}: {row['tokens']} prompt tokens")
        for s in steps:
            print("  " + ", ".join(f"{k} {v:.1f}" for k, v in s.items() if v is not None))
        for r in row["tottime"][:20]:
            print(f"  self {r['tottime_us'] / 1e3:8.2f} ms  total {r['cumtime_us'] / 1e3:8.2f} ms  "
                  f"{r['calls']:6.0f}x  {r['function']}")
        for r in row["host_ops"][:15]:
            print(f"  host {r['self_host_us'] / 1e3:8.2f} ms  {r['calls']:6d}x  {r['name']}")
        rows.append(row)
        del sampler, model
        gc.collect()  # the sampler and model hold reference cycles: free them before the next model
        if cuda:
            torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, dict(benchmark="prefill host profile", rows=rows))


if __name__ == "__main__":
    main()
