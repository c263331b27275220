"""The RL loop end to end on a tiny char model (CPU): records, report, reward signal, determinism.

`PackedSampler` is a minimal stand-in with the sampler's interface (full recompute of packed
sequences each decode step, no KV cache), so these tests check the loop, not the engine.
"""

import json
from dataclasses import dataclass

import pytest
import torch

from minite.config import load_config
from minite.rl.trainer import Trainer
from minite.sampling import processed_logprobs

TINY = ["--model.config.hidden_size=32", "--model.config.intermediate_size=64", "--model.config.head_dim=16",
        "--model.config.num_hidden_layers=1", "--rl.prompts=4", "--rl.n=4", "--rl.minibatches=2",
        "--sampling.max_tokens=3", "--warmup.steps=2", "--warmup.batch_size=8", "--eval.size=8",
        "--eval.every=2", "--logging.progress=false", "--logging.tensorboard=false"]


@dataclass
class Sample:
    token_ids: list
    logprobs: torch.Tensor
    finish_reason: str


@dataclass
class Request:
    index: int
    samples: list


class PackedSampler:
    """`generate(prompts, params)` on the model's current weights; seeded multinomial sampling."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def generate(self, prompts, params):
        gen = torch.Generator().manual_seed(params.seed or 0)
        seqs = [list(p) for p in prompts for _ in range(params.n)]
        plen = [len(p) for p in prompts for _ in range(params.n)]
        lps = [[] for _ in seqs]
        done = [None] * len(seqs)
        for _ in range(params.max_tokens):
            live = [i for i, d in enumerate(done) if d is None]
            if not live:
                break
            ids = torch.tensor([t for i in live for t in seqs[i]])[None]
            cu = torch.tensor([0] + [len(seqs[i]) for i in live]).cumsum(0)
            h = self.model.hidden_states(ids, cu_seqlens=cu)[0, cu[1:] - 1]
            lp = processed_logprobs(self.model.logits(h), params.temperature, params.top_k, params.top_p)
            greedy = params.temperature == 0
            tok = lp.argmax(-1) if greedy else torch.multinomial(lp.exp(), 1, generator=gen)[:, 0]
            for j, i in enumerate(live):
                seqs[i].append(int(tok[j]))
                lps[i].append(float(lp[j, tok[j]]))
                if int(tok[j]) in params.stop_token_ids:
                    done[i] = "stop"
        samples = [Sample(s[p:], torch.tensor(lp), d or "length")
                   for s, p, lp, d in zip(seqs, plen, lps, done)]
        return [Request(r, samples[r * params.n:(r + 1) * params.n]) for r in range(len(prompts))]


def make_trainer(tmp_path, *overrides, resume=False):
    cfg = load_config(None, TINY + list(overrides))
    return Trainer(cfg, tmp_path / "run", resume=resume, make_sampler=PackedSampler)


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
    assert summary["rl_steps"] == 2 and "eval_accuracy_last" in summary
    assert json.loads((run / "summary.json").read_text())["rl_steps"] == 2
    assert (run / "config.toml").is_file()
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_triage_correction_runs_in_the_loop(tmp_path):
    make_trainer(tmp_path, "--rl.steps=1", "--checkpoint.every=0", "--rl.correction.name=triage",
                 "--warmup.steps=0", "--eval.every=0").run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["kind"] == "rl"][0]
    assert any(k.startswith("triage/") for k in rl)


def test_same_seed_same_run(tmp_path):
    a = make_trainer(tmp_path / "a", "--rl.steps=1", "--checkpoint.every=0", "--warmup.steps=1")
    b = make_trainer(tmp_path / "b", "--rl.steps=1", "--checkpoint.every=0", "--warmup.steps=1")
    a.run()
    b.run()
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)


def test_warmup_needs_solutions(tmp_path):
    trainer = make_trainer(tmp_path, "--rl.steps=1")
    trainer.task.example = lambda split, i, ex=trainer.task.example: type(ex(split, i))("1+1=", "2")
    with pytest.raises(ValueError, match="warmup.steps"):
        trainer.run()
