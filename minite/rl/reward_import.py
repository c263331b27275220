"""Rewards given by import path: `--task.reward=module:function` (several: comma-separated, weighted
by `task.reward_weights`, as TRL's `reward_funcs` / `reward_weights`); `import_object` also finds a
task class for `--task.name=module:Class` (`minite.rl.tasks.make_task`).

A reward is `function(completion: str, example: Example) -> float`: `example.prompt`,
`example.answer` and, for file and Hugging Face tasks, the record's own fields in `example.meta`.
`module` is a dotted module name importable from the working directory (the current folder is on
the path) or a path to a `.py` file (`rewards/my_reward.py:score`).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from minite.rl.tasks_base import Example

RewardFn = Callable[[str, Example], float]


def import_object(spec: str, what: str = "reward", kind: str = "function"):
    """The callable a `module:name` (or `path/to/file.py:name`) names; errors say `what` it was for."""
    module_name, sep, attr = spec.strip().rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must look like module:{kind} or path/to/file.py:{kind}")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{what} {spec!r}: file {path} does not exist")
        loader_spec = importlib.util.spec_from_file_location(f"minite_{what}_{path.stem}", path)
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({e})") from None
    obj = getattr(module, attr, None)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {module_name!r} has no {kind} {attr!r}")
    return obj


def load_reward(spec: str) -> RewardFn:
    """The function a `module:function` (or `path/to/file.py:function`) names."""
    return import_object(spec, "reward", "function")


class WeightedRewards:
    """The weighted sum of several rewards; each must return a finite number."""

    def __init__(self, specs: list[str], weights: list[float] | None = None):
        if not specs:
            raise ValueError("no reward given")
        weights = [1.0] * len(specs) if not weights else [float(w) for w in weights]
        if len(weights) != len(specs):
            raise ValueError(f"reward_weights has {len(weights)} weights for {len(specs)} rewards")
        self.specs, self.weights = specs, weights
        self.fns = [load_reward(s) for s in specs]

    def __call__(self, completion: str, example: Example) -> float:
        total = 0.0
        for spec, fn, w in zip(self.specs, self.fns, self.weights):
            value = fn(completion, example)
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"reward {spec!r} returned {value!r}, not a number") from None
            if value != value or value in (float("inf"), float("-inf")):
                raise ValueError(f"reward {spec!r} returned {value} for completion {completion[:60]!r}")
            total += w * value
        return total


def parse_specs(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]
