"""Tasks: where prompts, gold answers and rewards come from; `make_task(name, **kwargs)` builds one.

The interface (`Example`, `Task`: examples by (split, index), deterministic, train and test disjoint)
is `tasks_base.py`, re-exported here. The tasks:

- generated tasks (`ArithmeticTask`, `CountdownTask` in `tasks_builtin.py`) assign every problem to a
  split by a hash of its canonical key (`split_of`), independent of the seed, then draw from each
  split's side (rejection sampling) - unbounded, `size(split)` is None;
- file and Hugging Face tasks (`QATask` in `tasks_files.py`) use the given test file/split, or hash
  the questions into a held-out fraction; train questions that also appear in test are dropped.

Names: "arithmetic", "countdown", "file" (local JSONL, JSON or parquet) or "hf" (Hugging Face
`datasets`).
"""

from typing import Any

from minite.rl.tasks_base import SPLITS, Example, Task, check_split, example_rng, split_of
from minite.rl.tasks_builtin import ArithmeticTask, CountdownTask
from minite.rl.tasks_files import QATask

__all__ = ["SPLITS", "ArithmeticTask", "CountdownTask", "Example", "QATask", "Task", "check_split",
           "example_rng", "make_task", "split_of"]


def make_task(name: str, **kwargs: Any) -> Task:
    """Build a task by name; keyword arguments go to its constructor (see each class)."""
    builders = {
        "arithmetic": ArithmeticTask,
        "countdown": CountdownTask,
        "file": QATask.from_files,
        "hf": QATask.from_hf,
    }
    if name not in builders:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(builders)}")
    return builders[name](**kwargs)
