"""Rewards given by import path (`--task.reward=module:function`): called in the loop with the
example's fields; weighted sums; bad specs and bad values named."""

import json

import pytest

from minite.config import ConfigError, load_config
from minite.rl.reward_import import WeightedRewards, load_reward
from minite.rl.tasks import Example, make_task
from minite.rl.trainer import Trainer
from tests.rl.test_trainer import TINY

REWARDS = '''
CALLS = []

def length(completion, example):
    CALLS.append((completion, example.prompt, example.answer))
    return float(len(completion) % 2)

def one(completion, example):
    return 1.0

def source_field(completion, example):
    return float(example.meta["source"] == "gsm8k")

def nan(completion, example):
    return float("nan")
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def test_a_reward_by_file_path_is_called_in_the_loop(tmp_path, reward_file):
    cfg = load_config(None, TINY + ["--rl.steps=1", "--checkpoint.every=0", "--eval.every=0",
                                    f"--task.reward={reward_file}:one"])
    summary = Trainer(cfg, tmp_path / "run").run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in records if r["kind"] == "rl"] == [1.0]
    assert summary["eval_accuracy_last"] == 1.0  # every held-out answer scores 1 under this reward


def test_a_reward_by_module_name_sees_the_example(tmp_path, reward_file, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fn = load_reward("my_rewards:length")
    ex = Example("2+3=", "5")
    assert fn("12", ex) == 0.0 and fn("123", ex) == 1.0
    import my_rewards

    assert my_rewards.CALLS[-1] == ("123", "2+3=", "5")


def test_weighted_rewards_and_record_fields(tmp_path, reward_file):
    rows = tmp_path / "qa.jsonl"
    rows.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i), "source": "gsm8k"})
                              for i in range(20)))
    task = make_task("file", train_path=str(rows), heldout_fraction=0.5)
    ex = task.example("train", 0)
    combined = WeightedRewards([f"{reward_file}:one", f"{reward_file}:source_field"], [0.25, 2.0])
    assert combined("x", ex) == 2.25


@pytest.mark.parametrize("override,match", [
    ("--task.reward=no_colon", "module:function"),
    ("--task.reward=json:not_there", "has no function 'not_there'"),
    ("--task.reward=not_a_module_xyz:f", "cannot import 'not_a_module_xyz'"),
    ("--task.reward=missing.py:f", "does not exist"),
    ("--task.reward_weights=[1.0]", "reward_weights need task.reward"),
])
def test_bad_reward_specs_name_the_key(override, match):
    with pytest.raises(ConfigError, match=f"task.reward: .*{match}"):
        load_config(None, [override])


def test_a_reward_returning_nan_is_named(reward_file):
    with pytest.raises(ValueError, match="nan.*returned nan"):
        WeightedRewards([f"{reward_file}:nan"])("x", Example("p", "a"))


def test_a_file_too_small_for_a_held_out_split_is_refused_before_training(tmp_path):
    rows = tmp_path / "six.jsonl"
    rows.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(6)))
    cfg = load_config(None, TINY + ["--task.name=file", f"--task.args={{train_path=\"{rows}\"}}",
                                    "--warmup.steps=0"])
    with pytest.raises(ValueError, match="no held-out examples.*test_path"):
        Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
