"""Run configuration of `minite train`: frozen dataclasses, TOML presets and dotted overrides.

A `TrainConfig` is built from a nested dict (a TOML file from `configs/`, or nothing: the embedded
default, identical to `configs/tiny_cpu.toml`) and overrides `"rl.lr=1e-6"`, whose values are read as
TOML literals (`1e-6`, `true`, `[2, 3]`, `"text"`; a bare word is a string). Every section is a
frozen dataclass; the loss, correction (TRIAGE included), and advantage sections *are* the configs of
`minite.rl` (`rl.loss.eps_high`, `rl.correction.name`, `rl.correction.triage.beta`). Unknown keys,
values of the wrong type and values a section rejects raise `ConfigError` naming the dotted key.
`to_toml(cfg)` writes the resolved config back (what `--dry-run` prints and a run folder keeps).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minite.models.config import ModelConfig
from minite.models.presets import MODEL_PRESETS
from minite.recipe import Recipe, get_recipe
from minite.rl.advantages import AdvantageConfig
from minite.rl.corrections import CorrectionConfig
from minite.rl.losses import LossConfig
from minite.rl.lr_schedule import SCHEDULES

DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config key that does not exist, or a value that is not allowed for its key."""


@dataclass(frozen=True)
class ModelSection:
    """An HF model directory `path` (its weights, tokenizer, chat template and generation_config), or,
    when `path` is empty, a randomly initialized `preset` of `minite.models.presets` with `config`
    overriding `ModelConfig` fields (`hidden_size = 256`). `tokenizer`: empty for the model
    directory's own (the char tokenizer for a preset), `"char"`, or another tokenizer's directory."""

    preset: str = "tiny-char"
    path: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    init_std: float = 0.02

    def __post_init__(self):
        if not self.path and self.preset not in MODEL_PRESETS:
            raise ValueError(f"preset={self.preset!r} is not a model preset; choose one of "
                             f"{sorted(MODEL_PRESETS)} or set path")
        if self.path and self.config:
            raise ValueError("config shapes a preset; a model loaded from path keeps its config.json")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; choose one of {list(DTYPES)}")

    def tokenizer_source(self) -> str:
        """What `minite.rl.tokenizer.load_tokenizer` gets: "char" or a directory."""
        return self.tokenizer or self.path or "char"

    def model_config(self) -> ModelConfig:
        """The preset's `ModelConfig` with `config` applied (only for presets)."""
        return MODEL_PRESETS[self.preset](**self.config)


@dataclass(frozen=True)
class RecipeSection:
    """A named recipe of `minite.recipe` and field overrides (e.g. `execution = {backend = "triton"}`)."""

    name: str = "aligned"
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSection:
    """`minite.rl.tasks.make_task(name, seed=seed, **args)`; `args` belong to the task `name` (set both
    when switching tasks: `--task.name=countdown --task.args={}`). `reward`: empty for the task's own
    reward, or `module:function` (several comma-separated, summed with `reward_weights`), called as
    `function(completion, example) -> float` (`minite.rl.reward_import`); `name` may also be
    `module:Class` (a `minite.rl.tasks.Task` of one's own, built with `args`). `chat_template`: a
    tokenizer with a chat template gets each prompt as a user turn (after `system_prompt` when one is
    given), the generation prompt added and `chat_template_kwargs` passed (`{enable_thinking = false}`);
    false, or a tokenizer without one, encodes the prompt text as it is."""

    name: str = "arithmetic"
    seed: int = 0
    args: dict[str, Any] = field(default_factory=lambda: {"operands": [2, 4]})
    reward: str = ""
    reward_weights: list = field(default_factory=list)
    chat_template: bool = True
    system_prompt: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SamplingSection:
    """Rollout sampling. Generation stops at `max_tokens`, at the tokenizer's eos or a stop id of the
    model's generation_config.json, or at the first of the `stop` strings (the response then ends
    with it; what was sampled after it is dropped)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 4
    stop: list = field(default_factory=list)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 for RL (greedy is for eval)")
        if not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_tokens < 1:
            raise ValueError("need 0 < top_p <= 1, top_k >= 0 and max_tokens >= 1")
        if not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a list of non-empty strings")


CALIBRATIONS = ("once", "every_sync")
ENGINES = ("aligned", "fast")


@dataclass(frozen=True)
class SamplerSection:
    """The rollout engine (`minite.sampler.Sampler`). `recipe` empty: the learner's recipe on the
    learner's own model object (one quantization per update, shared: the aligned deployment). A recipe
    name (with `recipe_overrides`): the sampler gets its own model under that recipe, fed the learner's
    weights after every update (weight sync; the sampler quantizes with its own chain), with static
    activation scales calibrated after the warm start (`calibration = "once"`) or after every sync
    (`"every_sync"`), as a separate inference engine is deployed (`te` learner + `vllm` sampler: the
    naive setting). Sizing: sequences decoded together, and the KV cache: `kv_cache_tokens` slots, or
    (0) the share `kv_memory_fraction` of free GPU memory (the learner needs the rest; runs sharing a
    GPU need a fixed size); `release_kv_cache`: give the KV cache back between rollouts, so the
    learner phase has that memory (re-made for the next rollout; its cost is logged as
    `time/kv_remake_s`). `engine = "fast"`: an unaligned bf16 sampler with its own model, as a
    serving engine computes (cuBLAS GEMMs, torch SDPA attention, rows that depend on their batch): the
    bf16 mismatch baseline; `"aligned"` (default): the learner's kernels and their bits."""

    engine: str = "aligned"
    recipe: str = ""
    recipe_overrides: dict[str, Any] = field(default_factory=dict)
    calibration: str = "once"
    max_num_seqs: int = 256
    kv_cache_tokens: int = 0
    kv_memory_fraction: float = 0.3
    release_kv_cache: bool = True

    def __post_init__(self):
        if self.max_num_seqs < 1 or not 0 < self.kv_memory_fraction < 1 or self.kv_cache_tokens < 0:
            raise ValueError("need max_num_seqs >= 1, kv_cache_tokens >= 0 and 0 < kv_memory_fraction < 1")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration={self.calibration!r}; choose one of {list(CALIBRATIONS)}")
        if self.recipe_overrides and not self.recipe:
            raise ValueError("recipe_overrides need a sampler recipe (empty: the learner's own model)")
        if self.engine not in ENGINES:
            raise ValueError(f"engine={self.engine!r}; choose one of {list(ENGINES)}")
        if self.engine == "fast" and self.recipe not in ("", "bf16"):
            raise ValueError(f"engine='fast' samples in bf16 (cuBLAS GEMMs, torch SDPA), not under recipe "
                             f"{self.recipe!r}; leave sampler.recipe empty or 'bf16'")

    def separate(self) -> bool:
        """Whether the sampler runs its own model (a recipe is named, or the fast engine)."""
        return bool(self.recipe) or self.engine == "fast"

    def own_recipe(self) -> Recipe | None:
        """The recipe of the sampler's own model (None: it runs the learner's): the fast engine's is
        bf16 with torch SDPA attention (`execution.attention = "sdpa"`)."""
        if not self.separate():
            return None
        recipe = get_recipe(self.recipe or "bf16", **self.recipe_overrides)
        return recipe.with_execution(attention="sdpa") if self.engine == "fast" else recipe


NONFINITE = ("stop", "skip", "warn")
DIVERGENCE = ("warn", "stop")


@dataclass(frozen=True)
class RLSection:
    """One RL step = `prompts` x `n` rollouts, then `minibatches` updates on them. `on_nonfinite`: what
    an inf or NaN loss or gradient (warm start included) does: `"stop"` the run with an error naming the
    step (its update not applied), `"skip"` the update with a warning, `"warn"` and train on (the
    optimizer still skips a non-finite gradient). Non-finite weights always stop the run.
    `on_divergence`: what a diverged run does (a warm start ending worse than a uniform guess, a
    reward stuck at 0): `"warn"` (in the log and summary.json) or `"stop"` with an error.
    `lr_schedule` over the RL steps (`minite.rl.lr_schedule`): "constant", "linear" or "cosine" decay
    to 0, after `lr_warmup_steps` of linear warm-up. The learner's forward and backward run on
    micro-batches of at most `micro_batch_tokens` packed tokens, with activation checkpointing
    (recompute each decoder layer in the backward) if asked."""

    steps: int = 150
    lr: float = 1e-4
    prompts: int = 32
    n: int = 8
    minibatches: int = 4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    loss: LossConfig = field(default_factory=LossConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    on_nonfinite: str = "stop"
    on_divergence: str = "warn"
    lr_schedule: str = "constant"
    lr_warmup_steps: int = 0
    micro_batch_tokens: int = 8192
    activation_checkpointing: bool = False

    def __post_init__(self):
        _positive(self, "steps", "prompts", "minibatches", "micro_batch_tokens")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule={self.lr_schedule!r}; choose one of {list(SCHEDULES)}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps={self.lr_warmup_steps} must be >= 0")
        if self.on_nonfinite not in NONFINITE:
            raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; choose one of {list(NONFINITE)}")
        if self.on_divergence not in DIVERGENCE:
            raise ValueError(f"on_divergence={self.on_divergence!r}; choose one of {list(DIVERGENCE)}")
        if self.n < 2:
            raise ValueError(f"n={self.n} must be >= 2 (advantages are normalized within a group)")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if (self.prompts * self.n) % self.minibatches:
            raise ValueError(f"minibatches={self.minibatches} must divide prompts * n "
                             f"= {self.prompts * self.n}")


@dataclass(frozen=True)
class WarmupSection:
    """Supervised warm start on `Example.solution` before RL (steps = 0 skips it)."""

    steps: int = 150
    lr: float = 3e-3
    batch_size: int = 64

    def __post_init__(self):
        if self.steps < 0 or self.batch_size < 1 or not self.lr > 0:
            raise ValueError("need steps >= 0, batch_size >= 1 and lr > 0")


@dataclass(frozen=True)
class LoggingSection:
    """Every record goes to metrics.jsonl; also to TensorBoard (`tensorboard/` in the run folder) and,
    with `wandb = true` (`pip install wandb`), to Weights & Biases project `wandb_project`."""

    progress: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "minite"


@dataclass(frozen=True)
class CheckpointSection:
    """Save every `every` RL steps (0: never), keeping the last `keep`. Whatever `every` says, the run
    folder's `final/` gets the trained model as a complete Hugging Face directory at the end."""

    every: int = 25
    keep: int = 2

    def __post_init__(self):
        if self.every < 0 or self.keep < 1:
            raise ValueError("need every >= 0 and keep >= 1")


@dataclass(frozen=True)
class EvalSection:
    """Held-out evaluation every `every` RL steps (0: only before and after RL) on `size` examples:
    greedy accuracy, and the mean reward of `samples` samples per example at the training temperature
    (0: none). `files`: evaluation sets apart from the task (JSONL / JSON / parquet question-answer
    files, read as `task.name = "file"` reads them), each scored the same way (greedy accuracy,
    pass@k, avg@k and maj@k over `samples` samples; `minite.rl.evaluation`) under
    `eval/<file stem>/...`, with the task's reward (or `task.reward`)."""

    every: int = 25
    size: int = 256
    samples: int = 4
    files: list = field(default_factory=list)

    def __post_init__(self):
        if self.every < 0 or self.size < 1 or self.samples < 0:
            raise ValueError("need every >= 0, size >= 1 and samples >= 0")
        if not all(isinstance(f, str) and f for f in self.files):
            raise ValueError(f"files={self.files!r} must be a list of file paths")


@dataclass(frozen=True)
class TrainConfig:
    model: ModelSection = field(default_factory=ModelSection)
    recipe: RecipeSection = field(default_factory=RecipeSection)
    task: TaskSection = field(default_factory=TaskSection)
    sampling: SamplingSection = field(default_factory=SamplingSection)
    sampler: SamplerSection = field(default_factory=SamplerSection)
    rl: RLSection = field(default_factory=RLSection)
    warmup: WarmupSection = field(default_factory=WarmupSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    run_dir: str = ""
    seed: int = 0
    threads: int = 1  # torch CPU threads (0: torch's default); 1 resists contention on a shared CPU


def _positive(obj, *names: str) -> None:
    for name in names:
        if getattr(obj, name) < 1:
            raise ValueError(f"{name}={getattr(obj, name)} must be >= 1")


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """An instance of dataclass `cls` from a nested dict, checking keys and value types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {prefix}{key!s}; {prefix.rstrip('.') or 'the config'} "
                              f"has {names}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def _coerce(tp, value, key: str):
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key + ".")
    if typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a table")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise ConfigError(f"{key}={value!r} must be of type {tp.__name__}")
    return value


def parse_value(text: str):
    """A TOML literal (`1e-6`, `true`, `[1, 2]`, `"s"`, `{a = 1}`); anything else is a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """A copy of nested dict `data` with each `"a.b.c=value"` set (tables are created as needed)."""
    out = _deepcopy(data)
    for item in overrides:
        key, sep, text = item.removeprefix("--").partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        node = out
        *parents, leaf = key.split(".")
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parents[:i + 1])} is a value, not a table (override {item!r})")
            node = child
        node[leaf] = parse_value(text)
    return out


def to_dict(obj) -> dict:
    """The nested dict of a config dataclass (tuples become lists)."""
    def plain(v):
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(obj)


# A model loaded from model.path is a pretrained one: these replace the char model's defaults
# (warm start, learning rates, response length) wherever the file and the overrides leave them unset.
PRETRAINED_DEFAULTS = {"warmup.steps": 0, "warmup.lr": 1e-5, "rl.lr": 1e-6, "sampling.max_tokens": 1024}


def _given(data: dict, key: str) -> bool:
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def char_defaults_in_use(cfg: TrainConfig) -> list[str]:
    """The `key = value` settings of `cfg` that are the char model's defaults where
    `PRETRAINED_DEFAULTS` differ (what a real tokenizer's run should not keep unawares)."""
    default = to_dict(TrainConfig())
    current = to_dict(cfg)
    out = []
    for key in PRETRAINED_DEFAULTS:
        if key.startswith("warmup.") and key != "warmup.steps" and not cfg.warmup.steps:
            continue
        section, leaf = key.split(".")
        if current[section][leaf] == default[section][leaf]:
            out.append(f"{key} = {current[section][leaf]}")
    return out


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The config of a TOML file (None: the embedded default) with dotted overrides applied on top of
    the resolved file (so `--model.config.hidden_size=256` keeps the file's other model.config keys).
    With `model.path` set, `PRETRAINED_DEFAULTS` fill the keys neither the file nor an override sets."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: {e}") from None
    cfg = build(TrainConfig, data)
    if overrides:
        cfg = build(TrainConfig, apply_overrides(to_dict(cfg), list(overrides)))
    given = apply_overrides(data, list(overrides))
    if cfg.model.path:
        pretrained = [f"{k}={_literal(v)}" for k, v in PRETRAINED_DEFAULTS.items() if not _given(given, k)]
        if pretrained:
            cfg = build(TrainConfig, apply_overrides(to_dict(cfg), pretrained))
    check(cfg)
    return cfg


def check(cfg: TrainConfig) -> None:
    """Check the free-form tables (model.config, recipe.overrides, task.args) by building what they
    describe; errors name the table."""
    from minite.rl.tasks import make_task

    attempts = [("recipe", lambda: get_recipe(cfg.recipe.name, **cfg.recipe.overrides)),
                ("sampler.recipe", lambda: cfg.sampler.recipe and get_recipe(cfg.sampler.recipe,
                                                                             **cfg.sampler.recipe_overrides)),
                ("task.args", lambda: make_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.args)),
                ("task.reward", lambda: task_reward(cfg)),
                ("logging.wandb", lambda: cfg.logging.wandb and _needs_package("wandb"))]
    if not cfg.model.path:
        attempts.append(("model.config", cfg.model.model_config))
    for where, attempt in attempts:
        try:
            attempt()
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {e}") from None


def _needs_package(name: str) -> None:
    import importlib.util

    if importlib.util.find_spec(name) is None:
        raise ValueError(f"true needs the {name} package: pip install {name}")


def loss_normalizer(cfg: TrainConfig) -> int:
    """Dr. GRPO's constant: `rl.loss.normalizer`, or (0) the generation budget `sampling.max_tokens`."""
    return cfg.rl.loss.normalizer or cfg.sampling.max_tokens


def task_reward(cfg: TrainConfig):
    """The reward `task.reward` names (None: the task's own)."""
    from minite.rl.reward_import import WeightedRewards, parse_specs

    if not cfg.task.reward:
        if cfg.task.reward_weights:
            raise ValueError("reward_weights need task.reward")
        return None
    return WeightedRewards(parse_specs(cfg.task.reward), list(cfg.task.reward_weights))


def to_toml(cfg) -> str:
    """TOML text of a config; `load_config` of it gives the same config back."""
    lines: list[str] = []
    _write_table(to_dict(cfg), [], lines)
    return "\n".join(lines).strip() + "\n"


def _write_table(table: dict, path: list[str], lines: list[str]) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in table.items() if isinstance(v, dict)}
    if path and (scalars or not tables):
        lines.append(f"\n[{'.'.join(path)}]")
    lines.extend(f"{k} = {_literal(v)}" for k, v in scalars.items())
    for k, v in tables.items():
        _write_table(v, path + [k], lines)


def _literal(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_literal(x) for x in v) + "]"
    if v is None:
        raise ConfigError("TOML has no null; a None-valued key cannot be written")
    raise ConfigError(f"cannot write {v!r} to TOML")


def _deepcopy(data):
    return {k: _deepcopy(v) for k, v in data.items()} if isinstance(data, dict) else data
