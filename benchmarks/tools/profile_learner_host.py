"""Where the learner step's host time goes (cProfile), bf16 against an NVFP4 recipe, dense model.

The aligned step's kernels take about as much GPU time as bf16's; the rest of its wall time is the
host's (docs/performance.md). This prints, per recipe, the step's wall time, the host time until the
step returned (`enqueue_s`), and the functions with the most host time of their own and in total
(minite's, torch's, triton's).

    python -m benchmarks.tools.profile_learner_host --out OUT.json [--layers 28] [--tiny]
"""

import argparse
import cProfile
import pstats
import time
from functools import partial

import torch

from benchmarks.common import cprofile_top, sync, write_json
from benchmarks.e2e.bench_learner import build, make_batch, parse_args
from minite.learner import Learner
from minite.rl.losses import LossConfig, policy_loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--recipes", default="bf16,aligned")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    bargs = parse_args(["--tiny"] if args.tiny else ["--dense-layers", str(args.layers)])
    out = []
    for recipe in args.recipes.split(","):
        model = build("dense", recipe, bargs)
        learner = Learner(model, lr=1e-6, micro_batch_tokens=bargs.micro_batch_tokens)
        batch = make_batch(model.config.vocab_size, bargs)
        step = partial(learner.step, batch, partial(policy_loss, cfg=LossConfig()))
        for _ in range(2):
            step()
        sync()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        wall = time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        step()
        sync()
        prof.disable()
        stats = pstats.Stats(prof)
        row = dict(recipe=recipe, step_s=wall, enqueue_s=t1 - t0, tottime=cprofile_top(stats, "tottime"),
                   cumtime=cprofile_top(stats, "cumulative"))
        print(f"== {recipe}: step {wall:.3f} s, host returned after {t1 - t0:.3f} s")
        for r in row["tottime"][:20]:
            print(f"  self {r['tottime_us'] / 1e3:8.1f} ms  total {r['cumtime_us'] / 1e3:8.1f} ms  "
                  f"{r['calls']:6.0f}x  {r['function']}")
        out.append(row)
        del learner, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, dict(benchmark="learner host profile", rows=out))


if __name__ == "__main__":
    main()
