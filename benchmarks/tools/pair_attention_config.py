"""Dense rollouts (the `bench_rollout` workload, Qwen3-1.7B shape) under attention launch configurations
that differ in num_warps, in paired rounds in one process (the order reversed every other round): the
end-to-end check of a configuration the op sweep (`ops/bench_attention.py`) favours. bf16 runs on the
bf16 model, NVFP4 recipes on sampler-only models. The configuration in use stays CONFIGS["gpu"].

    python -m benchmarks.tools.pair_attention_config --warps 4,2 --recipes bf16,aligned/fp8 --out OUT.json
"""

import argparse

import torch

from benchmarks.common import report
from benchmarks.e2e import bench_rollout
from minite.kernels import attention as ka

KEEP = ("recipe", "tokens_per_s", "decode_step_ms", "roofline_ms", "roofline_frac", "sequences", "gen_tokens",
        "peak_gb", "sampler_only")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warps", default="4,2")
    p.add_argument("--recipes", default="bf16,aligned/fp8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    bargs = bench_rollout.parse_args(["--backend", "triton", "--no-hf"])
    config = bench_rollout.model_config("dense", bargs)
    prompts = bench_rollout.workload_prompts(config, bargs.prompts, bargs)
    warps = [int(w) for w in args.warps.split(",")]
    chosen = dict(ka.CONFIGS["gpu"])
    rows = []
    for spec in args.recipes.split(","):
        if spec.partition("/")[0] == "bf16":
            model = bench_rollout.build_model(config, device, torch.bfloat16, 0)
        else:
            model = bench_rollout.build_sampler_only(config, spec, device, torch.bfloat16, 0, "triton")
        for rnd in range(args.rounds):
            for w in warps if rnd % 2 == 0 else warps[::-1]:
                ka.CONFIGS["gpu"] = dict(chosen, num_warps=w)
                row = bench_rollout.run_ours(model, spec, prompts, bargs, device)
                rows.append(dict(round=rnd, warps=w, **{k: row[k] for k in KEEP if k in row}))
        ka.CONFIGS["gpu"] = chosen
        del model
        torch.cuda.empty_cache()
    report("dense rollout, attention num_warps paired", rows, args.out)


if __name__ == "__main__":
    main()
