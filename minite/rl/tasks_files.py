"""Question/answer tasks from local files (JSONL, JSON, parquet) or Hugging Face `datasets`.

Each record needs a question column and an answer column (names configurable). The gold answer is
read from the answer column according to `answer_format`:

- "gsm8k": the text after the last `####` (GSM8K); the whole column, with the `<<48/2=24>>`
  calculator annotations removed, is the worked solution;
- "boxed": the content of the last `\\boxed{...}` (MATH solutions); the column is the solution;
- "plain": the column is the answer itself; `solution_key` may name a column with a solution;
- "auto" (default): "gsm8k" if the text has `####`, "boxed" if it has `\\boxed{`, else "plain".

Rewards: "exact" (`exact_match_reward`) or "math_verify" (needs `pip install math-verify`).
"""

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from minite.rl.rewards import exact_match_reward, last_boxed, math_verify_available, math_verify_reward
from minite.rl.tasks_base import Example, Task, check_split, example_rng, split_of

ANSWER_FORMATS = ("auto", "gsm8k", "boxed", "plain")
REWARDS = ("exact", "math_verify")
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.jsonl`, `.json` (a list of objects) or `.parquet` file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
        return pq.read_table(path).to_pylist()
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json task file must hold a list of objects")
        return rows
    if path.suffix != ".jsonl":
        raise ValueError(f"{path}: unsupported task file type (use .jsonl, .json or .parquet)")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
    return rows


def _field(record: Mapping[str, Any], key: str, where: str, what: str) -> str:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(record).__name__}")
    if key not in record:
        raise KeyError(
            f"{where}: {what} column {key!r} not found; columns are {sorted(record)} "
            f"(set {what}_key to the right one)"
        )
    return str(record[key])


class QATask(Task):
    """Question/answer task over in-memory records; build it with `from_files` or `from_hf`.

    Args:
        train_records, test_records: rows (dicts). Without `test_records`, a `heldout_fraction`
            share of the train questions (by hash) is held out.
        question_key, answer_key, solution_key: column names.
        answer_format: see the module docstring.
        prompt_template: `str.format` template with `{question}`.
        reward: "exact" or "math_verify".
        seed: shuffles the train split (reshuffled at each pass).
        source: where the rows came from, for error messages.
    """

    def __init__(self, train_records: Iterable[Mapping[str, Any]],
                 test_records: Iterable[Mapping[str, Any]] | None = None, question_key: str = "question",
                 answer_key: str = "answer", solution_key: str | None = None, answer_format: str = "auto",
                 prompt_template: str = "{question}", reward: str = "exact", seed: int = 0,
                 heldout_fraction: float = 0.1, source: str = "records", name: str = "qa"):
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        if reward == "math_verify" and not math_verify_available():
            raise ImportError(
                "reward 'math_verify' needs the optional math-verify package: pip install math-verify"
            )
        if "{question}" not in prompt_template:
            raise ValueError(f"prompt_template must contain {{question}}, got {prompt_template!r}")
        self.name, self.seed, self.reward_kind = name, seed, reward
        self.question_key, self.answer_key, self.solution_key = question_key, answer_key, solution_key
        self.answer_format, self.prompt_template = answer_format, prompt_template
        train = [self._to_example(r, f"{source} train row {i}") for i, r in enumerate(train_records)]
        if test_records is not None:
            test = [self._to_example(r, f"{source} test row {i}") for i, r in enumerate(test_records)]
        else:
            test = [ex for ex in train if split_of(ex.prompt, heldout_fraction, "qa") == "test"]
        held = {ex.prompt for ex in test}
        self._splits = {"train": [ex for ex in train if ex.prompt not in held], "test": test}
        if not self._splits["train"]:
            raise ValueError(f"{source}: the train split is empty")
        self._perm_cache: tuple[int, list[int]] | None = None

    @classmethod
    def from_files(cls, train_path: str | Path, test_path: str | Path | None = None, **kwargs) -> "QATask":
        """Task from local files (`.jsonl`, `.json`, `.parquet`)."""
        test = load_records(test_path) if test_path is not None else None
        kwargs.setdefault("name", Path(train_path).stem)
        return cls(load_records(train_path), test, source=str(train_path), **kwargs)

    @classmethod
    def from_hf(cls, path: str, config: str | None = None, train_split: str = "train",
                test_split: str | None = "test", **kwargs) -> "QATask":
        """Task from Hugging Face `datasets.load_dataset(path, config)` (local or cached data only here)."""
        try:
            import datasets
        except ImportError as e:
            raise ImportError(
                "task 'hf' needs the Hugging Face datasets package: pip install datasets "
                "(or export the data to JSONL/parquet and use task 'file')"
            ) from e
        train = list(datasets.load_dataset(path, config, split=train_split))
        test = list(datasets.load_dataset(path, config, split=test_split)) if test_split else None
        kwargs.setdefault("name", path.rsplit("/", 1)[-1])
        return cls(train, test, source=f"hf:{path}", **kwargs)

    def _to_example(self, record: Mapping[str, Any], where: str) -> Example:
        question = _field(record, self.question_key, where, "question")
        raw = _field(record, self.answer_key, where, "answer")
        fmt = self.answer_format
        if fmt == "auto":
            fmt = "gsm8k" if "####" in raw else "boxed" if "\\boxed{" in raw else "plain"
        if fmt == "gsm8k":
            if "####" not in raw:
                raise ValueError(f"{where}: answer has no '####' (answer_format='gsm8k'): {raw[:80]!r}")
            answer = raw.rsplit("####", 1)[1].strip()
            solution = _CALCULATOR.sub("", raw).strip()
        elif fmt == "boxed":
            answer = last_boxed(raw)
            if answer is None:
                raise ValueError(
                    f"{where}: answer has no \\boxed{{...}} (answer_format='boxed'): {raw[:80]!r}"
                )
            solution = raw.strip()
        else:
            answer, solution = raw.strip(), None
        if self.solution_key is not None:
            solution = _field(record, self.solution_key, where, "solution")
        prompt = self.prompt_template.format(question=question)
        # the record's own fields travel along: a reward given by import path may read them
        return Example(prompt, answer, solution, {**record, "question": question})

    def size(self, split: str) -> int | None:
        check_split(split)
        return len(self._splits[split])

    def rows(self, split: str) -> list[Example]:
        """The examples of `split` in the order of their records."""
        check_split(split)
        return list(self._splits[split])

    def example(self, split: str, index: int) -> Example:
        check_split(split)
        rows = self._splits[split]
        if not rows:
            raise ValueError(f"task {self.name!r} has an empty {split} split")
        epoch, i = divmod(index, len(rows))
        if split == "test":
            return rows[i]
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            perm = list(range(len(rows)))
            example_rng(self.name, self.seed, epoch).shuffle(perm)
            self._perm_cache = (epoch, perm)
        return rows[self._perm_cache[1][i]]

    def reward(self, completion: str, example: Example) -> float:
        if self.reward_kind == "math_verify":
            return math_verify_reward(completion, example.answer)
        return exact_match_reward(completion, example.answer)
