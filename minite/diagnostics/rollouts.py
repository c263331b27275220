"""Rollouts from any engine in one file: what `minite diagnose --rollouts` and `minite agreement
--rollouts` read (docs/diagnostics.md, "Rollouts from another engine").

Schema: one record per response, as JSON lines (`.jsonl`) or a Parquet table (`.parquet`, the same
columns):

| field | type | what |
| --- | --- | --- |
| `prompt_token_ids` | list[int] | the prompt, as the engine saw it (special tokens included) |
| `response_token_ids` | list[int] | the sampled tokens |
| `logprobs` | list[float] | the engine's log-prob of each sampled token (same length) |
| `top_token_ids` | list[list[int]], optional | per response position, the engine's top-k token ids |
| `top_logprobs` | list[list[float]], optional | their log-probs (same shape) |
| `temperature` | float, optional | the sampling temperature the log-probs are of (default: the command's) |
| `reward` | float, optional | the response's reward (responses of one prompt form its group) |

Converters: `from_vllm(outputs)` takes vLLM `RequestOutput`s (or their JSON form:
`{"prompt_token_ids", "outputs": [{"token_ids", "logprobs": [{token_id: {"logprob", "rank"}}]}]}`;
`SamplingParams(logprobs=k)` gives the sampled token's log-prob and the top k per position);
`from_verl(batch)` takes a verl-style batch (`prompts` [B, P] left-padded, `responses` [B, R],
`attention_mask` [B, P + R] or `response_mask` [B, R], `rollout_log_probs` [B, R], optional
`token_level_scores` / `rewards`), e.g. a `.pt` file of it written with `torch.save`, which
`read_rollouts` converts on reading. JSON-lines records in vLLM's shape are converted on reading too.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SUFFIXES = (".jsonl", ".parquet", ".pt")


@dataclass(frozen=True)
class Rollout:
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    logprobs: list[float]
    top_token_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    temperature: float | None = None
    reward: float | None = None

    def check(self, where: str) -> None:
        if not self.prompt_token_ids or not self.response_token_ids:
            raise ValueError(f"{where}: prompt_token_ids and response_token_ids must not be empty")
        ids = self.prompt_token_ids + self.response_token_ids
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{where}: token ids must be non-negative integers")
        if len(self.logprobs) != len(self.response_token_ids):
            raise ValueError(f"{where}: {len(self.response_token_ids)} response tokens but "
                             f"{len(self.logprobs)} logprobs")
        if not all(isinstance(v, int | float) and not math.isnan(v) and v <= 0 for v in self.logprobs):
            raise ValueError(f"{where}: logprobs must be numbers <= 0")
        if (self.top_token_ids is None) != (self.top_logprobs is None):
            raise ValueError(f"{where}: top_token_ids and top_logprobs go together")
        if self.top_token_ids is not None:
            if len(self.top_token_ids) != len(self.response_token_ids) or any(
                    len(a) != len(b) for a, b in zip(self.top_token_ids, self.top_logprobs)):
                raise ValueError(f"{where}: top_token_ids / top_logprobs need one list per response token, "
                                 "of equal lengths")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"{where}: temperature must be > 0, got {self.temperature}")


def write_rollouts(rollouts: list[Rollout], path: str | Path) -> Path:
    """Write `rollouts` as `.jsonl` or `.parquet` (by the suffix)."""
    path = Path(path)
    rows = [{k: v for k, v in asdict(r).items() if v is not None} for r in rollouts]
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([asdict(r) for r in rollouts]), path)
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        raise ValueError(f"{path}: write rollouts as .jsonl or .parquet")
    return path


def read_rollouts(path: str | Path) -> list[Rollout]:
    """Rollouts of a `.jsonl` / `.parquet` file of the schema, a vLLM-shaped `.jsonl`, or a `.pt`
    verl-style batch; every record checked, a bad one named by its number."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--rollouts {path} does not exist")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"--rollouts {path}: give a {' / '.join(SUFFIXES)} file (docs/diagnostics.md)")
    if path.suffix == ".pt":
        rollouts = from_verl(torch.load(path, map_location="cpu", weights_only=True))
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        rollouts = [_record(row, f"{path} record {i}") for i, row in enumerate(rows, 1)]
    else:
        rollouts = []
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} record {i} is not valid JSON ({e.msg})") from None
            rollouts += from_vllm([row]) if isinstance(row, dict) and "outputs" in row else \
                [_record(row, f"{path} record {i}")]
    if not rollouts:
        raise ValueError(f"--rollouts {path} holds no records")
    for i, r in enumerate(rollouts, 1):
        r.check(f"{path} record {i}")
    return rollouts


def _record(row, where: str) -> Rollout:
    if not isinstance(row, dict):
        raise ValueError(f"{where} is not an object")
    fields = set(Rollout.__dataclass_fields__)
    missing = [f for f in ("prompt_token_ids", "response_token_ids", "logprobs") if row.get(f) is None]
    if missing:
        raise ValueError(f"{where} lacks field {missing[0]!r} (docs/diagnostics.md has the schema)")
    unknown = sorted(set(row) - fields)
    if unknown:
        raise ValueError(f"{where} has unknown field {unknown[0]!r}; fields: {sorted(fields)}")
    return Rollout(**{k: v for k, v in row.items() if k in fields})


def from_vllm(outputs) -> list[Rollout]:
    """vLLM `RequestOutput`s (objects, or dicts of the same fields) -> one Rollout per completion.
    Each position's `logprobs` entry maps token id -> Logprob (`.logprob`, `.rank`) and holds the
    sampled token and the top k; the sampled token is kept among the top k only where it is one."""
    out = []
    for o in outputs:
        prompt = [int(t) for t in _get(o, "prompt_token_ids")]
        for c in _get(o, "outputs"):
            tokens = [int(t) for t in _get(c, "token_ids")]
            positions = _get(c, "logprobs")
            if positions is None:
                raise ValueError("a vLLM completion without logprobs: sample with SamplingParams(logprobs=k)")
            lps, top_ids, top_lps = [], [], []
            for tok, entry in zip(tokens, positions):
                entry = {int(k): v for k, v in entry.items()}
                lps.append(float(_logprob(entry[tok])))
                ranked = sorted(entry.items(), key=lambda kv: _rank(kv[1], kv[0], entry))
                k = len(entry) - (1 if _rank(entry[tok], tok, entry) > len(entry) - 1 else 0)
                top_ids.append([t for t, _ in ranked[:k]])
                top_lps.append([float(_logprob(v)) for _, v in ranked[:k]])
            if not any(top_ids):  # logprobs=0: the sampled tokens' only
                top_ids = top_lps = None
            out.append(Rollout(prompt, tokens, lps, top_ids, top_lps))
    return out


def _get(obj, name):
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def _logprob(v) -> float:
    return v if isinstance(v, int | float) else _get(v, "logprob")


def _rank(v, token: int, entry: dict) -> int:
    """vLLM's rank (1 = most likely); plain floats are ranked by value."""
    rank = None if isinstance(v, int | float) else _get(v, "rank")
    if rank is None:
        rank = 1 + sum(_logprob(w) > _logprob(v) for w in entry.values())
    return rank


def from_verl(batch: dict) -> list[Rollout]:
    """A verl-style batch of tensors (module docstring) -> Rollouts."""
    need = ("prompts", "responses", "rollout_log_probs")
    missing = [k for k in need if k not in batch]
    if missing:
        raise ValueError(f"a verl-style batch needs {list(need)} and attention_mask or response_mask; "
                         f"it lacks {missing[0]!r}")
    prompts, responses, lps = batch["prompts"], batch["responses"], batch["rollout_log_probs"]
    p_len = prompts.shape[1]
    if "attention_mask" in batch:
        mask = batch["attention_mask"].bool()
        prompt_mask, response_mask = mask[:, :p_len], mask[:, p_len:]
    elif "response_mask" in batch:
        response_mask = batch["response_mask"].bool()
        pad = batch.get("pad_token_id")
        prompt_mask = torch.ones_like(prompts, dtype=torch.bool) if pad is None else prompts != pad
    else:
        raise ValueError("a verl-style batch needs attention_mask or response_mask")
    scores = batch.get("token_level_scores", batch.get("rewards"))
    out = []
    for i in range(prompts.shape[0]):
        keep = response_mask[i]
        reward = None
        if scores is not None:
            reward = float(scores[i].sum()) if scores.ndim > 1 else float(scores[i])
        out.append(Rollout(prompts[i][prompt_mask[i]].tolist(), responses[i][keep].tolist(),
                           lps[i][keep].float().tolist(), reward=reward))
    return out


def temperature_of(rollouts: list[Rollout], default: float) -> float:
    """The one temperature of the file's records (each record's, else `default`)."""
    temps = {r.temperature if r.temperature is not None else default for r in rollouts}
    if len(temps) > 1:
        raise ValueError(f"--rollouts: records at different temperatures {sorted(temps)}; diagnose one "
                         "temperature at a time")
    return temps.pop()


def groups(rollouts: list[Rollout]) -> list[int]:
    """Each record's group: the index of its prompt among the distinct prompts, in order of appearance."""
    seen: dict[tuple, int] = {}
    return [seen.setdefault(tuple(r.prompt_token_ids), len(seen)) for r in rollouts]


def check_vocab(rollouts: list[Rollout], vocab: int, path) -> None:
    """Refuse token ids the model cannot embed (rollouts of another model)."""
    for i, r in enumerate(rollouts, 1):
        ids = r.prompt_token_ids + r.response_token_ids + [t for row in r.top_token_ids or [] for t in row]
        if max(ids) >= vocab:
            raise ValueError(f"--rollouts {path} record {i} has token id {max(ids)}, beyond the model's "
                             f"vocabulary ({vocab}): the rollouts are of another model")
