"""The RL loop end to end on a tiny char model (CPU, real sampler and learner): records, report,
checkpoint pointer, TRIAGE in the loop, determinism."""

import json

import pytest
import torch

from minite.config import load_config
from minite.rl.trainer import Trainer

TINY = ["--model.config.hidden_size=32", "--model.config.intermediate_size=64", "--model.config.head_dim=16",
        "--model.config.num_hidden_layers=1", "--rl.prompts=4", "--rl.n=4", "--rl.minibatches=2",
        "--sampling.max_tokens=3", "--warmup.steps=2", "--warmup.batch_size=8", "--eval.size=8",
        "--eval.every=2", "--logging.progress=false", "--logging.tensorboard=false", "--threads=0"]


def parity_reward(completion, example):
    """A reward that a random model earns half the time, so that every group has advantages."""
    return float(sum(map(ord, completion)) % 2)


def make_trainer(tmp_path, *overrides, resume=False, reward=None):
    cfg = load_config(None, TINY + list(overrides))
    trainer = Trainer(cfg, tmp_path / "run", resume=resume)
    if reward is not None:
        trainer.task.reward = reward
    return trainer


def test_loop_writes_metrics_report_and_checkpoints(tmp_path):
    summary = make_trainer(tmp_path, "--rl.steps=2", "--checkpoint.every=1").run()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("rl") == 2 and kinds.count("warmup") >= 1 and kinds.count("eval") == 2
    rl = [r for r in records if r["kind"] == "rl"]
    for key in ("reward", "mismatch/k3_kl", "mismatch/logprob_abs_diff_max", "loss/total", "update/grad_norm",
                "rollout/tokens_per_s", "correction/keep_frac"):
        assert key in rl[0], key
    # fp32 reference path: the learner's theta_old log-probs match the sampler's closely
    assert rl[0]["mismatch/logprob_abs_diff_max"] < 1e-4
    assert (run / "report.png").stat().st_size > 1000
    assert (run / "curves.png").stat().st_size > 1000  # the diagnostics report of the run
    assert "k3_kl" in json.loads((run / "report.json").read_text())["curves"]
    assert summary["rl_steps"] == 2 and "eval_accuracy_last" in summary
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == 2
    assert (run / "config.toml").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
    with pytest.raises(ValueError, match="--resume"):
        make_trainer(tmp_path, "--rl.steps=2")


def test_triage_correction_runs_in_the_loop(tmp_path):
    make_trainer(tmp_path, "--rl.steps=1", "--checkpoint.every=0", "--rl.correction.name=triage",
                 "--warmup.steps=0", "--eval.every=0", reward=parity_reward).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["kind"] == "rl"][0]
    assert any(k.startswith("triage/") for k in rl)
    assert rl["adv/zero_std_frac"] < 1 and rl["update/grad_norm"] > 0


def test_same_seed_same_run(tmp_path):
    a = make_trainer(tmp_path / "a", "--rl.steps=1", "--checkpoint.every=0", "--warmup.steps=1",
                     reward=parity_reward)
    b = make_trainer(tmp_path / "b", "--rl.steps=1", "--checkpoint.every=0", "--warmup.steps=1",
                     reward=parity_reward)
    a.run()
    b.run()
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_warmup_needs_solutions(tmp_path):
    trainer = make_trainer(tmp_path, "--rl.steps=1")
    trainer.task.example = lambda split, i, ex=trainer.task.example: type(ex(split, i))("1+1=", "2")
    with pytest.raises(ValueError, match="warmup.steps"):
        trainer.run()


def test_a_random_preset_takes_the_tokenizers_vocabulary(tmp_path):
    """A random-weight MoE preset built for another vocabulary trains with the char tokenizer (its
    vocab_size becomes the tokenizer's: otherwise the sampler drew ids the tokenizer cannot decode)."""
    trainer = make_trainer(tmp_path, "--model.preset=tiny-qwen3-moe", "--rl.steps=1", "--checkpoint.every=0",
                           "--warmup.steps=1", "--eval.every=0", reward=parity_reward)
    assert trainer.model.config.vocab_size == trainer.tokenizer.vocab_size
    assert trainer.run()["rl_steps"] == 1
    with pytest.raises(ValueError, match="larger than the tokenizer"):
        make_trainer(tmp_path / "b", "--model.config.vocab_size=300", "--rl.steps=1")


def test_every_run_ends_in_a_full_hugging_face_directory_and_tensorboard_events(tmp_path):
    """checkpoint.every = 0 still leaves the trained model, in final/, loadable by transformers' Auto
    classes with the char tokenizer it was trained with; the default logging writes event files."""
    import transformers

    from minite.models.checkpoint import to_hf_tensors

    trainer = make_trainer(tmp_path, "--rl.steps=1", "--checkpoint.every=0", "--eval.every=0",
                           "--logging.tensorboard=true")
    summary = trainer.run()
    final = tmp_path / "run" / "final"
    assert summary["final"] == str(final)
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    ours = to_hf_tensors(trainer.model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ours[name]), name
    tok = transformers.AutoTokenizer.from_pretrained(final)
    assert tok.encode("3+4=", add_special_tokens=False) == trainer.tokenizer.encode("3+4=")
    assert transformers.GenerationConfig.from_pretrained(final).eos_token_id == trainer.tokenizer.eos_token_id


def test_eval_files_are_scored_apart_from_the_task(tmp_path):
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in [(1, 2), (3, 4), (2, 2)]]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    make_trainer(tmp_path, "--rl.steps=1", "--checkpoint.every=0", "--eval.every=0",
                 f"--eval.files=[\"{data}\"]").run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 2
    for r in evals:
        assert r["eval/sums/size"] == 3 and 0 <= r["eval/sums/pass@1"] <= r["eval/sums/pass@4"] <= 1
        assert {"eval/sums/greedy_accuracy", "eval/sums/maj@4", "eval/sums/avg@4"} <= r.keys()


def test_wandb_without_the_package_is_refused_before_training():
    import importlib.util

    from minite.config import ConfigError

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    with pytest.raises(ConfigError, match="logging.wandb: true needs the wandb package: pip install wandb"):
        load_config(None, ["--logging.wandb=true"])
