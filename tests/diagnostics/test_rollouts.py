"""Rollouts from another engine: the file schema, the vLLM and verl converters, and a rollout file
written from Hugging Face `generate` diagnosed end to end (`minite diagnose / agreement --rollouts`)."""

import json
from types import SimpleNamespace

import pytest
import torch

from minite.cli import main
from minite.diagnostics.rollouts import Rollout, from_verl, from_vllm, read_rollouts, write_rollouts
from minite.models.config import tiny_qwen3
from tests.models.hf_helpers import random_hf_model

TOP_K = 5
EOS = 1


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    """A tiny transformers Qwen3 (built offline) saved as a model directory, and rollouts it sampled
    with `generate` (temperature 0.8, no top-k / top-p: the plain tempered distribution), their
    log-probs and top-k from `output_scores`, a reward per response."""
    root = tmp_path_factory.mktemp("hf_rollouts")
    model = random_hf_model(tiny_qwen3(eos_token_id=EOS), seed=3)
    model.save_pretrained(root / "model")
    torch.manual_seed(0)
    prompts = torch.randint(2, 128, (3, 6), generator=torch.Generator().manual_seed(4))
    rollouts = []
    for prompt in prompts:
        out = model.generate(prompt[None].repeat(2, 1), do_sample=True, temperature=0.8, top_k=0, top_p=1.0,
                             max_new_tokens=10, output_scores=True, return_dict_in_generate=True,
                             eos_token_id=EOS, pad_token_id=EOS)
        steps = torch.stack(out.scores, 1).log_softmax(-1)  # [2, T, V]: processed (tempered) scores
        for b in range(2):
            response = out.sequences[b, prompt.numel():].tolist()
            if EOS in response:
                response = response[: response.index(EOS) + 1]
            lp = steps[b, : len(response)]
            top = lp.topk(TOP_K, -1)
            rollouts.append(Rollout(prompt.tolist(), response,
                                    lp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist(),
                                    top.indices.tolist(), top.values.tolist(), temperature=0.8,
                                    reward=float(len(response) % 2)))
    write_rollouts(rollouts, root / "rollouts.jsonl")
    write_rollouts(rollouts, root / "rollouts.parquet")
    return root, rollouts


def test_the_file_round_trips(hf_run):
    root, rollouts = hf_run
    assert read_rollouts(root / "rollouts.jsonl") == rollouts
    assert read_rollouts(root / "rollouts.parquet") == rollouts


def test_diagnose_a_generate_rollout_file_end_to_end(hf_run, tmp_path, capsys):
    root, rollouts = hf_run
    out = tmp_path / "report"
    assert main(["diagnose", "--model", str(root / "model"), "--rollouts", str(root / "rollouts.parquet"),
                 "--learner-recipe", "bf16", "--sampler-recipe", "aligned", "--dtype", "fp32",
                 "--out", str(out)]) == 0
    assert "over the sampler's top-k" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    n_tokens = sum(len(r.response_token_ids) for r in rollouts)
    m, d = report["metrics"], report["distribution"]
    assert m["n_tokens"] == n_tokens and report["config"]["temperature"] == 0.8
    # HF's fp32 forward vs ours in fp32: the same distribution, so the file's log-probs are recomputed
    # at the right positions (no shift, the same temperature)
    assert m["logprob_abs_diff_max"] < 1e-4 and abs(m["k3_kl"]) < 1e-8
    assert d["n_positions"] == n_tokens and d["topk_overlap"] == 1.0 and d["top1_agree"] == 1.0
    assert d["topk_tv"] < 1e-5 and abs(d["topk_mass_sampler"] - d["topk_mass_learner"]) < 1e-5
    assert "direction" in report and report["config"]["reward_mean"] == pytest.approx(
        sum(r.reward for r in rollouts) / len(rollouts))
    assert report["attribution"]["rows"] and report["localization"]["ops"]
    html = (out / "report.html").read_text()
    assert "distribution over the sampler's top-k" in html
    assert "token-level mismatch" in html


def test_agreement_on_a_rollout_file_under_an_nvfp4_learner(hf_run, capsys):
    root, rollouts = hf_run
    assert main(["agreement", "--model", str(root / "model"), "--rollouts", str(root / "rollouts.jsonl"),
                 "--learner-recipe", "aligned", "--dtype", "float32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["sampler_recipe"] == "rollouts"
    assert r["n_tokens"] == sum(len(x.response_token_ids) for x in rollouts)
    assert 0 < r["logprob_abs_diff_mean"] < 1.0 and r["distribution"]["n_positions"] == r["n_tokens"]
    assert main(["agreement", "--model", str(root / "model"), "--rollouts", str(root / "rollouts.jsonl"),
                 "--learner-recipe", "bf16", "--dtype", "float32"]) == 0
    assert "over the file's top-k" in capsys.readouterr().out


def test_from_vllm_request_outputs():
    lp = lambda v, r: SimpleNamespace(logprob=v, rank=r, decoded_token="")
    # position 0: the sampled token 7 is the top one; position 1: sampled 9 lies outside the top 2
    positions = [{7: lp(-0.1, 1), 8: lp(-2.5, 2)}, {5: lp(-0.3, 1), 6: lp(-1.6, 2), 9: lp(-4.0, 7)}]
    completion = SimpleNamespace(token_ids=[7, 9], logprobs=positions)
    out = SimpleNamespace(prompt_token_ids=[3, 4], outputs=[completion])
    (r,) = from_vllm([out])
    assert r.prompt_token_ids == [3, 4] and r.response_token_ids == [7, 9] and r.logprobs == [-0.1, -4.0]
    assert r.top_token_ids == [[7, 8], [5, 6]] and r.top_logprobs == [[-0.1, -2.5], [-0.3, -1.6]]
    as_json = {"prompt_token_ids": [3, 4], "outputs": [{"token_ids": [7, 9], "logprobs": [
        {"7": {"logprob": -0.1, "rank": 1}, "8": {"logprob": -2.5, "rank": 2}},
        {"5": {"logprob": -0.3, "rank": 1}, "6": {"logprob": -1.6, "rank": 2},
         "9": {"logprob": -4.0, "rank": 7}}]}]}
    assert from_vllm([as_json]) == [r]


def test_from_verl_batch(tmp_path):
    batch = {"prompts": torch.tensor([[0, 5, 6], [7, 8, 9]]),
             "responses": torch.tensor([[10, 11, 0], [12, 0, 0]]),
             "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
             "rollout_log_probs": torch.tensor([[-0.5, -0.25, 0.0], [-1.0, 0.0, 0.0]]),
             "token_level_scores": torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])}
    rs = from_verl(batch)
    assert [r.prompt_token_ids for r in rs] == [[5, 6], [7, 8, 9]]
    assert [r.response_token_ids for r in rs] == [[10, 11], [12]] and rs[0].logprobs == [-0.5, -0.25]
    assert [r.reward for r in rs] == [1.0, 0.0]
    torch.save(batch, tmp_path / "batch.pt")
    assert read_rollouts(tmp_path / "batch.pt") == rs


GOOD = {"prompt_token_ids": [1], "response_token_ids": [2], "logprobs": [-1.0]}


@pytest.mark.parametrize("row, message", [
    ({**GOOD, "response_token_ids": [2, 3]}, "2 response tokens but 1"),
    ({"prompt_token_ids": [1], "logprobs": [-1.0]}, "lacks field 'response_token_ids'"),
    ({**GOOD, "logprobs": [0.5]}, "numbers <= 0"),
    ({**GOOD, "score": 1}, "unknown field 'score'"),
])
def test_bad_records_are_named(tmp_path, row, message):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=f"record 2.*{message}"):
        read_rollouts(path)


def test_rollouts_of_another_model_are_refused(hf_run, tmp_path, capsys):
    root, _ = hf_run
    path = write_rollouts([Rollout([1, 2], [500], [-1.0])], tmp_path / "r.jsonl")
    assert main(["agreement", "--model", str(root / "model"), "--rollouts", str(path)]) == 2
    assert "beyond the model's vocabulary" in capsys.readouterr().err
