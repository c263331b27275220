"""What a training run shows and leaves behind: a progress line, metrics.jsonl, TensorBoard, a report.

- `Progress`: one line per step with a bar, the step, reward, held-out accuracy (when measured),
  tokens/s and the mismatch summary (k3_kl, max |d logp|). Redrawn in place on a terminal.
- `MetricsLog`: every record appended to `metrics.jsonl` (one JSON object per line, always) and, when
  the `tensorboard` package is installed, written as scalars under `tensorboard/`. A record has a
  "kind" ("warmup", "rl" or "eval") and a "step".
- `write_report`: `report.png` (reward, held-out accuracy and mismatch curves over RL steps;
  matplotlib, Agg backend), `summary.json` (first/last/best numbers, timings) and the diagnostics
  report of the run (`report.html`, `report.json`, `curves.png`: mismatch metrics over steps).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from minite.diagnostics.report import write_training_report

METRICS_FILE = "metrics.jsonl"
REPORT_PNG = "report.png"
SUMMARY_FILE = "summary.json"


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream=None, width: int = 20):
        self.total, self.enabled, self.width = total, enabled, width
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()

    def line(self, step: int, m: dict) -> str:
        done = int(self.width * step / max(self.total, 1))
        parts = [f"[{'#' * done}{'.' * (self.width - done)}] step {step}/{self.total}",
                 f"reward {m.get('reward', math.nan):.3f}"]
        if "eval/accuracy" in m:
            parts.append(f"heldout acc {m['eval/accuracy']:.3f}")
        parts += [f"{m.get('rollout/tokens_per_s', 0):.0f} tok/s",
                  f"k3_kl {m.get('mismatch/k3_kl', math.nan):.2e}",
                  f"max|dlogp| {m.get('mismatch/logprob_abs_diff_max', math.nan):.2e}",
                  f"{m.get('time/step_s', 0):.1f}s"]
        return " | ".join(parts)

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        end = "" if self.tty and step < self.total else "\n"
        print(("\r" if self.tty else "") + self.line(step, m), end=end, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        if self.enabled:
            print(("\n" if self.tty else "") + text, file=self.stream, flush=True)


class MetricsLog:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                pass
            else:
                self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record, default=float) + "\n")
        if self.writer is not None:
            step, kind = record.get("step", 0), record.get("kind", "rl")
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self.writer.add_scalar(f"{kind}/{key}" if "/" not in key else key, value, step)
            self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """Drop RL and eval records of steps after `step` (a resumed run logs them again)."""
        keep = [r for r in read_metrics(self.path) if r.get("kind") == "warmup" or r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: list[dict], extra: dict | None = None) -> dict:
    """First/last/best reward and held-out accuracy and the mismatch extremes of a run's records."""
    rl = [r for r in records if r.get("kind") == "rl"]
    ev = [r for r in records if r.get("kind") == "eval"]
    out: dict = dict(extra or {})
    if rl:
        rewards = [r["reward"] for r in rl]
        k = max(1, len(rewards) // 5)
        out.update(rl_steps=len(rl), reward_first=rewards[0], reward_last=rewards[-1],
                   reward_first_fifth_mean=sum(rewards[:k]) / k, reward_last_fifth_mean=sum(rewards[-k:]) / k,
                   k3_kl_max=max(r.get("mismatch/k3_kl", 0.0) for r in rl),
                   logprob_abs_diff_max=max(r.get("mismatch/logprob_abs_diff_max", 0.0) for r in rl),
                   rollout_tokens_per_s_mean=sum(r.get("rollout/tokens_per_s", 0.0) for r in rl) / len(rl))
    if ev:
        out.update(eval_accuracy_first=ev[0]["eval/accuracy"], eval_accuracy_last=ev[-1]["eval/accuracy"],
                   eval_accuracy_best=max(r["eval/accuracy"] for r in ev),
                   eval_steps=[r["step"] for r in ev], eval_accuracy=[r["eval/accuracy"] for r in ev],
                   eval_sampled_reward=[r.get("eval/sampled_reward") for r in ev])
    return out


def write_report(run_dir: str | Path, extra: dict | None = None) -> dict:
    """Write report.png, summary.json and the diagnostics report (report.html / report.json with the
    mismatch curves over steps) from the run folder's metrics.jsonl; returns the summary."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    summary = summarize(records, extra)
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    _plot(records, run_dir / REPORT_PNG)
    rl = [r for r in records if r.get("kind") == "rl"]
    write_training_report(run_dir, rl, report={"summary": summary})  # report.html: mismatch curves
    return summary


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rl = [r for r in records if r.get("kind") == "rl"]
    ev = [r for r in records if r.get("kind") == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    steps, rewards = [r["step"] for r in rl], [r["reward"] for r in rl]
    axes[0].plot(steps, rewards, alpha=0.4, label="rollout reward")
    w = max(1, len(rl) // 10)
    windows = [rewards[max(0, i - w + 1):i + 1] for i in range(len(rl))]
    smooth = [sum(x) / len(x) for x in windows]
    axes[0].plot(steps, smooth, label=f"mean of last {w}")
    axes[0].set(title="reward", xlabel="RL step")
    axes[1].plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], "o-", label="greedy accuracy")
    if ev and "eval/sampled_reward" in ev[0]:
        axes[1].plot([r["step"] for r in ev], [r["eval/sampled_reward"] for r in ev], "s-",
                     label="sampled reward")
    axes[1].set(title="held-out", xlabel="RL step", ylim=(0, 1))
    for key, label in (("mismatch/k3_kl", "k3_kl"), ("mismatch/logprob_abs_diff_max", "max |dlogp|")):
        values = [max(r.get(key, 0.0), 1e-18) for r in rl]
        axes[2].plot([r["step"] for r in rl], values, label=label)
    axes[2].set(title="learner vs sampler mismatch", xlabel="RL step", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
