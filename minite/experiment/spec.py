"""An experiment file: a base `minite train` config, overrides for every arm, the arms, the seeds.

    description = "what the experiment asks"
    config = "../gpu_arith.toml"         # relative to this file; "" = the embedded default
    seeds = [0, 1, 2]
    overrides = ["rl.steps=200"]         # every arm
    [arms.aligned]
    label = "aligned / aligned"
    overrides = []
    [arms.naive]
    label = "te learner / vllm sampler"
    overrides = ["recipe.name=te", "sampler.recipe=vllm"]

Overrides are `minite train`'s dotted overrides without the leading dashes. Every arm's config is
resolved when the file is loaded, so a bad key fails before anything runs, naming the arm.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from minite.config import ConfigError, TrainConfig, load_config

KEYS = ("description", "config", "seeds", "overrides", "arms")


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class Experiment:
    name: str
    config: Path | None  # None: the embedded default
    seeds: tuple[int, ...]
    arms: tuple[Arm, ...]
    overrides: tuple[str, ...] = ()
    description: str = ""
    configs: dict = field(default_factory=dict, compare=False)  # arm name -> TrainConfig (seed 0)

    def arm_overrides(self, arm: Arm, seed: int) -> list[str]:
        return [f"--{o}" for o in (*self.overrides, *arm.overrides)] + [f"--seed={seed}"]

    def train_config(self, arm: Arm, seed: int) -> TrainConfig:
        return load_config(self.config, self.arm_overrides(arm, seed))


def load_experiment(path: str | Path, seeds: list[int] | None = None, extra: list[str] = (),
                    arms: list[str] | None = None) -> Experiment:
    """Read an experiment file; `seeds`, `extra` overrides (every arm) and an `arms` subset replace or
    extend the file's."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file {path} does not exist")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = set(data) - set(KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}; an experiment has {list(KEYS)}")
    table = data.get("arms")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{path}: needs at least one [arms.NAME] table")
    all_arms = []
    for name, arm in table.items():
        if not isinstance(arm, dict) or set(arm) - {"label", "overrides"}:
            raise ConfigError(f"{path}: arms.{name} takes `label` and `overrides` only")
        all_arms.append(Arm(name, str(arm.get("label", name)), tuple(_strings(arm.get("overrides", []),
                                                                               f"arms.{name}.overrides"))))
    if arms:
        missing = set(arms) - {a.name for a in all_arms}
        if missing:
            raise ConfigError(f"{path}: no arm {sorted(missing)}; it has {[a.name for a in all_arms]}")
        all_arms = [a for a in all_arms if a.name in arms]
    base = data.get("config", "")
    config = (path.parent / base).resolve() if base else None
    seed_list = tuple(seeds if seeds else data.get("seeds", [0]))
    if not seed_list or not all(isinstance(s, int) and s >= 0 for s in seed_list):
        raise ConfigError(f"{path}: seeds must be a non-empty list of integers >= 0, got {list(seed_list)}")
    exp = Experiment(path.stem, config, seed_list, tuple(all_arms),
                     tuple(_strings(data.get("overrides", []), "overrides")) + tuple(extra),
                     str(data.get("description", "")))
    for arm in exp.arms:
        try:
            exp.configs[arm.name] = exp.train_config(arm, exp.seeds[0])
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"{path}: arm {arm.name!r}: {e}") from None
    return exp


def _strings(value, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key} must be a list of strings like \"rl.lr=1e-5\", got {value!r}")
    return [v.removeprefix("--") for v in value]
