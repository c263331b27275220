"""What a training run shows and leaves behind: a progress line, metrics.jsonl, TensorBoard, a report.

- `Progress`: one line per step with a bar, the step, reward, held-out accuracy (when measured),
  tokens/s and the mismatch summary (k3_kl, max |d logp|). Redrawn in place on a terminal.
- `MetricsLog`: every record appended to `metrics.jsonl` (one JSON object per line, always), written
  as scalars under `tensorboard/` (the `tensorboard` package is a dependency; without it a warning
  says the event files are missing) and, when asked, to Weights & Biases (`wandb`, optional: asking
  for it without the package is an error). A record has a "kind" ("warmup", "rl" or "eval") and a
  "step". `read_metrics` drops a half-written last line (a
  crash mid-append) with a warning; any other bad line is an error naming the file and line.
- `write_report`: `summary.json` (first/last/best numbers, timings) and the diagnostics report of the
  run (`report.html`, `report.json`; `training.png`: reward, held-out accuracy, mismatch and
  throughput over RL steps, also saved as `report.png`; `curves.png`: every mismatch metric on a
  readable scale). Every file is written whole or not at all (`minite.files.write_atomic`): a full
  disk names the path and leaves the previous file as it was.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

from minite.diagnostics.report import write_training_report
from minite.files import append_line, write_atomic

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
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None):
        self.path = Path(run_dir) / METRICS_FILE
        self.writer = self.wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                warnings.warn("logging.tensorboard = true but the tensorboard package is not installed "
                              "(pip install tensorboard): no event files, metrics.jsonl only", stacklevel=2)
            else:
                self.writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise ImportError("logging.wandb = true needs the wandb package: pip install wandb") from None
            self.wandb = wandb.init(project=wandb_project, name=Path(run_dir).name, dir=str(run_dir),
                                    config=config, resume="allow", id=Path(run_dir).name)

    def log(self, record: dict) -> None:
        append_line(self.path, json.dumps(record, default=float))
        step, kind = record.get("step", 0), record.get("kind", "rl")
        scalars = {(f"{kind}/{key}" if "/" not in key else key): value for key, value in record.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None and kind != "warmup":
            self.wandb.log(scalars, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop RL and eval records of steps after `step` (a resumed run logs them again)."""
        keep = [r for r in read_metrics(self.path) if r.get("kind") == "warmup" or r.get("step", 0) <= step]
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


class MetricsWarning(UserWarning):
    """A metrics log was read with a half-written last line left out."""


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl. A last line without its newline that does not parse is what a
    crash in the middle of an append leaves: dropped, with a warning. Any other line that is not a JSON
    object is an error naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text(errors="replace")
    lines = text.split("\n")  # the piece after the last newline is "" unless a write was cut short
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):
                warnings.warn(f"{path} line {number} is half-written (a crash while logging); it is "
                              "left out", MetricsWarning, stacklevel=2)
                break
            raise ValueError(f"{path} line {number} is not valid JSON ({e.msg} at column {e.colno}); "
                             "restore the file or remove that line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number} holds a JSON {type(record).__name__}, expected an object")
        records.append(record)
    return records


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
                   rollout_tokens_per_s_mean=sum(r.get("rollout/tokens_per_s", 0.0) for r in rl) / len(rl),
                   learner_tokens_per_s_mean=sum(r.get("learner/tokens_per_s", 0.0) for r in rl) / len(rl))
    if ev:
        out.update(eval_accuracy_first=ev[0]["eval/accuracy"], eval_accuracy_last=ev[-1]["eval/accuracy"],
                   eval_accuracy_best=max(r["eval/accuracy"] for r in ev),
                   eval_steps=[r["step"] for r in ev], eval_accuracy=[r["eval/accuracy"] for r in ev],
                   eval_sampled_reward=[r.get("eval/sampled_reward") for r in ev])
    return out


def write_report(run_dir: str | Path, extra: dict | None = None) -> dict:
    """Write summary.json and the run's report (report.html / report.json, training.png and its copy
    report.png, curves.png) from the run folder's metrics.jsonl; returns the summary."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / METRICS_FILE)
    summary = summarize(records, extra)
    write_atomic(run_dir / SUMMARY_FILE, json.dumps(summary, indent=1) + "\n")
    paths = write_training_report(run_dir, records, report={"summary": summary})
    if "training" in paths:  # report.png: the figure the progress line and the README point to
        write_atomic(run_dir / REPORT_PNG, paths["training"].read_bytes())
    return summary
