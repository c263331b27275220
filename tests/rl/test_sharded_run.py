"""`torchrun --nproc-per-node=2 -m minite.cli train` on the CPU (gloo): one run folder written by rank
0, one metrics row per step, sharded checkpoints resumed into one process and back into two; and the
sharded learner against one process (tests/learner/fsdp_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minite.rl.run_logging import read_metrics
from tests.learner.fsdp_worker import STEP_TOLERANCE
from tests.rl.test_trainer import TINY

REPO = Path(__file__).resolve().parents[2]
ARGS = [a for a in TINY if "threads" not in a] + [
    "--threads=1", "--task.reward=tests.rl.test_trainer:parity_reward", "--eval.every=0",
    "--checkpoint.every=2"]
# a sharded warm start against one process's: the same batches, gradients summed in another order
NLL_RTOL = 1e-5


# the processes import this checkout (and `tests`) whether or not it is installed
ENV = {**os.environ,
       "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)


def train(*args: str, nproc: int | None = None) -> subprocess.CompletedProcess:
    if nproc is None:
        out = subprocess.run([sys.executable, "-m", "minite.cli", "train", *args], cwd=REPO,
                             capture_output=True, text=True, timeout=300, env=ENV)
    else:
        out = torchrun(nproc, "-m", "minite.cli", "train", *args)
    assert out.returncode == 0, (args, _errors(out.stderr))
    return out


def _errors(stderr: str) -> str:
    """The lines of a failed run's stderr that say what went wrong (torchrun repeats a lot)."""
    return "\n".join(line for line in stderr.splitlines() if "Error" in line or "error" in line)[-3000:]


def rl_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "rl"]


def check_sharded_learner(tmp_path, nproc: int, *device: str) -> dict:
    out = torchrun(nproc, "tests/learner/fsdp_worker.py", str(tmp_path / "out.json"), str(tmp_path), *device)
    assert out.returncode == 0, _errors(out.stderr)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["world_size"] == nproc
    for model in ("dense", "moe"):
        assert got[model]["step_rel_rms_diff"] <= STEP_TOLERANCE
    return got


def test_sharded_learner_matches_one_process(tmp_path):
    check_sharded_learner(tmp_path, 2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sharded_learner_matches_one_process_on_gpus(tmp_path):
    """bf16 on the kernels, NCCL, every GPU of the machine."""
    check_sharded_learner(tmp_path, torch.cuda.device_count(), "cuda")


def test_two_processes_train_log_once_and_resume_in_one_and_two(tmp_path):
    run, single = tmp_path / "run", tmp_path / "single"
    out = train(*ARGS, "--rl.steps=3", f"--run_dir={run}", nproc=2)
    assert out.stdout.count("minite train: run folder") == 1 and out.stdout.count("summary:") == 1
    assert rl_steps(run) == [1, 2, 3]  # rank 0 alone logs
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["rl_steps"] == 3
    ckpt = run / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000003"
    assert (ckpt / "step_000003" / "sharded" / ".metadata").is_file()
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "latest", "step_000002", "step_000003"]

    train(*ARGS, "--rl.steps=3", f"--run_dir={single}")
    nll = [r["nll"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "warmup"]
    nll_single = [r["nll"] for r in read_metrics(single / "metrics.jsonl") if r["kind"] == "warmup"]
    assert len(nll) == len(nll_single) > 0
    assert all(abs(a - b) <= NLL_RTOL * abs(b) for a, b in zip(nll, nll_single)), (nll, nll_single)

    train("--resume", str(run), "--rl.steps=4")  # one process, from the two processes' shards
    assert rl_steps(run) == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 1
    train("--resume", str(run), "--rl.steps=5", nproc=2)  # and back into two
    assert rl_steps(run) == [1, 2, 3, 4, 5]
    assert (ckpt / "latest").read_text().strip() == "step_000005"
