"""What a run does with bad input and bad luck: each case gives a clear error (or the corrected
behaviour) and leaves what was in the run folder before exactly as it was."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from minite.cli import main
from minite.config import load_config
from minite.learner import Learner
from minite.models import Qwen3, save_pretrained, tiny_qwen3
from minite.rl import trainer as trainer_module
from minite.rl.checkpointing import latest_checkpoint, load_latest_checkpoint, save_checkpoint
from minite.rl.run_folder import LOCK_FILE, RunFolder, RunFolderBusy, new_run_dir
from minite.rl.tokenizer import CharTokenizer
from minite.rl.trainer import Interrupted, NonFiniteError, Trainer
from tests.rl.test_trainer import TINY, make_trainer, parity_reward

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--rl.steps=1", "--warmup.steps=0", "--eval.every=0", "--checkpoint.every=0"]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """{relative path: (bytes, mtime_ns)} of every file under `folder`."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_kept(before: dict, folder: Path) -> None:
    """Every file of `before` is still there, byte for byte and untouched."""
    after = snapshot(folder)
    for name, (data, mtime) in before.items():
        assert name in after, f"{name} was removed"
        assert after[name] == (data, mtime), f"{name} was written over"


def rl_records(run: Path) -> list[dict]:
    """The RL records of a run without their timings (which differ run to run)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time/") or k.endswith("tokens_per_s"))}
            for r in records if r["kind"] == "rl"]


# --- a run folder owned by one process ------------------------------------------------------------

HOLD_LOCK = ("import sys, time; from minite.rl.run_folder import RunFolder; "
             "folder = RunFolder.open(sys.argv[1]); print('locked', flush=True); time.sleep(120)")


def test_a_second_writer_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, capsys):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run)
        with pytest.raises(RunFolderBusy, match=rf"in use by another run \(pid {holder.pid} on .*choose "
                                                r"another run_dir"):
            make_trainer(tmp_path, *QUICK)
        assert main(["train", *TINY, *QUICK, f"--run_dir={run}"]) == 2
        err = capsys.readouterr().err
        assert f"minite train: error: {run} is in use by another run (pid {holder.pid}" in err
        assert_kept(before, run)
    finally:
        holder.kill()  # as kill -9: the lock file stays, its lock goes with the process
        holder.wait()
    assert (run / LOCK_FILE).is_file()
    trainer = make_trainer(tmp_path, *QUICK)
    assert f"took over the stale lock {run / LOCK_FILE} of pid {holder.pid}" in capsys.readouterr().err
    assert (run / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")
    with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):  # a second writer in this process too
        make_trainer(tmp_path, *QUICK)
    trainer.run()
    assert not (run / LOCK_FILE).exists()  # released at the end


def test_default_names_started_in_the_same_second_differ(tmp_path, monkeypatch):
    now = datetime(2026, 1, 2, 3, 4, 5)
    names = [new_run_dir(tmp_path, now) for _ in range(3)]
    assert [p.name for p in names] == ["20260102-030405", "20260102-030405-2", "20260102-030405-3"]
    assert all(p.is_dir() for p in names)
    monkeypatch.chdir(tmp_path)
    frozen = type("Frozen", (), {"now": staticmethod(lambda: now)})
    monkeypatch.setattr("minite.rl.run_folder.datetime", frozen)
    cfg = load_config(None, TINY + QUICK)
    first, second = Trainer(cfg), Trainer(cfg)  # both hold their folders, as two processes would
    assert first.run_dir != second.run_dir and first.run_dir.parent == second.run_dir.parent == Path("runs")
    first.close()
    second.close()


@pytest.mark.parametrize("files", [
    {"config.toml": "seed = 0\n"},
    {"metrics.jsonl": '{"kind": "rl", "step": 1}\n'},
    {"config.toml": "seed = 0\n", "metrics.jsonl": '{"kind": "rl", "step": 1}\n', "summary.json": "{}\n"},
    {"checkpoints/.step_000001.tmp-deadbeef/state.pt": "x"},
])
def test_a_folder_holding_a_run_without_checkpoint_is_refused(tmp_path, files):
    run = tmp_path / "run"
    for name, text in files.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"already holds a run \(.*\) and no checkpoint to resume it from"):
        make_trainer(tmp_path, *QUICK)
    assert_kept(before, run)
    assert not (run / LOCK_FILE).exists()


def test_a_finished_run_without_checkpoints_is_not_resumed_over(tmp_path):
    make_trainer(tmp_path, *QUICK).run()
    run = tmp_path / "run"
    before = snapshot(run)
    with pytest.raises(ValueError, match="already holds a run"):
        make_trainer(tmp_path, *QUICK)
    with pytest.raises(ValueError, match=r"finished run without checkpoints \(checkpoint.every = 0\)"):
        make_trainer(tmp_path, *QUICK, resume=True)
    assert_kept(before, run)


def _bad_tokenizer(tmp_path):
    make_trainer(tmp_path, *QUICK, "--model.tokenizer=/nonexistent")


def _no_solutions(tmp_path):
    trainer = make_trainer(tmp_path, "--rl.steps=1")
    trainer.task.example = lambda split, i, ex=trainer.task.example: type(ex(split, i))("1+1=", "2")
    trainer.run()


@pytest.mark.parametrize("start,match", [(_bad_tokenizer, "cannot load a tokenizer"),
                                         (_no_solutions, "has no worked solutions")])
def test_a_failed_run_leaves_no_folder_it_created(tmp_path, start, match):
    with pytest.raises(ValueError, match=match):
        start(tmp_path)
    assert not (tmp_path / "run").exists()
    # a folder that was there before (the experiment launcher's, with its log) stays as it was
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train.log").write_text("launcher output\n")
    before = snapshot(tmp_path / "run")
    with pytest.raises(ValueError, match=match):
        start(tmp_path)
    assert_kept(before, tmp_path / "run")
    assert not (tmp_path / "run" / LOCK_FILE).exists()


# --- checkpoints that do not load ----------------------------------------------------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _random_bytes(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


DAMAGE = [
    ("model/model.safetensors", _truncate, r"model.safetensors is not a valid safetensors file"),
    ("model/model.safetensors", _random_bytes, r"model.safetensors is not a valid safetensors file"),
    ("model/model.safetensors", Path.unlink, r"model has neither model.safetensors"),
    ("model/config.json", Path.unlink, r"model/config.json does not exist"),
    ("model/config.json", _random_bytes, r"model/config.json is not a text file"),
    ("state.pt", Path.unlink, r"state.pt does not exist"),
    ("state.pt", _truncate, r"state.pt cannot be read \(.*\); it is truncated or corrupt"),
    ("state.pt", _random_bytes, r"state.pt cannot be read \(.*\); it is truncated or corrupt"),
]


def _tiny_model(seed: int) -> Qwen3:
    model = Qwen3(tiny_qwen3(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
                  "aligned")
    model.init_weights(0.02, torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("file,damage,reason", DAMAGE)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, file, damage, reason):
    ckpt = tmp_path / "checkpoints"
    first, second = _tiny_model(1), _tiny_model(2)
    state = {"learner": {}, "data": {"position": 0}}
    save_checkpoint(ckpt, 1, {"model": first}, state)
    save_checkpoint(ckpt, 2, {"model": second}, state)
    damage(ckpt / "step_000002" / file)
    before = snapshot(ckpt)
    warnings = []
    path, models, loaded = load_latest_checkpoint(ckpt, "aligned", torch.float32, "cpu", warn=warnings.append)
    assert path.name == "step_000001" and loaded["step"] == 1
    for a, b in zip(first.parameters(), models["model"].parameters()):
        assert torch.equal(a, b)
    assert len(warnings) == 2
    assert f"checkpoint {ckpt / 'step_000002'} cannot be loaded (" in warnings[0]
    assert re.search(reason, warnings[0]), warnings[0]
    assert "resuming from" in warnings[1] and "step_000002 moved aside" in warnings[1]
    # nothing lost: the broken one is kept under another name, the good one untouched
    moved = {k.replace("step_000002", "broken-step_000002", 1): v for k, v in before.items()
             if k.startswith("step_000002")}
    assert_kept({**{k: v for k, v in before.items() if k.startswith("step_000001")}, **moved}, ckpt)
    assert latest_checkpoint(ckpt).name == "step_000001"
    save_checkpoint(ckpt, 2, {"model": second}, state)  # the step is saved afresh, not pointed back
    assert load_latest_checkpoint(ckpt, "aligned", torch.float32, "cpu", warn=warnings.append)[0].name == \
        "step_000002" and len(warnings) == 2


RESUME = ["--rl.steps=3", "--checkpoint.every=1", "--checkpoint.keep=3", "--eval.every=0"]


def test_a_truncated_latest_checkpoint_resumes_bitwise_from_the_previous_one(tmp_path, capsys):
    straight = make_trainer(tmp_path / "straight", *RESUME, reward=parity_reward)
    straight.run()
    run = tmp_path / "broken" / "run"
    shutil.copytree(tmp_path / "straight" / "run", run)
    _truncate(run / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    earlier = {k: v for k, v in snapshot(run).items() if k.startswith(("checkpoints/step_000001",
                                                                        "checkpoints/step_000002"))}
    resumed = make_trainer(tmp_path / "broken", *RESUME, resume=True, reward=parity_reward)
    assert resumed.step == 2
    assert "checkpoint" in capsys.readouterr().err
    summary = resumed.run()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.learner.optimizer.masters, resumed.learner.optimizer.masters):
        assert torch.equal(a, b)
    assert rl_records(run) == rl_records(tmp_path / "straight" / "run")
    assert any("step_000003" in w and "cannot be loaded" in w for w in summary["warnings"])
    assert_kept(earlier, run)
    assert (run / "checkpoints" / "broken-step_000003" / "model" / "model.safetensors").is_file()


# --- Ctrl-C ---------------------------------------------------------------------------------------

def _ctrl_c_at(trainer, step: int, times: int = 1):
    """Press Ctrl-C (call the handler) `times` times during RL step `step`."""
    real = trainer.rl_step

    def rl_step():
        if trainer.step == step:
            for _ in range(times):
                trainer._on_ctrl_c()
        return real()
    trainer.rl_step = rl_step


def test_ctrl_c_saves_at_the_step_boundary_and_says_how_to_resume(tmp_path, capsys):
    trainer = make_trainer(tmp_path, "--rl.steps=4", "--checkpoint.every=10", "--eval.every=0",
                           reward=parity_reward)
    _ctrl_c_at(trainer, 2)
    with pytest.raises(Interrupted, match=r"after step 2; checkpoint step_000002 saved; resume with: "
                                          rf"minite train --resume {tmp_path / 'run'}"):
        trainer.run()
    assert "stopping after this step" in capsys.readouterr().err
    run = tmp_path / "run"
    assert latest_checkpoint(run / "checkpoints").name == "step_000002"
    assert [r["step"] for r in rl_records(run)] == [1, 2]
    assert not (run / LOCK_FILE).exists()
    before = snapshot(run / "checkpoints" / "step_000002")
    resumed = make_trainer(tmp_path, "--rl.steps=4", "--checkpoint.every=10", "--eval.every=0", resume=True,
                           reward=parity_reward)
    assert resumed.step == 2
    resumed.run()
    assert [r["step"] for r in rl_records(run)] == [1, 2, 3, 4]
    assert_kept(before, run / "checkpoints" / "step_000002")


@pytest.mark.parametrize("every,times,match", [
    (0, 1, r"after step 1; nothing was saved \(checkpoint.every = 0\)"),
    (0, 2, r"during step 1 \(second Ctrl-C\); nothing was saved"),
    (10, 2, r"during step 1 \(second Ctrl-C\); checkpoint step_000000 saved; resume with"),
])
def test_ctrl_c_without_a_checkpoint_and_twice(tmp_path, every, times, match):
    trainer = make_trainer(tmp_path, "--rl.steps=3", f"--checkpoint.every={every}", "--eval.every=0",
                           "--warmup.steps=0")
    _ctrl_c_at(trainer, 1, times)
    with pytest.raises(Interrupted, match=match):
        trainer.run()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_ctrl_c_in_a_real_process_exits_130_with_one_line(tmp_path):
    run = tmp_path / "run"
    args = [a for a in TINY if "progress" not in a] + ["--rl.steps=200", "--checkpoint.every=1000",
                                                        "--eval.every=0", f"--run_dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "minite.cli", "train", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and '"kind": "rl"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("minite train: interrupted after step ") and \
        last.endswith(f"saved; resume with: minite train --resume {run}"), err
    assert latest_checkpoint(run / "checkpoints") is not None
    assert not (run / LOCK_FILE).exists()


# --- non-finite values and divergence -------------------------------------------------------------

@pytest.mark.parametrize("recipe", ["bf16", "aligned"])
def test_nan_weights_stop_the_run_naming_the_weight(tmp_path, recipe):
    trainer = make_trainer(tmp_path, f"--recipe.name={recipe}", *QUICK)
    with torch.no_grad():
        trainer.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"before training: the model weight "
                                             r"layers.0.mlp.down_proj.weight holds inf or NaN"):
        trainer.run()


@pytest.mark.parametrize("recipe", ["bf16", "aligned"])
def test_weights_turning_nan_in_an_update_stop_the_run_at_that_step(tmp_path, monkeypatch, recipe):
    trainer = make_trainer(tmp_path, f"--recipe.name={recipe}", "--rl.steps=3", "--warmup.steps=0",
                           "--eval.every=0", "--checkpoint.every=1", reward=parity_reward)
    real = Learner.step

    def poisoned(self, *args, **kwargs):
        if trainer.step == 2:
            with torch.no_grad():
                self.optimizer.masters[-1].view(-1)[0] = float("nan")  # as an overflowing update would
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "step", poisoned)
    with pytest.raises(NonFiniteError, match=r"step 2, after (its|an) update.*holds inf or NaN.*resume from "
                                             r"the last checkpoint \(step_000001\)"):
        trainer.run()
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000001"


def _nan_loss_at(monkeypatch, trainer, step: int) -> None:
    real = trainer_module.policy_loss

    def loss(*args, **kwargs):
        value, metrics = real(*args, **kwargs)
        return (value * float("nan") if trainer.step == step else value), metrics

    monkeypatch.setattr(trainer_module, "policy_loss", loss)


def test_a_nan_loss_stops_the_run_by_default(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--rl.steps=3", "--warmup.steps=0", "--eval.every=0",
                           "--checkpoint.every=1", reward=parity_reward)
    _nan_loss_at(monkeypatch, trainer, 2)
    with pytest.raises(NonFiniteError, match=r"step 2: a non-finite loss or gradient in update\(s\) 1 "
                                             r"\(loss nan.*rl.on_nonfinite = \"stop\""):
        trainer.run()
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step_000001"
    assert [r["step"] for r in rl_records(tmp_path / "run")] == [1, 2]  # the bad step is on record


@pytest.mark.parametrize("mode", ["skip", "warn"])
def test_a_nan_loss_is_skipped_or_warned_about_and_listed_in_the_summary(tmp_path, monkeypatch, capsys, mode):
    trainer = make_trainer(tmp_path, f"--rl.on_nonfinite={mode}", "--rl.steps=3", "--warmup.steps=0",
                           "--eval.every=0", "--checkpoint.every=0", reward=parity_reward)
    _nan_loss_at(monkeypatch, trainer, 2)
    weights = []
    real_step = trainer.rl_step

    def record_weights():
        out = real_step()
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
        return out
    trainer.rl_step = record_weights
    summary = trainer.run()
    assert summary["rl_steps"] == 3
    assert len(summary["warnings"]) == 1 and summary["warnings"][0].startswith("step 2: a non-finite loss")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warnings"] == summary["warnings"]
    assert "minite train: warning: step 2" in capsys.readouterr().err
    records = rl_records(tmp_path / "run")
    assert [r["update/skipped"] for r in records] == [0, 1, 0]
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1]))  # step 2 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(weights[1], weights[2]))


def test_divergence_rules_warn(tmp_path):
    trainer = make_trainer(tmp_path, *QUICK)
    trainer._check_warmup_nll(7e4)
    assert "warm start diverged: its last nll 7e+04 is above ln(vocab_size)" in trainer.warnings[-1]
    trainer._check_warmup_nll(1.0)
    assert len(trainer.warnings) == 1
    update = {"loss": 0.0, "grad_norm": 1.0}
    for step in range(1, 13):
        trainer.step = step
        trainer._check_step([update], reward=0.0)
    assert len(trainer.warnings) == 2 and "steps 1-10: the reward was 0 at 10 consecutive steps" in \
        trainer.warnings[-1]
    trainer.close()


def test_divergence_stops_the_run_when_asked(tmp_path):
    from minite.rl.trainer import DivergenceError

    trainer = make_trainer(tmp_path, *QUICK, "--rl.on_divergence=stop")
    with pytest.raises(DivergenceError, match="warm start diverged.*rl.on_divergence"):
        trainer._check_warmup_nll(7e4)
    trainer.close()


def test_a_warm_start_that_diverges_is_reported_in_the_summary(tmp_path):
    summary = make_trainer(tmp_path, "--rl.steps=1", "--warmup.steps=2", "--warmup.lr=30", "--eval.every=0",
                           "--checkpoint.every=0", "--rl.on_nonfinite=warn").run()
    assert any("warm start" in w for w in summary["warnings"]), summary["warnings"]


# --- wall time, vocabulary ------------------------------------------------------------------------

def test_wall_seconds_add_up_across_resumes(tmp_path, monkeypatch):
    real = Trainer.warmup

    def slow_warmup(self):
        time.sleep(1.5)
        real(self)

    monkeypatch.setattr(Trainer, "warmup", slow_warmup)
    first = make_trainer(tmp_path, "--rl.steps=1", "--checkpoint.every=1", "--eval.every=0").run()
    assert first["wall_seconds"] > 1.5
    resumed = make_trainer(tmp_path, "--rl.steps=2", "--checkpoint.every=1", "--eval.every=0", resume=True)
    t0 = time.perf_counter()
    second = resumed.run()
    # the checkpoint was saved at the end of the first run: its time plus this process's
    assert first["wall_seconds"] < second["wall_seconds"] < first["wall_seconds"] + time.perf_counter() - t0


@pytest.mark.parametrize("vocab,match", [
    (40, r"vocab_size 40 is smaller than the 'char' tokenizer's 100 ids"),
    (400, r"vocab_size 400 is far larger than the 'char' tokenizer's 100 ids"),
    (CharTokenizer().vocab_size, None),
])
def test_a_pretrained_models_vocabulary_is_checked_before_the_warm_start(tmp_path, monkeypatch, vocab, match):
    model_dir = tmp_path / "model"
    model = Qwen3(tiny_qwen3(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1),
                  "aligned")
    model.init_weights(0.02, torch.Generator().manual_seed(0))
    save_pretrained(model, model_dir)
    monkeypatch.setattr(Trainer, "warmup", lambda self: pytest.fail("the warm start ran"))
    cfg = load_config(None, [o for o in TINY if "model.config" not in o] + [f"--model.path={model_dir}",
                                                                           "--model.tokenizer=char"])
    if match is None:
        Trainer(cfg, tmp_path / "run").close()
        return
    with pytest.raises(ValueError, match=match):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_run_folder_context_releases_and_discards(tmp_path):
    with pytest.raises(RuntimeError):
        with RunFolder.open(tmp_path / "a"):
            raise RuntimeError
    assert not (tmp_path / "a").exists()
    with RunFolder.open(tmp_path / "b") as folder:
        (folder.path / "metrics.jsonl").write_text("{}\n")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["metrics.jsonl"]
