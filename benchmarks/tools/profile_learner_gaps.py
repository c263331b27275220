"""Where the GPU waits during a learner step: the idle gaps of its stream, by the step's phase.

One dense step per recipe (after two unprofiled ones) under torch.profiler. The kernels' intervals
give the GPU's busy time; every gap between consecutive kernels is charged to the phase the host was
in when it launched the kernel that ended the gap (the host was late there). Phases are marked by
wrapping the learner's pieces: `pack` (micro-batch split and rows), `forward` (sequence_logprobs),
`loss`, `backward` (the rest of a micro-batch), `optimizer`, `refresh` (sync_weights), `metrics`;
and to the longest host op running at that launch (`idle_by_host_op_ms`).
The profiler slows the host by a few us an op, so the gaps read larger than unprofiled; compare
recipes within one run.

    python -m benchmarks.tools.profile_learner_gaps --out OUT.json [--recipes bf16,aligned] [--top 25]
"""

import argparse
import contextlib
import json
import os
import tempfile
from functools import partial

import torch

import minite.learner.learner as learner_mod
from benchmarks.common import sync, write_json
from benchmarks.e2e.bench_learner import build, make_batch, parse_args, release_frozen
from minite.learner import Learner
from minite.rl.losses import LossConfig, policy_loss

PHASES = ("pack", "forward", "loss", "optimizer", "refresh", "metrics")
_MARK = "phase:"


def marked(name: str, fn):
    def run(*args, **kwargs):
        with torch.profiler.record_function(_MARK + name):
            return fn(*args, **kwargs)
    return run


@contextlib.contextmanager
def phase_marks(learner: Learner):
    """Wrap the learner's pieces in record_function ranges; restored on exit."""
    saved = {k: getattr(learner_mod, k) for k in ("micro_batches", "sequence_logprobs", "sync_weights",
                                                   "_to_floats")}
    names = dict(micro_batches="pack", sequence_logprobs="forward", sync_weights="refresh",
                 _to_floats="metrics")
    opt_step = learner.optimizer.step_queued
    try:
        for k, v in saved.items():
            setattr(learner_mod, k, marked(names[k], v))
        learner.optimizer.step_queued = marked("optimizer", opt_step)
        yield
    finally:
        for k, v in saved.items():
            setattr(learner_mod, k, v)
        learner.optimizer.step_queued = opt_step


def phase_at(ranges: list[tuple[float, float, str]], ts: float) -> str:
    inner = [r for r in ranges if r[0] <= ts <= r[1]]
    return min(inner, key=lambda r: r[1] - r[0])[2] if inner else "backward"


def analyse(trace: dict, top: int) -> dict:
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and "args" in e}
    ranges = [(e["ts"], e["ts"] + e["dur"], e["name"][len(_MARK):]) for e in events
              if e.get("cat") == "user_annotation" and e["name"].startswith(_MARK)]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    step = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == "learner_step")
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    busy, end, gaps, by_phase = 0.0, None, [], {}
    for k in kernels:
        s, e = k["ts"], k["ts"] + k["dur"]
        if end is not None and s > end:
            launch = launches.get(k["args"].get("correlation"))
            lt = launch["ts"] if launch else s
            ph = phase_at(ranges, lt)
            by_phase[ph] = by_phase.get(ph, 0.0) + (s - end)
            ops = [o for o in cpu_ops if o["ts"] <= lt <= o["ts"] + o["dur"]]
            op = max(ops, key=lambda o: o["dur"])["name"] if ops else "?"
            gaps.append(dict(us=s - end, at_ms=(s - t0) / 1e3, phase=ph, kernel=k["name"][:80],
                             host_op=op[:100]))
        busy += max(0.0, e - max(s, end or s))
        end = max(end or e, e)
    by_op: dict[tuple[str, str], float] = {}
    for g in gaps:
        by_op[g["phase"], g["host_op"]] = by_op.get((g["phase"], g["host_op"]), 0.0) + g["us"]
    first = kernels[0]["ts"] if kernels else t0
    return dict(wall_ms=(t1 - t0) / 1e3, gpu_busy_ms=busy / 1e3, kernels=len(kernels),
                idle_before_first_kernel_ms=(first - t0) / 1e3,
                idle_after_last_kernel_ms=(t1 - end) / 1e3 if end else 0.0,
                idle_between_kernels_ms=sum(g["us"] for g in gaps) / 1e3,
                idle_by_phase_ms={k: round(v / 1e3, 3)
                                  for k, v in sorted(by_phase.items(), key=lambda x: -x[1])},
                phase_host_ms={p: round(sum(r[1] - r[0] for r in ranges if r[2] == p) / 1e3, 3)
                               for p in PHASES},
                idle_by_host_op_ms=[dict(phase=k[0], host_op=k[1], ms=round(v / 1e3, 3))
                                    for k, v in sorted(by_op.items(), key=lambda x: -x[1])[:top]],
                top_gaps=sorted(gaps, key=lambda g: -g["us"])[:top])


def probe(recipe: str, args) -> dict:
    model = build("dense", recipe, args)
    learner = Learner(model, lr=1e-6, micro_batch_tokens=args.micro_batch_tokens)
    batch = make_batch(model.config.vocab_size, args)
    loss = marked("loss", partial(policy_loss, cfg=LossConfig()))
    for _ in range(2):
        learner.step(batch, loss)
    sync()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with phase_marks(learner), torch.profiler.profile(activities=acts) as prof:
        with torch.profiler.record_function("learner_step"):
            learner.step(batch, loss)
        sync()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    del learner, model
    release_frozen()
    return dict(recipe=recipe, **analyse(trace, args.top))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--recipes", default="bf16,aligned")
    p.add_argument("--top", type=int, default=25)
    own, rest = p.parse_known_args()
    args = parse_args(rest)
    args.top = own.top
    rows = [probe(r, args) for r in own.recipes.split(",")]
    for r in rows:
        print(f"{r['recipe']}: wall {r['wall_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f}, idle before "
              f"first {r['idle_before_first_kernel_ms']:.1f}, after {r['idle_after_last_kernel_ms']:.1f}, "
              f"between {r['idle_between_kernels_ms']:.1f}, by phase "
              f"{r['idle_by_phase_ms']}, host per phase {r['phase_host_ms']}")
        for g in r["idle_by_host_op_ms"][:15]:
            print("   ", g)
    if own.out:
        write_json(own.out, dict(benchmark="learner_gaps", rows=rows))


if __name__ == "__main__":
    main()
