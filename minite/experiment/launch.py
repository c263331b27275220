"""Run an experiment's arms x seeds as separate `minite train` processes, at most `parallel` at once.

Each run writes its own folder `OUT/ARM/seedS` (its `train.log` holds the process's output). A run
whose folder holds a finished summary is skipped; one started before is resumed (from its checkpoint,
or over again when it stopped before the first one); so rerunning the same command after a crash or
Ctrl-C continues where it stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from minite.experiment.spec import Arm, Experiment
from minite.rl.checkpointing import latest_checkpoint

POLL_SECONDS = 5.0
STOP_SECONDS = 120.0  # how long Ctrl-C waits for the runs to save at their step boundary


def run_dir(out: Path, arm: Arm, seed: int) -> Path:
    return Path(out) / arm.name / f"seed{seed}"


def finished(folder: Path, steps: int) -> bool:
    summary = folder / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("rl_steps", -1) >= steps


def command(exp: Experiment, arm: Arm, seed: int, out: Path) -> list[str]:
    folder = run_dir(out, arm, seed)
    base = [sys.executable, "-m", "minite.cli", "train"]
    if latest_checkpoint(folder / "checkpoints") is not None or (folder / "config.toml").is_file():
        # a run started before (without a checkpoint it starts over): only --resume may write into it
        return base + ["--resume", str(folder)]
    config = ["--config", str(exp.config)] if exp.config else []
    return base + config + exp.arm_overrides(arm, seed) + [f"--run_dir={folder}", "--logging.progress=false"]


def _steps_done(folder: Path) -> int:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum('"kind": "rl"' in line for line in path.read_text().splitlines())


def _stop(running: list[tuple], stream) -> None:
    """After Ctrl-C: pass one SIGINT to every run (each runs in its own process group, so the terminal's
    reaches only this process), which saves a checkpoint at its next step boundary; wait for them up
    to STOP_SECONDS, then terminate what is left. A second Ctrl-C terminates at once."""
    for *_, proc, _log in running:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    print(f"stopping {len(running)} runs at their next step boundary (Ctrl-C again: kill them)", file=stream)
    try:
        deadline = time.monotonic() + STOP_SECONDS
        for *_, proc, _log in running:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        pass
    for *_, proc, log in running:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        log.close()


def launch(exp: Experiment, out: str | Path, parallel: int, stream=None) -> dict[str, int]:
    """Run every (arm, seed) not finished yet; returns {"ARM/seedS": exit code}. Progress (steps done
    per run) goes to `stream` (stderr) every minute; Ctrl-C stops the children and says how to go on."""
    out, stream = Path(out), stream or sys.stderr
    if parallel > 1:
        shared = [a.name for a in exp.arms if exp.configs[a.name].model.device.startswith("cuda")
                  and not exp.configs[a.name].sampler.kv_cache_tokens]
        if shared:
            raise ValueError(f"arms {shared} size their KV cache by the free GPU memory, which runs started "
                             f"side by side take from each other (out of memory); set "
                             f"sampler.kv_cache_tokens in the experiment's overrides, or --parallel 1")
    todo = []
    for arm in exp.arms:
        steps = exp.configs[arm.name].rl.steps
        for seed in exp.seeds:
            folder = run_dir(out, arm, seed)
            if finished(folder, steps):
                print(f"{arm.name}/seed{seed}: finished before, kept", file=stream)
            else:
                todo.append((arm, seed, folder, steps))
    codes: dict[str, int] = {}
    running: list[tuple] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    last_report = 0.0
    try:
        while todo or running:
            while todo and len(running) < parallel:
                arm, seed, folder, steps = todo.pop(0)
                folder.mkdir(parents=True, exist_ok=True)
                log = open(folder / "train.log", "a")
                proc = subprocess.Popen(command(exp, arm, seed, out), stdout=log, stderr=subprocess.STDOUT,
                                        env=env, start_new_session=True)
                running.append((arm, seed, folder, steps, proc, log))
            time.sleep(min(POLL_SECONDS, 0.5) if not running else POLL_SECONDS)
            for item in list(running):
                arm, seed, folder, steps, proc, log = item
                if proc.poll() is not None:
                    log.close()
                    running.remove(item)
                    codes[f"{arm.name}/seed{seed}"] = proc.returncode
                    status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}; see " \
                                                                   f"{folder / 'train.log'})"
                    print(f"{arm.name}/seed{seed}: {status}", file=stream, flush=True)
            if running and time.monotonic() - last_report >= 60:
                last_report = time.monotonic()
                state = ", ".join(f"{a.name}/seed{s} {_steps_done(f)}/{n}" for a, s, f, n, *_ in running)
                print(f"[{time.strftime('%H:%M:%S')}] running: {state}; {len(todo)} waiting", file=stream,
                      flush=True)
    except KeyboardInterrupt:
        _stop(running, stream)
        print("interrupted: rerun the same command to resume the runs from their checkpoints", file=stream)
        raise
    return codes
