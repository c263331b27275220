"""Where a rollout decode step spends its time: host phases (schedule, batch build + graph replay
launch, sampling launch, the token read-back that waits for the GPU, bookkeeping) timed around the
sampler's own methods; the GPU's time a step between CUDA events around them (the forward, the
sampling, and the idle time between steps); and the GPU time of one graph replay and of one
sampling call; the prefill steps' wall times (each waits for its tokens) and the run's time
outside any step. With `--kernels N`, also the CUDA kernels of the prefill and of N eager
(graph-free) decode steps under torch.profiler, grouped by name: which of attention, GEMMs, norms
and sampling fill the step. (The profiler is kept away from graph replays: with them it ran past a
90 s cap on the H200.) Same model and workload as `benchmarks/e2e/bench_rollout.py` (dense, bf16 by
default). Prints the breakdown and writes JSON to `--out`.

    python -m benchmarks.tools.profile_rollout --recipe aligned --kernels 6 --out OUT.json
    python -m benchmarks.tools.profile_rollout --model moe --moe-layers 24 --recipe aligned --kernels 4
    python -m benchmarks.tools.profile_rollout --model moe --moe-layers 48 --recipe aligned --sampler-only
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import minite.sampler.engine as engine
from benchmarks.common import print_profile, profile_table, write_json
from benchmarks.e2e import bench_rollout
from minite.sampler import Sampler
from minite.sampling import SamplingParams


def timed(store: dict, name: str, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        store[name] += time.perf_counter() - t
        return out
    return wrapper


def cuda_ms(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def evented(marks: list, kind: str, fn, before: bool):
    def wrapper(*a, **k):
        if before:
            marks.append((kind, torch.cuda.Event(enable_timing=True)))
            marks[-1][1].record()
        out = fn(*a, **k)
        if not before:
            marks.append((kind, torch.cuda.Event(enable_timing=True)))
            marks[-1][1].record()
        return out
    return wrapper


def gpu_phases(marks: list) -> dict[str, float]:
    """ms summed over the steps: "forward" (each step's start to its logits), "sample" (logits to the
    drawn tokens: keys, uniforms, draw, log-probs) and "idle" (one step's end to the next start)."""
    phase = {("start", "logits"): "forward", ("logits", "end"): "sample", ("end", "start"): "idle"}
    ms = dict.fromkeys(phase.values(), 0.0)
    for (k0, e0), (k1, e1) in zip(marks, marks[1:]):
        if (k0, k1) in phase:
            ms[phase[k0, k1]] += e0.elapsed_time(e1)
    return ms


def kernel_tables(model, prompts, params, n_steps: int, kv_tokens: int) -> tuple[list[dict], list[dict]]:
    """CUDA time per kernel of the prefill step(s), and per step over eager decode steps taken
    mid-generation."""
    sampler = Sampler(model, max_num_seqs=512, kv_cache_tokens=kv_tokens, cuda_graphs=False)
    for i, pr in enumerate(prompts):
        sampler.add_request(pr, params, i)

    def prefill():
        while sampler.scheduler.waiting:
            sampler.step()

    prefill_rows = profile_table(prefill)
    for _ in range(40):  # into steady decode
        sampler.step()
    return prefill_rows, profile_table(sampler.step, reps=n_steps)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--recipe", default="bf16")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--kernels", type=int, default=0, help="profile this many eager decode steps")
    p.add_argument("--model", choices=["dense", "moe"], default="dense")
    p.add_argument("--moe-layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64, help="prompts of 8 samples each (the batch)")
    p.add_argument("--sampler-only", action="store_true",
                   help="an NVFP4 recipe on a sampler-only model (bench_rollout --sampler-only)")
    args = p.parse_args()
    bargs = bench_rollout.parse_args(["--backend", "triton", "--moe-layers", str(args.moe_layers),
                                      "--prompts", str(args.prompts)])
    device = torch.device("cuda")
    config = bench_rollout.model_config(args.model, bargs)
    if args.sampler_only and args.recipe.partition("/")[0] != "bf16":
        model = bench_rollout.build_sampler_only(config, args.recipe, device, torch.bfloat16, 0, "triton")
    else:
        model = bench_rollout.build_model(config, device, torch.bfloat16, 0)
        model.set_recipe(bench_rollout.recipe_of(args.recipe, "triton"))
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, config.vocab_size, (bargs.prompts, bargs.prompt_len), generator=g).tolist()
    seqs = bargs.prompts * bargs.samples
    kv_tokens = (seqs + 16) * (bargs.prompt_len + 512 + 16)
    sampler = Sampler(model, max_num_seqs=512, kv_cache_tokens=kv_tokens)
    params = SamplingParams(n=bargs.samples, max_tokens=args.new_tokens, seed=0)
    # Warm: captures every decode graph width the timed run will need.
    sampler.generate(prompts, params)
    torch.cuda.synchronize()

    phases = defaultdict(float)
    sampler.scheduler.schedule = timed(phases, "schedule", sampler.scheduler.schedule)
    sampler._forward = timed(phases, "forward_launch", sampler._forward)
    engine.sample = timed(phases, "sample_launch", engine.sample)
    engine.key_tensor = timed(phases, "key_tensor", engine.key_tensor)
    # CUDA events around each step's GPU work (forward launch .. draw): the time between one step's
    # last event and the next step's first is GPU idle (the host had not queued the next step yet)
    marks: list[tuple[str, torch.cuda.Event]] = []
    sampler._forward = evented(marks, "start", evented(marks, "logits", sampler._forward, before=False),
                               before=True)
    engine.sample = evented(marks, "end", engine.sample, before=False)
    groups = [sampler.add_request(pr, params, i) for i, pr in enumerate(prompts)]
    step_times, kinds = [], []
    t_all = time.perf_counter()
    print(f"warm-up done; timing {seqs} sequences x {args.new_tokens} tokens", flush=True)
    while sampler.has_unfinished():
        t = time.perf_counter()
        before = dict(sampler.stats)
        sampler.step()
        step_times.append(time.perf_counter() - t)
        ran = [k for k in ("decode", "prefill") if sampler.stats[f"{k}_steps"] > before[f"{k}_steps"]]
        kinds.append(ran[0] if ran else "read-back")  # the last: the final tokens read back
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_all
    gpu = gpu_phases(marks)
    tokens = sum(s.num_generated for gr in groups for s in gr.seqs)
    decode = [s for s, k in zip(step_times, kinds) if k == "decode"]
    prefill = [s for s, k in zip(step_times, kinds) if k == "prefill"]
    n = len(step_times)
    other = sum(step_times) - sum(phases.values())

    # GPU-only time of one decode graph replay and of one sampling call at 512 rows.
    graphs = sampler.graphs
    key = max(graphs.graphs)
    graph = graphs.graphs[key][0]
    replay_ms = cuda_ms(graph.replay)
    logits = torch.randn(512, config.vocab_size, device=device, dtype=torch.bfloat16)
    keys = torch.arange(512, device=device)
    steps = torch.zeros(512, dtype=torch.int64, device=device)
    sample_ms = cuda_ms(lambda: engine.sample(logits, [params] * 512, keys, steps))
    result = dict(model=args.model, layers=config.num_hidden_layers, recipe=args.recipe,
                  sampler_only=args.sampler_only, steps=n,
                  decode_steps=len(decode), wall_s=wall,
                  tokens=tokens, tokens_per_s=tokens / wall,
                  decode_step_ms_mean=1e3 * sum(decode) / max(len(decode), 1),
                  prefill_steps_ms=[1e3 * t for t in prefill],  # each waits for its tokens
                  outside_steps_ms=1e3 * (wall - sum(step_times)),
                  phase_ms_per_step={k: 1e3 * v / n for k, v in phases.items()},
                  other_ms_per_step=1e3 * other / n, graph_key=list(key),
                  gpu_busy_ms_per_step=(gpu["forward"] + gpu["sample"]) / n,
                  gpu_forward_ms_per_step=gpu["forward"] / n, gpu_sample_ms_per_step=gpu["sample"] / n,
                  gpu_idle_ms_per_step=gpu["idle"] / n,
                  graph_replay_gpu_ms=replay_ms, sample_gpu_ms=sample_ms)
    if args.kernels:
        del sampler, graphs, graph
        result["prefill_kernels"], result["kernels"] = kernel_tables(model, prompts, params, args.kernels,
                                                                     kv_tokens)
    for k, v in result.items():
        if not k.endswith("kernels"):
            print(f"{k}: {v}")
    if args.kernels:
        print_profile("CUDA kernels of the prefill", result["prefill_kernels"])
        print_profile(f"CUDA kernels per eager decode step ({args.kernels} steps)", result["kernels"])
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
