"""The report of an experiment: per-arm curves over RL steps (mean over seeds, min-max band), a table
of final held-out accuracy (mean and std over seeds), reward, mismatch and throughput per arm.

Writes `report.json` (every number), `report.md` (the table) and `curves.png` into the experiment's
output folder; runs still going are included with the steps they have.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from minite.experiment.launch import run_dir
from minite.experiment.spec import Experiment

# (metric key of the rl records, panel title, log scale)
CURVES = [("reward", "rollout reward (moving mean)", False),
          ("eval/accuracy", "held-out greedy accuracy", False),
          ("eval/accuracy_gain", "held-out accuracy gain since the first evaluation", False),
          ("mismatch/k3_kl", "k3_kl (sampler vs learner)", True),
          ("mismatch/logprob_abs_diff_p99", "|delta log-prob| p99", True),
          ("mismatch/logprob_abs_diff_mean", "|delta log-prob| mean", True),
          ("triage/mass_amp_neg", "amplifying mass (A<0, g<0)", True),
          ("triage/mass_amp_pos", "amplifying mass (A>0, g>0)", True),
          ("triage/imbalance", "imbalance M- / M+ (steps with M+ > 0)", True),
          ("triage/tail_concentration", "tail concentration", False)]
SMOOTH = 10  # steps in the reward's moving mean
THROUGHPUT = {"rollout_tokens_per_s": "rollout/tokens_per_s", "learner_tokens_per_s": "learner/tokens_per_s",
              "step_s": "time/step_s", "weight_sync_s": "time/weight_sync_s"}


def _stats(values: list[float]) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "std": None, "n": 0, "values": []}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "n": len(values), "values": values}


def _series(records: list[dict], key: str) -> dict[int, float]:
    if key == "eval/accuracy_gain":  # the warm start differs by seed and learner recipe: gain, paired per run
        acc = _series(records, "eval/accuracy")
        return {s: v - acc[min(acc)] for s, v in acc.items()}
    if key == "triage/imbalance":  # a step with an empty positive side has no finite ratio: left out
        return {r["step"]: imbalance([r]) for r in records
                if r.get("kind") == "rl" and "triage/mass_amp_neg" in r and math.isfinite(imbalance([r]))}
    kind = "eval" if key.startswith("eval/") else "rl"
    out = {r["step"]: float(r[key]) for r in records if r.get("kind") == kind and key in r}
    if key == "reward":
        steps = sorted(out)
        out = {s: statistics.fmean(out[t] for t in steps[max(0, i - SMOOTH + 1): i + 1])
               for i, s in enumerate(steps)}
    return out


def _band(per_seed: list[dict[int, float]]) -> dict:
    steps = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    rows = [[s[t] for s in per_seed] for t in steps]
    return {"steps": steps, "mean": [statistics.fmean(r) for r in rows],
            "min": [min(r) for r in rows], "max": [max(r) for r in rows]}


def read_records(path: Path) -> list[dict]:
    """A run's metrics.jsonl; a line still being written by a running run is left out."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def collect(exp: Experiment, out: Path) -> dict:
    arms = {}
    for arm in exp.arms:
        runs = {}
        for seed in exp.seeds:
            path = run_dir(out, arm, seed) / "metrics.jsonl"
            if path.is_file():
                runs[seed] = read_records(path)
        arms[arm.name] = runs
    return arms


def imbalance(rl: list[dict]) -> float | None:
    """M- / M+ of a run: the amplifying masses summed over its steps (a per-step ratio is unbounded
    where one side is empty); inf where only the negative side has mass."""
    neg = sum(r.get("triage/mass_amp_neg", 0.0) for r in rl)
    pos = sum(r.get("triage/mass_amp_pos", 0.0) for r in rl)
    if not any("triage/mass_amp_neg" in r for r in rl):
        return None
    if pos <= 1e-12:
        return 1.0 if neg <= 1e-12 else math.inf
    return neg / pos


def summarize_arm(runs: dict[int, list[dict]]) -> dict:
    finals, gains, rewards, steps, imbalances = [], [], [], [], []
    means = {k: [] for k in (*THROUGHPUT, "k3_kl", "logprob_abs_diff_p99", "bitwise_equal_frac")}
    for records in runs.values():
        rl = [r for r in records if r.get("kind") == "rl"]
        ev = [r for r in records if r.get("kind") == "eval"]
        steps.append(rl[-1]["step"] if rl else 0)
        if ev:
            finals.append(ev[-1]["eval/accuracy"])
            gains.append(ev[-1]["eval/accuracy"] - ev[0]["eval/accuracy"])
        if rl:
            tail = rl[-max(1, len(rl) // 5):]
            rewards.append(statistics.fmean(r["reward"] for r in tail))
            for name, key in THROUGHPUT.items():
                # the first step compiles kernels and captures graphs: leave it out where there are more
                values = [r[key] for r in (rl[1:] or rl) if key in r]
                means[name].append(statistics.fmean(values) if values else None)
            for name in ("k3_kl", "logprob_abs_diff_p99", "bitwise_equal_frac"):
                values = [r[f"mismatch/{name}"] for r in rl if f"mismatch/{name}" in r]
                means[name].append(statistics.fmean(values) if values else None)
            imbalances.append(imbalance(rl))
    finite = [v for v in imbalances if v is not None]
    return {"seeds": sorted(runs), "steps": steps, "final_accuracy": _stats(finals),
            "accuracy_gain": _stats(gains), "reward_last_fifth": _stats(rewards),
            "imbalance": {**_stats(finite), "inf": any(math.isinf(v) for v in finite)},
            **{k: _stats(v) for k, v in means.items()}}


def write_report(exp: Experiment, out: str | Path) -> dict:
    out = Path(out)
    data = collect(exp, out)
    report = {"experiment": exp.name, "description": exp.description, "seeds": list(exp.seeds), "arms": {},
              "curves": {}}
    for arm in exp.arms:
        runs = data[arm.name]
        report["arms"][arm.name] = {"label": arm.label, "overrides": list(arm.overrides),
                                    **summarize_arm(runs)}
        report["curves"][arm.name] = {key: _band([_series(r, key) for r in runs.values()])
                                      for key, *_ in CURVES}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(markdown_table(report))
    plot(report, out / "curves.png")
    return report


def _fmt(s: dict, digits: int = 3, scale: float = 1.0, signed: bool = False) -> str:
    if s["mean"] is None:
        return "-"
    sign = "+" if signed else ""
    if s["n"] > 1:
        return f"{s['mean'] * scale:{sign}.{digits}f} ± {s['std'] * scale:.{digits}f}"
    return f"{s['mean'] * scale:{sign}.{digits}f}"


def _pct(s: dict) -> str:
    if s["mean"] is None:
        return "-"
    return "100 %" if s["mean"] == 1 else f"{100 * s['mean']:.3f} %"


def markdown_table(report: dict) -> str:
    lines = [f"# {report['experiment']}", "", report["description"], "",
             f"Seeds {report['seeds']}; mean ± std over seeds. Accuracy gain: final minus first held-out "
             "evaluation of each run (the warm start differs by seed and learner recipe). Mismatch columns: "
             "means over steps; M-/M+: the amplifying masses summed over steps.", "",
             "| arm | steps | final held-out accuracy | accuracy gain | reward, last fifth | k3_kl "
             "| abs dlogp p99 | bitwise-equal tokens | M-/M+ | rollout tok/s | learner tok/s | step s "
             "| weight sync s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in report["arms"].values():
        cells = [a["label"], str(min(a["steps"], default=0)), _fmt(a["final_accuracy"]),
                 _fmt(a["accuracy_gain"], signed=True), _fmt(a["reward_last_fifth"]), _sci(a["k3_kl"]),
                 _sci(a["logprob_abs_diff_p99"]), _pct(a["bitwise_equal_frac"]),
                 "M+ = 0" if a["imbalance"]["inf"] else _fmt(a["imbalance"], 2),
                 _fmt(a["rollout_tokens_per_s"], 0),
                 _fmt(a["learner_tokens_per_s"], 0), _fmt(a["step_s"], 2), _fmt(a["weight_sync_s"], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _sci(s: dict) -> str:
    return "-" if s["mean"] is None else f"{s['mean']:.2e}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(CURVES) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows))
    for ax, (key, title, log) in zip(axes.flat, CURVES):
        for name, curves in report["curves"].items():
            c = curves[key]
            if not c["steps"]:
                continue
            label = report["arms"][name]["label"]
            positive = [v for v in c["min"] if v > 0]
            line, = ax.plot(c["steps"], c["mean"], label=label, lw=1.4)
            ax.fill_between(c["steps"], c["min"], c["max"], color=line.get_color(), alpha=0.15, lw=0)
            if log and positive:
                ax.set_yscale("log")
        ax.set(title=title, xlabel="RL step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(CURVES):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), frameon=False)
    fig.suptitle(f"{report['experiment']}: mean over seeds {report['seeds']}, band = min..max")
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
