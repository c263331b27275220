"""Tasks: where prompts, gold answers and rewards come from; `make_task(name, **kwargs)` builds one.

The interface (`Example`, `Task`: examples by (split, index), deterministic, train and test disjoint)
is `tasks_base.py`, re-exported here. The tasks:

- generated tasks (`ArithmeticTask`, `CountdownTask` in `tasks_builtin.py`) assign every problem to a
  split by a hash of its canonical key (`split_of`), independent of the seed, then draw from each
  split's side (rejection sampling) - unbounded, `size(split)` is None;
- file and Hugging Face tasks (`QATask` in `tasks_files.py`) use the given test file/split, or hash
  the questions into a held-out fraction; train questions that also appear in test are dropped.

Names: "arithmetic", "countdown", "file" (local JSONL, JSON or parquet), "hf" (Hugging Face
`datasets`), or `module:Class` / `path/to/file.py:Class`: a `Task` subclass of one's own, built as
`Class(seed=seed, **args)` (or `Class(**args)` when it takes no `seed`).
"""

import inspect
from typing import Any

from minite.rl.reward_import import import_object
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
    if ":" in name:
        return _imported_task(name, kwargs)
    if name not in builders:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(builders)} or module:Class")
    return builders[name](**kwargs)


def _imported_task(spec: str, kwargs: dict) -> Task:
    cls = import_object(spec, "task", "class")
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"task {spec!r} is not a subclass of minite.rl.tasks.Task")
    params = inspect.signature(cls).parameters
    if "seed" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k != "seed"}
    return cls(**kwargs)
