"""A practitioner's path end to end, as the CLI runs it: their own Hugging Face Qwen3 directory (a BPE
tokenizer, a chat template, a generation_config with two stop ids), their own GSM8K-style files and a
reward of their own given by import path; then the run's `final/` loaded by transformers' Auto
classes and evaluated by `minite eval`.

`--rl.steps=2` is the one override beyond the model, the task and the reward: the default 150 steps
would take minutes on a CPU (everything else, the pretrained defaults included, is as shipped; the
model's weights end a response after a few tokens, so the 1024-token default stays cheap).
"""

import json
import sys

import pytest
import torch
import transformers

from minite.cli import main
from tests.rl.hf_model_dir import build_model_dir, qa_rows, write_jsonl

REWARD_MODULE = "practitioner_reward_fn"
REWARD = '''
CALLS = []


def score(completion, example):
    CALLS.append((completion, example.answer, example.meta["question"]))
    return float(example.answer in completion)
'''


DEVICES = [pytest.param([], [], id="cpu"),
           pytest.param(["--model.device=cuda", "--model.dtype=bfloat16"], ["--device=cuda"], id="cuda",
                        marks=pytest.mark.gpu)]


@pytest.mark.parametrize("train_device,eval_device", DEVICES)
def test_own_model_data_and_reward_train_then_load_and_evaluate(tmp_path, monkeypatch, capsys, train_device,
                                                                eval_device):
    if train_device and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, REWARD_MODULE, raising=False)
    train, test = qa_rows(48), qa_rows(8, offset=1000)
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "test.jsonl", test)
    source = build_model_dir(tmp_path / "my_qwen3", [r["question"] + " " + r["answer"] for r in train + test])
    (tmp_path / f"{REWARD_MODULE}.py").write_text(REWARD)

    status = main(["train", "--model.path=my_qwen3", "--task.name=file",
                   '--task.args={train_path="train.jsonl", test_path="test.jsonl"}',
                   f"--task.reward={REWARD_MODULE}:score", "--rl.steps", "2", *train_device])
    assert status == 0
    calls = sys.modules[REWARD_MODULE].CALLS
    # 2 steps x 32 prompts x 8 samples, plus the held-out evaluations (greedy + 4 samples, twice)
    assert len(calls) == 2 * 32 * 8 + 2 * len(test) * 5
    assert {q for _, _, q in calls} >= {r["question"] for r in test}
    run_dir = next((tmp_path / "runs").iterdir())
    config = (run_dir / "config.toml").read_text()
    assert "max_tokens = 1024" in config and "lr = 1e-06" in config  # the pretrained defaults

    final = run_dir / "final"
    src_tok = transformers.AutoTokenizer.from_pretrained(source)
    tok = transformers.AutoTokenizer.from_pretrained(final)
    assert tok.get_vocab() == src_tok.get_vocab() and tok.chat_template == src_tok.chat_template
    assert transformers.GenerationConfig.from_pretrained(final).eos_token_id == [2, 0]
    model = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    before = transformers.AutoModelForCausalLM.from_pretrained(source)
    assert model.config.vocab_size == before.config.vocab_size
    # trained, yet close to where it started (lr 1e-6, two steps)
    moved = [(a - b).abs().max().item() for a, b in zip(model.parameters(), before.parameters())]
    assert 0 < max(moved) < (1e-3 if not train_device else 2e-2)  # bf16 weights: one rounding
    chat = tok.apply_chat_template([{"role": "user", "content": test[0]["question"]}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = chat["input_ids"]
    assert torch.isfinite(model(ids).logits).all()
    assert (next(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) / "model" /
            "tokenizer.json").is_file()

    capsys.readouterr()
    assert main(["eval", f"--model={final}", "--data=test.jsonl", "--n=4", "--json", *eval_device]) == 0
    report = json.loads(capsys.readouterr().out)
    scores = report["files"]["test.jsonl"]
    assert report["chat_template"] and scores["size"] == len(test)
    assert 0 <= scores["pass@1"] <= scores["pass@4"] <= 1
    assert {"greedy_accuracy", "avg@4", "maj@4"} <= scores.keys()
