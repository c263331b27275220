"""Where the learner step's host time goes (cProfile), bf16 against an NVFP4 recipe, dense model.

Session 7 run5: the dense aligned step's kernels took 2 % more GPU time than bf16's (1.177 vs 1.152 s)
but the step 14 % more wall time (1.351 vs 1.189 s): the GPU waits on the host. This prints, per
recipe, the step's wall time, the host time until the step returned (`enqueue_s`), and the functions
with the most host time of their own and in total (minite's, torch's, triton's).

    python benchmarks/profile_learner_host.py --out OUT.json [--layers 28] [--tiny]
"""

import argparse
import cProfile
import json
import pstats
import time
from functools import partial

import torch
from bench_common import env_info
from bench_learner import build, make_batch, parse_args, sync

from minite.learner import Learner
from minite.rl.losses import LossConfig, policy_loss

TOP = 30


def top_entries(stats: pstats.Stats, key: str) -> list[dict]:
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:TOP]:
        cc, nc, tt, ct, _ = stats.stats[func]
        rows.append(dict(function=f"{func[0].split('site-packages/')[-1]}:{func[1]}({func[2]})", calls=nc,
                         tottime_ms=tt * 1e3, cumtime_ms=ct * 1e3))
    return rows


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
        row = dict(recipe=recipe, step_s=wall, enqueue_s=t1 - t0, tottime=top_entries(stats, "tottime"),
                   cumtime=top_entries(stats, "cumulative"))
        print(f"== {recipe}: step {wall:.3f} s, host returned after {t1 - t0:.3f} s")
        for r in row["tottime"][:20]:
            print(f"  self {r['tottime_ms']:8.1f} ms  total {r['cumtime_ms']:8.1f} ms  {r['calls']:6d}x  "
                  f"{r['function']}")
        out.append(row)
        del learner, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env_info(), rows=out), f, indent=1)


if __name__ == "__main__":
    main()
