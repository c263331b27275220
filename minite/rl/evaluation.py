"""Accuracy of a model on a set of examples: greedy, and over k samples per example.

With n samples per example, c of them correct (reward >= 1):

    pass@k = mean over examples of 1 - C(n - c, k) / C(n, k)     (the unbiased estimator of Chen et
             al. 2021, "Evaluating Large Language Models Trained on Code"; k <= n)
    avg@n  = mean over examples of c / n                          (= pass@1)
    maj@n  = mean over examples of [the answer most of the n samples give is correct] (majority vote
             over `extract_answer` of each completion, ties to the answer seen first; completions
             without an answer do not vote)

pass@k is reported for k = 1, 2, 4, ... up to n and for n itself. `evaluate_examples` runs the
sampler and scores; `read_eval_file` reads a GSM8K- or MATH-style question/answer file.
"""

from __future__ import annotations

from collections import Counter
from math import comb
from pathlib import Path

from minite.rl.prompts import PromptFormat, cut_at_stop_strings
from minite.rl.rewards import extract_answer
from minite.rl.tasks_base import Example
from minite.rl.tasks_files import QATask, load_records
from minite.sampling import SamplingParams

QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = ("answer", "solution", "gold")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one example with `c` correct among `n` samples."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks(n: int) -> list[int]:
    """1, 2, 4, ... <= n, and n."""
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out if out[-1] == n else out + [n]


def majority_correct(completions: list[str], correct: list[bool]) -> bool:
    """Whether the answer most completions give (first seen on ties) is a correct one."""
    answers = [extract_answer(c) for c in completions]
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == top)
    return any(ok for a, ok in zip(answers, correct) if a == winner)


def sample_metrics(completions: list[list[str]], rewards: list[list[float]]) -> dict[str, float]:
    """pass@k, avg@n and maj@n over examples, each with n completions and their rewards."""
    n = len(rewards[0])
    if not rewards or any(len(r) != n for r in rewards):
        raise ValueError("every example needs the same number of samples")
    correct = [[r >= 1.0 for r in row] for row in rewards]
    out = {f"pass@{k}": sum(pass_at_k(n, sum(row), k) for row in correct) / len(correct) for k in ks(n)}
    out[f"avg@{n}"] = sum(sum(row) / n for row in correct) / len(correct)
    out[f"maj@{n}"] = sum(majority_correct(c, ok) for c, ok in zip(completions, correct)) / len(correct)
    out["mean_reward"] = sum(sum(row) for row in rewards) / (n * len(rewards))
    return out


def evaluate_examples(sampler, tokenizer, examples: list[Example], reward, *, n: int, max_tokens: int,
                      stop_token_ids: tuple[int, ...], prompt_format: PromptFormat | None = None,
                      stop: list[str] = (), temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      seed: int = 0) -> dict[str, float]:
    """Greedy accuracy and (n >= 1) the sampled metrics of `sample_metrics` on `examples`."""
    if not examples:
        raise ValueError("no examples to evaluate on")
    prompt_format = prompt_format or PromptFormat()
    prompts = [prompt_format.encode(tokenizer, ex.prompt) for ex in examples]

    def run(params: SamplingParams) -> tuple[list[list[str]], list[list[float]], list[float]]:
        outs = sorted(sampler.generate(prompts, params), key=lambda o: o.index)
        texts, rewards, lengths = [], [], []
        for ex, o in zip(examples, outs):
            cut = [cut_at_stop_strings(s, tokenizer, list(stop)) for s in o.samples]
            texts.append([tokenizer.decode(s.token_ids) for s in cut])
            rewards.append([float(reward(t, ex)) for t in texts[-1]])
            lengths += [len(s.token_ids) for s in cut]
        return texts, rewards, lengths

    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop_token_ids)
    _, rewards, lengths = run(greedy)
    metrics = {"size": float(len(examples)),
               "greedy_accuracy": sum(r[0] >= 1.0 for r in rewards) / len(rewards),
               "greedy_reward": sum(r[0] for r in rewards) / len(rewards),
               "greedy_response_len": sum(lengths) / len(lengths)}
    if n:
        sampled = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                 max_tokens=max_tokens, stop_token_ids=stop_token_ids, seed=seed)
        texts, rewards, lengths = run(sampled)
        metrics.update(sample_metrics(texts, rewards))
        metrics["response_len"] = sum(lengths) / len(lengths)
    return metrics


def _column(record: dict, keys: tuple[str, ...], given: str | None, path: Path, what: str) -> str:
    if given:
        return given
    found = next((k for k in keys if k in record), None)
    if found is None:
        raise ValueError(f"{path}: no {what} column among {list(keys)} (columns are {sorted(record)}); "
                         f"name it with --{what}-key")
    return found


def read_eval_file(path: str | Path, question_key: str | None = None, answer_key: str | None = None,
                   reward: str = "exact",
                   prompt_template: str = "{question}") -> tuple[list[Example], QATask]:
    """Every record of a JSONL / JSON / parquet file as an `Example` (a GSM8K-style `####` answer or a
    MATH-style `\\boxed{}` solution read as `QATask` reads it; columns found by name unless given),
    and the task whose `reward` ("exact" or "math_verify") scores them."""
    path = Path(path)
    records = load_records(path)
    if not records:
        raise ValueError(f"{path} holds no records")
    q = _column(records[0], QUESTION_KEYS, question_key, path, "question")
    a = _column(records[0], ANSWER_KEYS, answer_key, path, "answer")
    task = QATask(records, [], question_key=q, answer_key=a, reward=reward, prompt_template=prompt_template,
                  source=str(path), name=path.stem)
    return task.rows("train"), task
