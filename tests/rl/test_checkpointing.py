"""Checkpoints: resume is bitwise the uninterrupted run; a crash never leaves a loadable half checkpoint."""

import json

import pytest
import torch

from minite.learner import Learner
from minite.rl import checkpointing
from minite.rl.checkpointing import (
    latest_checkpoint,
    load_checkpoint,
    load_latest_checkpoint,
    save_checkpoint,
)
from tests.rl.test_trainer import make_trainer, parity_reward

# with a KL penalty, so that the frozen reference model is checkpointed and restored too
RESUME = ["--rl.steps=4", "--checkpoint.every=1", "--checkpoint.keep=2", "--eval.every=0",
          "--rl.loss.kl_coef=0.05"]


class Killed(RuntimeError):
    pass


@pytest.mark.slow
def test_kill_mid_step_and_resume_gives_identical_parameters(tmp_path, monkeypatch):
    straight = make_trainer(tmp_path / "straight", *RESUME, reward=parity_reward)
    straight.run()

    killed = make_trainer(tmp_path / "killed", *RESUME, reward=parity_reward)
    real_step = Learner.step
    calls = []

    def step_then_die(self, *args, **kwargs):
        if self is killed.learner and killed.step == 3:
            calls.append(1)
            if len(calls) == 2:  # after step 3's first minibatch update: the model is half-updated
                raise Killed
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(Learner, "step", step_then_die)
    with pytest.raises(Killed):
        killed.run()
    monkeypatch.setattr(Learner, "step", real_step)
    assert latest_checkpoint(tmp_path / "killed" / "run" / "checkpoints").name == "step_000002"

    resumed = make_trainer(tmp_path / "killed", *RESUME, resume=True, reward=parity_reward)
    assert resumed.step == 2
    resumed.run()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert a.dtype == torch.float32
        assert torch.equal(a, b), name
    for a, b in zip(straight.learner.optimizer.masters, resumed.learner.optimizer.masters):
        assert torch.equal(a, b)
    rewards = lambda run: [(r["step"], r["reward"], r["loss/kl"])
                           for r in map(json.loads, (run / "metrics.jsonl").open()) if r["kind"] == "rl"]
    assert rewards(tmp_path / "killed" / "run") == rewards(tmp_path / "straight" / "run")
    # the policy really moved: advantages were nonzero and the KL to the reference grew
    assert all(0 < r < 1 for _, r, _ in rewards(tmp_path / "straight" / "run"))
    assert rewards(tmp_path / "straight" / "run")[-1][2] > 0


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, "--rl.steps=1", "--warmup.steps=0")
    ckpt = tmp_path / "ckpt"
    state = {"learner": {}, "data": {"position": 0}}
    save_checkpoint(ckpt, 1, {"model": trainer.model}, state)

    def torn_write(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpointing.torch, "save", torn_write)
    with pytest.raises(OSError):
        save_checkpoint(ckpt, 2, {"model": trainer.model}, state)
    assert latest_checkpoint(ckpt).name == "step_000001"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000001"]


def test_hard_kill_leftovers_are_ignored_and_pruned(tmp_path):
    trainer = make_trainer(tmp_path, "--rl.steps=1", "--warmup.steps=0")
    ckpt = tmp_path / "ckpt"
    state = {"learner": {}, "data": {"position": 0}}
    assert latest_checkpoint(ckpt) is None
    save_checkpoint(ckpt, 1, {"model": trainer.model}, state)
    # a process killed inside save leaves its temporary directory behind, never a step_ directory
    half = ckpt / ".step_000002.tmp-deadbeef"
    (half / "model").mkdir(parents=True)
    assert latest_checkpoint(ckpt).name == "step_000001"
    for step in (2, 3, 4):
        save_checkpoint(ckpt, step, {"model": trainer.model}, state, keep=2)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000003", "step_000004"]
    models, loaded = load_checkpoint(ckpt / "step_000004", trainer.recipe, torch.float32, "cpu")
    model = models["model"]
    assert loaded["step"] == 4 and set(loaded["rng"]) >= {"torch", "python", "numpy"}
    for a, b in zip(trainer.model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_latest_pointing_at_a_missing_checkpoint_and_nothing_older_is_an_error(tmp_path):
    (tmp_path / "latest").write_text("step_000009\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000009"
    with pytest.raises(ValueError, match=r"no checkpoint .* can be loaded \(step_000009: FileNotFoundError"):
        load_latest_checkpoint(tmp_path, "aligned", torch.float32, "cpu", warn=lambda text: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # nothing moved or removed


def test_static_scale_recipe_calibrates_and_its_scales_survive_resume(tmp_path, monkeypatch):
    from minite.nn.calibrate import static_scales
    from minite.rl.trainer import Trainer

    args = ["--recipe.name=vllm", "--rl.steps=2", "--checkpoint.every=1", "--eval.every=0"]
    seen = []
    real = Trainer.calibrate

    def calibrate_and_record(self):
        real(self)
        seen.append(static_scales(self.model))

    monkeypatch.setattr(Trainer, "calibrate", calibrate_and_record)
    run = make_trainer(tmp_path, *args)
    run.run()
    assert len(seen) == 2  # before the warm start, and again after it (the weights moved)
    before, after = seen
    assert before and before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    final = static_scales(run.model)
    assert all(torch.equal(final[k], after[k]) for k in after)  # fixed through RL

    resumed = make_trainer(tmp_path, *args[:1], "--rl.steps=3", resume=True)
    assert len(seen) == 2  # resume restores, never recalibrates
    assert all(torch.equal(static_scales(resumed.model)[k], final[k]) for k in final)
    resumed.run()
    assert resumed.step == 3


def test_full_disk_while_saving_the_state_names_it_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from minite.files import WriteError

    trainer = make_trainer(tmp_path, "--rl.steps=1", "--checkpoint.every=1", reward=parity_reward)
    trainer.run()
    ckpts = tmp_path / "run" / "checkpoints"
    before = {p: p.read_bytes() for p in ckpts.rglob("*") if p.is_file()}
    real = Path.write_bytes

    def full(self, data):
        if self.name == "state.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(WriteError, match="state.pt: no space left on the device; free space"):
        save_checkpoint(ckpts, 2, {"model": trainer.model}, {"learner": trainer.learner.state_dict()})
    assert {p: p.read_bytes() for p in ckpts.rglob("*") if p.is_file()} == before
