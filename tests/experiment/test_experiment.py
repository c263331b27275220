"""`minite experiment` end to end on the CPU: two arms x two seeds of a tiny model as separate
processes, one report; a rerun keeps finished runs; bad experiment files fail before anything runs."""

import json

import pytest

from minite.cli import main
from minite.config import ConfigError
from minite.experiment import load_experiment
from tests.rl.test_trainer import TINY

TINY_OVERRIDES = [o.removeprefix("--") for o in TINY if "progress" not in o] + ["rl.steps=2", "eval.every=1",
                                                                                 "checkpoint.every=1"]


def _write(path, arms: str, extra: str = "") -> None:
    overrides = ", ".join(json.dumps(o) for o in TINY_OVERRIDES)
    path.write_text(f'description = "tiny"\nseeds = [0, 1]\noverrides = [{overrides}]\n{extra}\n{arms}')


ARMS = """
[arms.aligned]
label = "aligned / aligned"
overrides = []
[arms.naive]
label = "te / vllm + TRIAGE"
overrides = ["recipe.name=te", "sampler.recipe=vllm", "rl.correction.name=triage"]
"""


def test_experiment_runs_arms_side_by_side_and_reports(tmp_path, capsys):
    spec = tmp_path / "tiny.toml"
    _write(spec, ARMS)
    out = tmp_path / "out"
    assert main(["experiment", str(spec), "--out", str(out), "--parallel", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert set(report["arms"]) == {"aligned", "naive"}
    for name, arm in report["arms"].items():
        assert arm["seeds"] == [0, 1] and arm["steps"] == [2, 2], name
        assert arm["final_accuracy"]["n"] == 2
        assert report["curves"][name]["reward"]["steps"] == [1, 2]
    naive, aligned = report["arms"]["naive"], report["arms"]["aligned"]
    assert naive["k3_kl"]["mean"] > 100 * aligned["k3_kl"]["mean"]  # two engines against one
    assert naive["weight_sync_s"]["mean"] > 0 == aligned["weight_sync_s"]["mean"]
    assert report["curves"]["naive"]["triage/mass_amp_neg"]["steps"]  # logged without TRIAGE too
    assert report["curves"]["aligned"]["triage/mass_amp_neg"]["steps"]
    assert (out / "curves.png").stat().st_size > 10_000
    assert aligned["bitwise_equal_frac"]["mean"] > naive["bitwise_equal_frac"]["mean"]
    assert naive["accuracy_gain"]["n"] == 2 and naive["imbalance"]["mean"] > 0
    assert "te / vllm + TRIAGE" in (out / "report.md").read_text()
    assert (out / "naive" / "seed1" / "train.log").is_file()
    capsys.readouterr()
    assert main(["experiment", str(spec), "--out", str(out)]) == 0  # finished runs are kept
    assert capsys.readouterr().err.count("finished before, kept") == 4


@pytest.mark.parametrize("arms,extra,match", [
    ("[arms.a]\noverrides = [\"rl.bogus=1\"]", "", "arm 'a'.*rl.bogus"),
    ("", "", "at least one"),
    ("[arms.a]\nlr = 1", "", "label.*overrides"),
    ("[arms.a]\noverrides = []", "steps = 3", "unknown keys"),
])
def test_bad_experiment_files_name_the_problem(tmp_path, arms, extra, match):
    spec = tmp_path / "bad.toml"
    _write(spec, arms, extra)
    with pytest.raises(ConfigError, match=match):
        load_experiment(spec)


def test_the_shipped_experiment_resolves():
    exp = load_experiment("configs/experiments/naive_vs_aligned.toml")
    assert len(exp.arms) == 6 and len(exp.seeds) >= 3
    for arm in exp.arms:
        cfg = exp.configs[arm.name]
        assert cfg.rl.steps >= 200 and cfg.model.device == "cuda"
    assert exp.configs["naive_triage"].sampler.recipe == "vllm"
    assert exp.configs["naive_triage"].recipe.name == "te"


def test_gpu_runs_side_by_side_need_a_fixed_kv_cache(tmp_path):
    """Sized by free GPU memory, runs started first take the memory of the later ones."""
    from minite.experiment import launch

    spec = tmp_path / "gpu.toml"
    _write(spec, "[arms.a]\noverrides = [\"model.device=cuda\"]")
    exp = load_experiment(spec)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        launch(exp, tmp_path / "out", parallel=2)
    shipped = load_experiment("configs/experiments/naive_vs_aligned.toml")
    assert all(cfg.sampler.kv_cache_tokens for cfg in shipped.configs.values())


def test_ctrl_c_stops_the_runs_at_a_step_boundary_and_a_rerun_resumes(tmp_path):
    """Ctrl-C on the launcher: each run gets one SIGINT, saves a checkpoint at its step boundary and
    exits; the launcher says how to go on; rerunning the command resumes and finishes the runs."""
    import signal
    import subprocess
    import sys
    import time

    spec = tmp_path / "long.toml"
    _write(spec, "[arms.a]\noverrides = [\"rl.steps=40\"]")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "minite.cli", "experiment", str(spec), "--out", str(out), "--seeds", "0"]
    # Ctrl-C's default action in the launcher, even where this suite runs with SIGINT ignored (a shell
    # starts background jobs so, and children inherit it)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    ckpts = out / "a" / "seed0" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (ckpts / "latest").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, f"the run ended before its first checkpoint was seen: {proc.stderr.read()}"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "rerun the same command to resume" in err and "Traceback" not in err
    log = (out / "a" / "seed0" / "train.log").read_text()
    assert "interrupted after step" in log and "Traceback" not in log
    assert main(["experiment", str(spec), "--out", str(out), "--seeds", "0"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["arms"]["a"]["steps"] == [40]


def test_imbalance_sums_the_masses_over_steps():
    from minite.experiment.report import _series, imbalance

    steps = [{"kind": "rl", "step": 1, "triage/mass_amp_neg": 3.0, "triage/mass_amp_pos": 0.0},
             {"kind": "rl", "step": 2, "triage/mass_amp_neg": 1.0, "triage/mass_amp_pos": 2.0}]
    assert imbalance(steps) == 2.0  # (3 + 1) / (0 + 2): no unbounded per-step ratio
    assert imbalance(steps[:1]) == float("inf")
    empty = {"kind": "rl", "step": 1, "triage/mass_amp_neg": 0.0, "triage/mass_amp_pos": 0.0}
    assert imbalance([empty]) == 1.0
    assert _series(steps, "triage/imbalance") == {2: 0.5}  # the step without positive mass left out
    evals = [{"kind": "eval", "step": 0, "eval/accuracy": 0.5},
             {"kind": "eval", "step": 25, "eval/accuracy": 0.75}]
    assert _series(evals, "eval/accuracy_gain") == {0: 0.0, 25: 0.25}
