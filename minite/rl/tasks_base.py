"""The task interface: `Example`, the abstract `Task`, and the split helpers every task uses.

A task serves examples by (split, index): `task.example("train", i)` is a pure function of the task's
arguments (seed included) and `i`, so the trainer's data position is one integer and a resumed run sees
the same examples. Splits are "train" and "test" (held out) and never share a problem (`split_of`
assigns a problem to a split by a hash of its key). The tasks themselves live in `tasks_builtin.py`
and `tasks_files.py`; `minite.rl.tasks.make_task` builds one by name.
"""

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Example:
    """One problem: the prompt, the gold answer, an optional worked solution (supervised warm start:
    the target completion, without the eos token) and task-specific data (e.g. Countdown numbers)."""

    prompt: str
    answer: str
    solution: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def split_of(key: str, heldout_fraction: float, salt: str = "") -> str:
    """'test' for a stable `heldout_fraction` share of keys (by SHA-256), else 'train'."""
    digest = hashlib.sha256(f"{salt}\x00{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "test" if u < heldout_fraction else "train"


def example_rng(*parts: object) -> random.Random:
    """A `random.Random` seeded from `parts`; string seeding is stable across processes."""
    return random.Random(":".join(str(p) for p in parts))


class Task(ABC):
    """Common interface of all tasks (see the module docstring)."""

    name: str = "task"

    @abstractmethod
    def example(self, split: str, index: int) -> Example:
        """Example `index` of `split`; deterministic."""

    @abstractmethod
    def size(self, split: str) -> int | None:
        """Number of distinct examples in `split`, or None for an unbounded generator."""

    @abstractmethod
    def reward(self, completion: str, example: Example) -> float:
        """Reward of a completion (decoded text after the prompt) for `example`."""

    def batch(self, split: str, start: int, n: int) -> list[Example]:
        """Examples `start .. start + n - 1` of `split`."""
        return [self.example(split, i) for i in range(start, start + n)]

    def examples(self, split: str, start: int = 0) -> Iterator[Example]:
        """Endless stream of `split` from index `start` (finite splits wrap around; train reshuffled)."""
        i = start
        while True:
            yield self.example(split, i)
            i += 1

    def heldout(self, n: int) -> list[Example]:
        """Up to `n` distinct held-out examples, in a fixed order (for evaluation)."""
        size = self.size("test")
        if size is not None:
            return [self.example("test", i) for i in range(min(n, size))]
        # A generator may have fewer than n distinct held-out problems: stop after a long run of repeats.
        seen: dict[str, Example] = {}
        misses = i = 0
        while len(seen) < n and misses < 100 + 10 * len(seen):
            ex = self.example("test", i)
            i += 1
            if ex.prompt in seen:
                misses += 1
            else:
                seen[ex.prompt] = ex
                misses = 0
        return list(seen.values())
