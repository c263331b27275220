"""Rollout throughput against batch size: each recipe's tokens/s and its ratio to bf16 at the same
number of sequences (`vs_bf16`; `steps_vs_bf16` the decode steps' alone, without the prefill), the
`bench_rollout` workload (random prompts of `--prompt-len` tokens,
`--samples` per prompt, `--new-tokens` each, no stop token) at several batch sizes.

Where NVFP4 pays on Hopper depends on the batch: a decode step of few sequences reads its weights
and KV cache (bandwidth-bound, where 4-bit weights and an fp8 KV cache read fewer bytes); at
hundreds of sequences the GEMMs are compute-bound on bf16 MMAs (Hopper has no FP4 tensor cores),
and only the KV-cache bytes still differ. One model per recipe is built and swept over every batch
size, then freed (`--sampler-only`: NVFP4 recipes on sampler-only models, as `bench_rollout`), so
recipes run one after the other in one process, not interleaved; `--rounds` repeats each batch size
(the median row is kept). Writes JSON (GPU, date, commit, rows) and, with `--plot`, a figure of the
ratios against batch size (also from a finished JSON: `--plot-from`).

    python -m benchmarks.e2e.sweep_rollout_batch --model moe --sampler-only --new-tokens 256 \
        --recipes bf16,aligned/fp8 --sequences 64,128,256,512 --out OUT.json --plot OUT.png
    python -m benchmarks.e2e.sweep_rollout_batch --plot-from OUT.json --plot OUT.png
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from benchmarks.common import report
from benchmarks.e2e import bench_rollout

KEEP = ("tokens_per_s", "decode_step_ms", "outside_decode_s", "roofline_ms", "roofline_frac",
        "step_weight_gb", "step_kv_gb", "gen_tokens", "peak_gb", "sampler_only", "preemptions")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dense", choices=["dense", "moe"])
    p.add_argument("--recipes", default="bf16,aligned,aligned/fp8")
    p.add_argument("--sequences", default="64,128,256,512", help="batch sizes (multiples of --samples)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None, help="PNG of tokens/s and the ratio to bf16 against sequences")
    p.add_argument("--plot-from", default=None, help="draw --plot from this sweep's JSON; run nothing")
    args, rest = p.parse_known_args(argv)
    args.rollout = bench_rollout.parse_args(["--no-hf", *rest])  # workload and engine options
    return args


def sweep(args) -> list[dict]:
    bargs = args.rollout
    device = torch.device("cuda" if torch.cuda.is_available() and not bargs.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = bench_rollout.model_config(args.model, bargs)
    sizes = [int(s) for s in args.sequences.split(",")]
    if any(s % bargs.samples or s <= 0 for s in sizes):
        raise SystemExit(f"--sequences {sizes} must be positive multiples of --samples={bargs.samples}")
    bargs.max_num_seqs = max(bargs.max_num_seqs, *sizes)
    rows = []
    for spec in args.recipes.split(","):
        if bargs.sampler_only and spec.partition("/")[0] != "bf16":
            model = bench_rollout.build_sampler_only(config, spec, device, dtype, bargs.seed, bargs.backend)
        else:
            model = bench_rollout.build_model(config, device, dtype, bargs.seed)
        for seqs in sizes:
            prompts = bench_rollout.workload_prompts(config, seqs // bargs.samples, bargs)
            runs = []
            for _ in range(args.rounds):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                runs.append(bench_rollout.run_ours(model, spec, prompts, bargs, device))
            best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
            row = dict(model=args.model, layers=config.num_hidden_layers, recipe=spec, sequences=seqs,
                       rounds=len(runs), tokens_per_s_runs=[r["tokens_per_s"] for r in runs],
                       **{k: best[k] for k in KEEP if k in best})
            rows.append(row)
            print(row, flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = {r["sequences"]: r for r in rows if r["recipe"] == "bf16"}
    for r in rows:
        if r["sequences"] in base:
            b = base[r["sequences"]]
            r["vs_bf16"] = r["tokens_per_s"] / b["tokens_per_s"]
            r["steps_vs_bf16"] = b["decode_step_ms"] / r["decode_step_ms"]  # the decode steps alone
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    for spec in dict.fromkeys(r["recipe"] for r in rows):
        mine = sorted((r for r in rows if r["recipe"] == spec), key=lambda r: r["sequences"])
        x = [r["sequences"] for r in mine]
        ax_t.plot(x, [r["tokens_per_s"] / 1e3 for r in mine], marker="o", label=spec)
        if all("vs_bf16" in r for r in mine) and spec != "bf16":
            ax_r.plot(x, [r["vs_bf16"] for r in mine], marker="o", label=spec)
    ax_r.axhline(1.0, color="gray", lw=0.8)
    for ax, ylabel in ((ax_t, "generated tokens/s (thousands)"), (ax_r, "tokens/s / bf16 at the same batch")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequences in the batch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if args.plot_from:
        data = json.load(open(args.plot_from))
        rows, env = data["rows"], data.get("env", {})
    else:
        rows = sweep(args)
        w = args.rollout
        workload = dict(samples=w.samples, new_tokens=w.new_tokens, prompt_len=w.prompt_len,
                        sampler_only=w.sampler_only, backend=w.backend, rounds=args.rounds,
                        order="recipes one after the other, each over every batch size")
        ratios = [r["vs_bf16"] for r in rows if r["recipe"] != "bf16" and "vs_bf16" in r]
        report("rollout against batch size", rows, args.out,
               extra=dict(workload=workload, vs_bf16_median=statistics.median(ratios) if ratios else None))
        env = {}
    if args.plot and rows:
        where = f" ({env['gpu']}, {env.get('date', '')[:10]}, {env.get('commit', '')})" if env else ""
        plot(rows, args.plot, f"{rows[0]['model']} ({rows[0]['layers']} layers): rollout against batch size"
             f"{where}")


if __name__ == "__main__":
    main()
