"""The RL training loop of `minite train` (docs/ARCHITECTURE.md, "Data flow of one RL step").

One RL step on `rl.prompts` training prompts:

1. the sampler draws `rl.n` responses per prompt from the model's current quantized weights, with the
   sampling seed `seed * 1_000_003 + step` (counter-based RNG: a resumed run draws the same tokens);
2. the task scores them; rewards -> group-normalized advantages (`rl.advantage`);
3. the learner recomputes log pi_theta_old of the sampled tokens (same temperature / truncation);
   the mismatch metrics compare them with the sampler's log mu;
4. the correction (`rl.correction`: none, TIS, IcePop, ..., TRIAGE) is computed once on the whole
   rollout batch (its batch statistics need all of it) and sliced per minibatch;
5. the rollout batch is shuffled (seeded by the step) into `rl.minibatches` minibatches, one
   clipped policy-gradient update each (`rl.loss`); after each update the learner quantizes the
   weights once, and the sampler, running the same model object, uses them for the next rollout;
6. a sampler with its own recipe (`sampler.recipe`, the naive deployment) has its own model instead:
   after the step's updates the learner's weights are copied into it and quantized with its chain
   (`time/weight_sync_s`), its static activation scales calibrated after the warm start
   (`sampler.calibration = "once"`) or after every sync (`"every_sync"`).

Before RL, `warmup.steps` supervised steps on the task's worked solutions (`Example.solution` + eos)
give a tiny randomly initialized model a policy worth reinforcing. A recipe with static activation
scales (e.g. `vllm`) is calibrated on training examples before the warm start and again after it
(the weights moved); the scales then stay fixed through RL, as in a deployment with calibrated
scales, and travel with every checkpoint. With `rl.loss.kl_coef > 0` the
loss adds k3 KL to a frozen reference: the model as RL starts (after the warm start), saved with
every checkpoint. Held-out greedy accuracy is measured after the warm start, every `eval.every`
steps and at the end (and the `eval.files` sets, `minite.rl.evaluation`); checkpoints every
`checkpoint.every` steps (`minite.rl.checkpointing`); metrics and report go to the run folder, and the
trained model, as a complete Hugging Face directory, to `final/` (`minite.rl.hf_export`).

A model directory (`model.path`) brings its own tokenizer, chat template and generation_config stop
ids (`minite.rl.prompts`); the run's checkpoints and `final/` carry them on.

Reliability (module `minite.rl.run_folder` owns the folder):
- the run folder is locked by one process; a folder that already holds a run is refused unless
  resumed; a run that fails before its first record leaves no folder it created behind;
- resuming falls back to the previous checkpoint when the latest does not load
  (`minite.rl.checkpointing.load_latest_checkpoint`);
- Ctrl-C stops at the next step boundary, saves a checkpoint (when `checkpoint.every` > 0) and raises
  `Interrupted`, whose text says how to resume; a second Ctrl-C stops at once;
- a non-finite loss or gradient stops the run, skips the update or is warned about
  (`rl.on_nonfinite`); non-finite weights always stop it (nothing trains on from them);
- divergence is warned about (or, with `rl.on_divergence = "stop"`, stops the run): a warm start
  whose last nll is above ln(vocab_size) (worse than a uniform guess), or a reward of 0 at
  `ZERO_REWARD_STEPS` consecutive RL steps (no learning signal);
  warnings go to stderr and to summary.json's `warnings`, and travel with the checkpoints;
- `wall_seconds` adds up the time of every process that trained the run (kept in the checkpoint).
"""

from __future__ import annotations

import copy
import math
import random
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from minite.config import TrainConfig, char_defaults_in_use, loss_normalizer, task_reward, to_dict, to_toml
from minite.devices import check_device
from minite.diagnostics.metrics import mismatch_metrics
from minite.learner import Learner, SequenceBatch, sequence_logprobs
from minite.learner.weight_sync import sync_sampler_model
from minite.models import Qwen3, load_pretrained
from minite.models.checkpoint import read_config
from minite.models.sampler_model import build_sampler_model, state_fill
from minite.nn.calibrate import (
    calibrate,
    calibrate_through,
    load_static_scales,
    static_scales,
    uses_static_scales,
)
from minite.nn.sampler_weights import is_sampler_only
from minite.recipe import get_recipe
from minite.rl.advantages import advantage_metrics, group_advantages
from minite.rl.batch import RLBatch, masked_mean
from minite.rl.checkpointing import latest_checkpoint, load_latest_checkpoint, save_checkpoint, set_rng_state
from minite.rl.corrections import apply_correction
from minite.rl.evaluation import evaluate_examples, read_eval_file
from minite.rl.hf_export import save_hf_directory, write_hf_extras
from minite.rl.losses import policy_loss
from minite.rl.lr_schedule import lr_at
from minite.rl.phase_memory import PhaseMemory
from minite.rl.prompts import PromptFormat, cut_at_stop_strings, stop_token_ids
from minite.rl.run_folder import RunFolder, existing_run_files
from minite.rl.run_logging import SUMMARY_FILE, MetricsLog, Progress, write_report
from minite.rl.sharded_run import ShardedRun, SilentLog
from minite.rl.tasks import make_task
from minite.rl.tokenizer import CharTokenizer, load_tokenizer
from minite.rl.triage import TriageConfig, triage
from minite.sampling import SamplingParams

ZERO_REWARD_STEPS = 10  # consecutive RL steps at reward 0 that are reported as "no learning signal"

MISMATCH_KEYS = ("kl", "k3_kl", "chi2_token", "ess", "logprob_abs_diff_mean", "logprob_abs_diff_max",
                 "logprob_abs_diff_p99", "bitwise_equal_frac", "prob_abs_diff_mean")


def default_sampler(model, cfg: TrainConfig):
    from minite.sampler import Sampler

    s = cfg.sampler
    return Sampler(model, max_num_seqs=s.max_num_seqs, kv_cache_tokens=s.kv_cache_tokens or None,
                   kv_memory_fraction=s.kv_memory_fraction)


def sft_loss(batch: RLBatch) -> tuple[torch.Tensor, dict]:
    """Mean negative log-likelihood of the response tokens (the supervised warm start)."""
    nll = -batch.masked(batch.logprobs).sum() / batch.mask.sum().clamp(min=1)
    return nll, {"sft/nll": nll.detach()}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; the text says what was saved and how to go on."""


class DivergenceError(ValueError):
    """The run diverged and `rl.on_divergence` says stop."""


class NonFiniteError(ValueError):
    """A loss, gradient or weight is inf or NaN (and `rl.on_nonfinite` says stop, or weights are hit)."""


def nonfinite_parameter(model: torch.nn.Module) -> str | None:
    """The name of the first parameter holding inf or NaN, or None (one host sync when all are finite)."""
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    if bool(torch.stack([n.float() for n in torch._foreach_norm([p for _, p in params])]).isfinite().all()):
        return None
    # a finite tensor's norm can still overflow: look at the values themselves
    return next((name for name, p in params if not bool(torch.isfinite(p).all())), None)


def skip_nonfinite(loss_fn):
    """`loss_fn` whose non-finite loss turns the gradient into NaN, so the optimizer skips the update
    (it skips non-finite gradients) without a host sync."""
    def guarded(*args, **kwargs):
        loss, metrics = loss_fn(*args, **kwargs)
        scale = torch.ones_like(loss).masked_fill(~torch.isfinite(loss.detach()), math.nan)
        return loss * scale, metrics  # times exactly 1 when finite: the same bits, value and gradient
    return guarded


class Trainer:
    """`Trainer(cfg, run_dir).run()`; with `resume=True` it continues from the run's latest checkpoint.
    `make_sampler(model, cfg)` builds the rollout engine on the model it samples with: the learner's
    model object, or the sampler's own (`sampler.recipe`). The run folder stays locked from here until
    `run()` returns or raises (or `close()`)."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path | None = None, resume: bool = False,
                 make_sampler=default_sampler, progress_stream=None):
        check_device(cfg.model.device, "--model.device")  # before the run folder or any model is made
        self.cfg = cfg
        # across processes (torchrun): rank 0 writes the run folder and logs (minite.rl.sharded_run)
        self.dist = ShardedRun.start(cfg, run_dir, resume)
        self.is_main = self.dist is None or self.dist.main
        self.progress = Progress(cfg.rl.steps, cfg.logging.progress and self.is_main, progress_stream)
        self.warnings: list[str] = []
        path = run_dir or cfg.run_dir or None
        self.folder = RunFolder.open(path) if self.dist is None else self.dist.open_folder(path)
        self.run_dir = self.folder.path
        self.ckpt_dir = self.run_dir / "checkpoints"
        if self.folder.warning:
            self.warn(self.folder.warning, keep=False)
        try:
            self._open(resume, make_sampler)
        except BaseException:
            self.folder.close(failed=True)
            raise

    def _open(self, resume: bool, make_sampler) -> None:
        cfg = self.cfg
        ckpt = latest_checkpoint(self.ckpt_dir)
        if self.is_main:
            self._check_folder(ckpt, resume)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        for seed_fn in (torch.manual_seed, random.seed, np.random.seed):
            seed_fn(cfg.seed)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_source())
        self.prompt_format = PromptFormat(cfg.task.chat_template, cfg.task.system_prompt,
                                          dict(cfg.task.chat_template_kwargs))
        self._stop_ids = stop_token_ids(self.tokenizer, cfg.model.path)
        if not isinstance(self.tokenizer, CharTokenizer) and char_defaults_in_use(cfg):
            self.warn(f"the char model's defaults meet a {self.tokenizer.vocab_size}-token tokenizer: "
                      f"{', '.join(char_defaults_in_use(cfg))}; set them for this model", keep=False)
        self.task = make_task(cfg.task.name, seed=cfg.task.seed, **cfg.task.args)
        if not self.task.heldout(1):
            raise ValueError(f"task {cfg.task.name!r} has no held-out examples to evaluate on: give the file "
                             "task a test_path (task.args.test_path) or a larger heldout_fraction")
        self._check_task_size()
        self._custom_reward = reward = task_reward(cfg)
        if reward is not None:
            self.task.reward = reward  # the reward given by import path replaces the task's own
        self._eval_sets = {Path(f).stem: read_eval_file(f, reward=cfg.task.args.get("reward", "exact"))
                           for f in cfg.eval.files}
        self.recipe = get_recipe(cfg.recipe.name, **cfg.recipe.overrides)
        self.sampler_recipe = cfg.sampler.own_recipe()
        self.dtype = getattr(torch, cfg.model.dtype)
        loaded = None
        self.ref_model = None
        if ckpt is not None and self.dist is None:
            loaded = load_latest_checkpoint(self.ckpt_dir, self.recipe, self.dtype, cfg.model.device,
                                            warn=self.warn)
        if loaded is not None:
            ckpt, models, state = loaded
            self.model, self.ref_model = models["model"], models.get("ref_model")
        else:
            state = None
            self.model = self._fresh_model()
        if self.dist is not None:
            self.model = self.dist.shard(self.model)
            self.progress.message(self.dist.describe())
            loaded = self.dist.load_checkpoint(self.ckpt_dir, self.warn) if ckpt is not None else None
            if loaded is not None:
                ckpt, state = loaded
        self.sampler_model = self._sampler_model()
        self.sampler = make_sampler(self.sampler_model, cfg)
        self.step, self.data_pos = 0, cfg.warmup.steps * cfg.warmup.batch_size
        self.wall_before = 0.0  # seconds the processes before this one trained the run
        self.zero_reward_steps = 0
        self._run_start = None
        self._stop_requested = False
        self._saved_step = None
        self.log = (MetricsLog(self.run_dir, cfg.logging.tensorboard,
                               cfg.logging.wandb_project if cfg.logging.wandb else None, to_dict(cfg))
                    if self.is_main else SilentLog())
        self.needs_warmup = state is None
        self.learner = None
        self._heldout = None
        if state is None:
            if resume:
                self.progress.message(f"{self.run_dir} holds no checkpoint yet: the run starts over")
            # a resumed run killed before its first checkpoint starts over
            if self.is_main:
                self.log.path.unlink(missing_ok=True)
        else:
            self._restore(state)
            self.progress.message(f"resumed {ckpt} (step {self.step})")
        if self.is_main:
            (self.run_dir / "config.toml").write_text(to_toml(cfg))

    def _check_task_size(self) -> None:
        """A finite train split smaller than one step's prompts repeats examples within a step."""
        size = self.task.size("train")
        if size is not None and size < self.cfg.rl.prompts:
            self.warn(f"task {self.cfg.task.name!r} has {size} training examples, fewer than rl.prompts = "
                      f"{self.cfg.rl.prompts}: every step repeats some; lower rl.prompts or add data")

    def _check_folder(self, ckpt: Path | None, resume: bool) -> None:
        """Refuse to write a new run over an earlier one, and to resume one that cannot be."""
        if resume:
            if ckpt is None and (self.run_dir / SUMMARY_FILE).is_file():
                raise ValueError(f"{self.run_dir} holds a finished run without checkpoints "
                                 f"(checkpoint.every = 0): there is nothing to resume; start a new run in "
                                 f"another run_dir")
            return
        if ckpt is not None:
            raise ValueError(f"{self.run_dir} already holds a run (checkpoint {ckpt.name}); resume it with "
                             "--resume or choose another run_dir")
        files = existing_run_files(self.run_dir)
        if files:
            raise ValueError(f"{self.run_dir} already holds a run ({', '.join(files)}) and no checkpoint to "
                             f"resume it from; choose another run_dir, or delete those files to start over")

    def _restore(self, state: dict) -> None:
        self._make_learner()
        self.learner.load_state_dict(state["learner"])
        if self.dist is not None:
            self.sync_sampler()
        load_static_scales(self.model, state.get("static_scales", {}))
        if self.sampler_model is not self.model:
            load_static_scales(self.sampler_model, state.get("sampler_static_scales", {}))
        set_rng_state(state["rng"])
        self.step, self.data_pos = state["step"], state["data"]["position"]
        self.wall_before = state.get("wall_seconds", 0.0)
        self.zero_reward_steps = state.get("zero_reward_steps", 0)
        self._saved_step = self.step
        self.warnings = state.get("warnings", []) + self.warnings
        self.log.truncate_after(self.step)

    def warn(self, text: str, keep: bool = True) -> None:
        """A warning on stderr (also without progress output), kept for summary.json when `keep`."""
        if self.is_main:
            print(f"minite train: warning: {text}", file=sys.stderr, flush=True)
        if keep:
            self.warnings.append(text)

    def close(self) -> None:
        """Release the run folder (`run()` does it on its own)."""
        self.folder.close()

    def _fresh_model(self) -> Qwen3:
        m = self.cfg.model
        if m.path:
            # before the weights load (and long before the warm start): the tokenizer must fit the model
            self._check_model_vocab(read_config(m.path).vocab_size)
            return load_pretrained(m.path, recipe=self.recipe, dtype=self.dtype, device=m.device)
        config = m.model_config()
        vocab = self.tokenizer.vocab_size
        if "vocab_size" not in m.config and config.vocab_size != vocab:
            # random weights: the preset's vocabulary size means nothing, the tokenizer's does (a larger
            # one would let the sampler draw ids the tokenizer cannot decode)
            self.progress.message(f"model preset {m.preset!r}: vocab_size {config.vocab_size} -> {vocab} "
                                  f"(the {m.tokenizer!r} tokenizer's)")
            config = config.replace(vocab_size=vocab)
        if config.vocab_size < vocab:
            raise ValueError(f"model.config.vocab_size={config.vocab_size} is smaller than the tokenizer's "
                             f"{vocab} ids")
        if config.vocab_size > vocab:
            raise ValueError(f"model.config.vocab_size={config.vocab_size} is larger than the tokenizer's "
                             f"{vocab} ids: the sampler could draw ids the tokenizer cannot decode")
        model = Qwen3(config, self.recipe)
        model.init_weights(m.init_std, torch.Generator().manual_seed(self.cfg.seed))
        return model.to(device=m.device, dtype=self.dtype)

    def _check_model_vocab(self, model_vocab: int) -> None:
        """A Hugging Face model's embedding table may be padded past its tokenizer's ids, never short
        of them, and not by more than the tokenizer's own size (then the tokenizer is another model's)."""
        m, vocab = self.cfg.model, self.tokenizer.vocab_size
        which = f"the {m.tokenizer!r} tokenizer" if m.tokenizer else "its own tokenizer"
        if model_vocab < vocab:
            raise ValueError(f"{m.path}/config.json: vocab_size {model_vocab} is smaller than {which}'s "
                             f"{vocab} ids; use the model's own tokenizer (model.tokenizer = \"\")")
        if model_vocab >= 2 * vocab:
            raise ValueError(f"{m.path}/config.json: vocab_size {model_vocab} is far larger than {which}'s "
                             f"{vocab} ids (the sampler would draw ids it cannot decode); use the model's "
                             f"own tokenizer (model.tokenizer = \"\")")

    def _sampler_model(self):
        """The model the sampler runs: the learner's, or (a sampler recipe) its own, synced now."""
        if self.dist is not None:
            return self.dist.sampler_model(self.model, self.sampler_recipe or self.recipe)
        if self.sampler_recipe is None:
            return self.model
        # sampler-only (NVFP4 layers hold codes, scales and decode layout), made part by part
        model = build_sampler_model(self.model.config, self.sampler_recipe,
                                    state_fill(dict(self.model.named_parameters())),
                                    device=next(self.model.parameters()).device, dtype=self.dtype)
        engine = " (fast engine: cuBLAS, SDPA)" if self.cfg.sampler.engine == "fast" else ""
        self.progress.message(f"sampler: its own model under recipe {self.sampler_recipe.name!r}{engine}, "
                              f"learner under {self.recipe.name!r} (weights synced after every update)")
        return model

    def sync_sampler(self, calibrate: bool = False) -> float:
        """Feed the sampler's own model the learner's weights (quantized with the sampler's chain) and,
        if asked or `sampler.calibration == "every_sync"`, calibrate its static scales; seconds taken
        (0 when the sampler runs the learner's model)."""
        if self.sampler_model is self.model:
            return 0.0
        t0 = time.perf_counter()
        if self.dist is not None:
            self.dist.sync(self.model, self.sampler_model)
        else:
            sync_sampler_model(self.sampler_model, self.model)
        if calibrate or self.cfg.sampler.calibration == "every_sync":
            self.calibrate(self.sampler_model, quiet=not calibrate)
        if self.sampler_model.embed_tokens.weight.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _make_learner(self) -> None:
        rl = self.cfg.rl
        self.learner = self._new_learner(lr=rl.lr, weight_decay=rl.weight_decay,
                                         max_grad_norm=rl.max_grad_norm,
                                         micro_batch_tokens=rl.micro_batch_tokens,
                                         activation_checkpointing=rl.activation_checkpointing)

    def _new_learner(self, **kwargs) -> Learner:
        """A learner on the run's model: in this process, or sharded across the run's processes."""
        return Learner(self.model, **kwargs) if self.dist is None else self.dist.learner(self.model, **kwargs)

    def run(self) -> dict:
        """Warm start (fresh runs), RL steps up to `rl.steps` with eval and checkpoints, then the report.
        Releases the run folder at the end, also on an error (a folder this process created and wrote
        no record into is removed then)."""
        try:
            with self._ctrl_c():
                summary = self._run()
        except BaseException as e:
            self.log.close()
            self.folder.close(failed=not isinstance(e, KeyboardInterrupt))
            raise
        self.folder.close()
        if self.dist is not None:
            summary = self.dist.group.broadcast(summary)
        return summary

    def _run(self) -> dict:
        self._run_start = time.perf_counter()
        cfg = self.cfg
        self._check_weights("before training" if self.needs_warmup else f"in checkpoint step {self.step}")
        if self.needs_warmup:
            self.warmup()
            self._check_weights("after the warm start")
            self.sync_sampler(calibrate=True)
            self._make_learner()
            if cfg.rl.loss.kl_coef > 0:
                self.ref_model = copy.deepcopy(self.model).requires_grad_(False)
            self.evaluate()
            if cfg.checkpoint.every:
                self.save()
            self._stop_if_asked()
        while self.step < cfg.rl.steps:
            self.step += 1
            record = self.rl_step()
            if (cfg.eval.every and self.step % cfg.eval.every == 0) or self.step == cfg.rl.steps:
                record.update(self.evaluate())
            self.progress.update(self.step, record)
            if cfg.checkpoint.every and (self.step % cfg.checkpoint.every == 0 or self.step == cfg.rl.steps):
                self.save()
            self._stop_if_asked()
        self.log.close()
        if not self.is_main:
            return {}
        extra = {"wall_seconds": self.wall_seconds(), "run_dir": str(self.run_dir), "warnings": self.warnings,
                 "world_size": 1 if self.dist is None else self.dist.group.world_size}
        final = None
        if self.dist is None:  # a sharded run's weights are whole only in its checkpoints
            final = save_hf_directory(self.model, self.run_dir / "final", self.tokenizer, self._stop_ids,
                                      cfg.model.path)
            extra["final"] = str(final)
        summary = write_report(self.run_dir, extra)
        self.progress.message(f"report: {self.run_dir}/report.png, report.html, summary.json, metrics.jsonl"
                              + (f"; the trained model: {final}" if final else ""))
        return summary

    def wall_seconds(self) -> float:
        """Seconds spent training this run, by this process and the ones it resumed from."""
        return self.wall_before + (time.perf_counter() - self._run_start if self._run_start else 0.0)

    @contextmanager
    def _ctrl_c(self):
        """While training: Ctrl-C asks for a stop at the next step boundary, a second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set in the main thread
            return
        previous = signal.signal(signal.SIGINT, self._on_ctrl_c)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_ctrl_c(self, signum=None, frame=None) -> None:
        if self._stop_requested:
            raise Interrupted(f"interrupted during step {self.step} (second Ctrl-C); {self._resume_hint()}")
        self._stop_requested = True
        print("\nminite train: Ctrl-C: stopping after this step (Ctrl-C again to stop at once)",
              file=sys.stderr, flush=True)

    def _stop_if_asked(self) -> None:
        """At a step boundary after Ctrl-C: save (when checkpointing) and raise `Interrupted`."""
        if self.dist is not None:  # every rank stops at the same boundary
            self._stop_requested = self.dist.group.any(self._stop_requested)
        if not self._stop_requested:
            return
        if self.cfg.checkpoint.every and self.learner is not None:
            self.save()
        where = f"after step {self.step}" if self.learner is not None else "during the warm start"
        raise Interrupted(f"interrupted {where}; {self._resume_hint()}")

    def _resume_hint(self) -> str:
        ckpt = latest_checkpoint(self.ckpt_dir)
        if ckpt is not None:
            return f"checkpoint {ckpt.name} saved; resume with: minite train --resume {self.run_dir}"
        if not self.cfg.checkpoint.every:
            return "nothing was saved (checkpoint.every = 0): the run cannot be resumed"
        return f"no checkpoint yet: minite train --resume {self.run_dir} starts the run over"

    def save(self) -> None:
        state = {"learner": self.learner.state_dict(), "data": {"position": self.data_pos},
                 "config": to_dict(self.cfg), "static_scales": static_scales(self.model),
                 "wall_seconds": self.wall_seconds(), "warnings": list(self.warnings),
                 "zero_reward_steps": self.zero_reward_steps}
        if self.sampler_model is not self.model:
            state["sampler_static_scales"] = static_scales(self.sampler_model)
        models = {"model": self.model}
        if self.ref_model is not None:
            models["ref_model"] = self.ref_model
        if self._saved_step != self.step:  # Ctrl-C right after a scheduled save: it is there already
            keep = self.cfg.checkpoint.keep
            if self.dist is None:
                save_checkpoint(self.ckpt_dir, self.step, models, state, keep,
                                hf_extras=partial(write_hf_extras, tokenizer=self.tokenizer,
                                                  stop_ids=self._stop_ids, source_dir=self.cfg.model.path))
            else:
                self.dist.save_checkpoint(self.ckpt_dir, self.step, self.learner, state, keep)
            self._saved_step = self.step

    def _check_weights(self, when: str) -> None:
        """Non-finite weights stop the run whatever `rl.on_nonfinite` says: every later loss would be NaN."""
        name = (nonfinite_parameter(self.model) if self.dist is None
                else self.dist.nonfinite_parameter(self.model))
        if name is None:
            return
        source = self.cfg.model.path or "the model"
        raise NonFiniteError(f"{when}: {source} weight {name} holds inf or NaN; the run cannot train on from "
                             f"it: {self._after_nonfinite()}")

    def _after_nonfinite(self) -> str:
        ckpt = latest_checkpoint(self.ckpt_dir)
        if ckpt is None:
            return "check the model's weights and lower the learning rates (rl.lr, warmup.lr)"
        return (f"resume from the last checkpoint ({ckpt.name}) with a lower rl.lr: minite train --resume "
                f"{self.run_dir} --rl.lr=...")

    def _nonfinite(self, what: str) -> None:
        """A non-finite loss or gradient: stop, or warn (the update was skipped or applied)."""
        mode = self.cfg.rl.on_nonfinite
        if mode == "stop":
            raise NonFiniteError(f"{what}; stopped (rl.on_nonfinite = \"stop\"; \"skip\" skips such "
                                 f"updates): {self._after_nonfinite()}")
        done = ("the update was skipped" if mode == "skip" else "trained on (rl.on_nonfinite = \"warn\"; the "
                "optimizer still skips an update whose gradient is not finite)")
        self.warn(f"{what}; {done}")

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.prompt_format.encode(self.tokenizer, prompt)

    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def warmup(self) -> None:
        """Supervised steps on `Example.solution` + eos, with their own AdamW (not kept for RL) and a
        learning rate decaying linearly from `warmup.lr` to a tenth of it."""
        w = self.cfg.warmup
        self.calibrate()
        if not w.steps:
            return
        sft = self._new_learner(lr=w.lr, max_grad_norm=1.0)
        loss_fn = sft_loss if self.cfg.rl.on_nonfinite == "warn" else skip_nonfinite(sft_loss)
        t0 = time.perf_counter()
        for i in range(w.steps):
            self._stop_if_asked()
            sft.optimizer.lr = w.lr * (1 - 0.9 * i / max(w.steps - 1, 1))
            examples = self.task.batch("train", i * w.batch_size, w.batch_size)
            if any(ex.solution is None for ex in examples):
                raise ValueError(f"task {self.cfg.task.name!r} has no worked solutions; set warmup.steps = 0")
            prompts = [self.encode_prompt(ex.prompt) for ex in examples]
            targets = [self.tokenizer.encode(ex.solution, add_eos=True) for ex in examples]
            batch = SequenceBatch.from_samples(prompts, targets, advantages=torch.zeros(len(examples)))
            m = sft.step(batch, loss_fn)
            if not (math.isfinite(m["sft/nll"]) and math.isfinite(m["grad_norm"])):
                self._check_weights(f"warm start step {i + 1}")
                self._nonfinite(f"warm start step {i + 1}: nll {m['sft/nll']}, grad_norm {m['grad_norm']}")
            if (i + 1) % max(1, w.steps // 10) == 0 or i + 1 == w.steps:
                self.log.log({"kind": "warmup", "step": i + 1, "nll": m["sft/nll"],
                              "grad_norm": m["grad_norm"], "seconds": time.perf_counter() - t0})
                self.progress.message(f"warm start {i + 1}/{w.steps}: nll {m['sft/nll']:.3f}")
        self._check_warmup_nll(m["sft/nll"])
        self.calibrate()

    def _check_warmup_nll(self, nll: float) -> None:
        """A warm start ending worse than a uniform guess over the vocabulary has diverged."""
        uniform = math.log(self.model.config.vocab_size)
        if not nll <= uniform:  # NaN included
            self._diverged(f"the warm start diverged: its last nll {nll:.4g} is above ln(vocab_size) = "
                           f"{uniform:.3f} (a uniform guess); lower warmup.lr or raise warmup.steps")

    @torch.no_grad()
    def calibrate(self, model=None, size: int = 64, quiet: bool = False) -> None:
        """Static activation scales (recipes with `activation.scaling == "static"`) of `model` (the
        learner's by default) from its inputs on `size` training examples: prompt + worked solution
        where the task has one."""
        model = self.model if model is None else model
        if not uses_static_scales(model):
            return
        examples = self.task.batch("train", 0, size)
        seqs = [self.encode_prompt(ex.prompt) + self.tokenizer.encode(ex.solution or "", add_eos=True)
                for ex in examples]
        device = next(model.parameters()).device
        lens = [len(q) for q in seqs]
        ids = torch.tensor([sum(seqs, [])], device=device)
        cu = torch.tensor([0, *np.cumsum(lens).tolist()], device=device)
        # a sampler-only model calibrates on the learner's forward (the same weights, in full precision)
        through = is_sampler_only(model) and model is not self.model
        with calibrate_through(model, self.model) if through else calibrate(model):
            (self.model if through else model)(ids, cu_seqlens=cu)
        if not quiet:
            which = "the sampler's" if model is not self.model else "the"
            self.progress.message(f"calibrated {which} static activation scales on {size} training examples")

    @torch.no_grad()
    def evaluate(self) -> dict:
        """On `eval.size` held-out examples: greedy accuracy (reward >= 1) and mean reward, and the
        mean reward of `eval.samples` samples per example drawn as in training (fixed seed)."""
        if self._heldout is None:
            self._heldout = self.task.heldout(self.cfg.eval.size)
        examples, s = self._heldout, self.cfg.sampling
        prompts = [self.encode_prompt(ex.prompt) for ex in examples]
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=s.max_tokens, stop_token_ids=self.stop_ids())
        rewards = self._rewards(examples, self._generate(prompts, greedy))
        metrics = {"eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
                   "eval/reward": sum(rewards) / len(rewards), "eval/size": len(rewards)}
        if self.cfg.eval.samples:
            sampled = SamplingParams(n=self.cfg.eval.samples, temperature=s.temperature, top_p=s.top_p,
                                     top_k=s.top_k, max_tokens=s.max_tokens, stop_token_ids=self.stop_ids(),
                                     seed=(1 << 40) + self.cfg.seed)
            rewards = self._rewards(examples, self._generate(prompts, sampled))
            metrics["eval/sampled_reward"] = sum(rewards) / len(rewards)
        for name, (examples, file_task) in self._eval_sets.items():
            reward = self._custom_reward or file_task.reward
            scored = evaluate_examples(self.sampler, self.tokenizer, examples[:self.cfg.eval.size], reward,
                                       n=self.cfg.eval.samples, max_tokens=s.max_tokens,
                                       stop_token_ids=self.stop_ids(), prompt_format=self.prompt_format,
                                       stop=list(s.stop), temperature=s.temperature, top_p=s.top_p,
                                       top_k=s.top_k, seed=(1 << 40) + self.cfg.seed)
            metrics.update({f"eval/{name}/{k}": v for k, v in scored.items()})
        self.log.log({"kind": "eval", "step": self.step, **metrics})
        if self.step == 0:
            self.progress.message(f"held-out greedy accuracy before RL: {metrics['eval/accuracy']:.3f}")
        return metrics

    def _rewards(self, examples: list, outs: list) -> list[float]:
        return [self.task.reward(self.tokenizer.decode(smp.token_ids), ex)
                for ex, o in zip(examples, outs) for smp in o.samples]

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list:
        """The sampler's outputs in prompt order (a sharded run: each rank its share of the prompts), each
        response cut after a `sampling.stop` string."""
        if self.dist is not None:
            outs = self.dist.generate(self.sampler, prompts, params)
        else:
            outs = sorted(self.sampler.generate(prompts, params), key=lambda o: o.index)
        if self.cfg.sampler.release_kv_cache:
            self.sampler.release()
        stops = list(self.cfg.sampling.stop)
        for o in outs:
            o.samples = [cut_at_stop_strings(smp, self.tokenizer, stops) for smp in o.samples]
        return outs

    def rl_step(self) -> dict:
        cfg, rl, s = self.cfg, self.cfg.rl, self.cfg.sampling
        t0 = time.perf_counter()
        memory = PhaseMemory(self.model.embed_tokens.weight.device)
        remake_s = self.sampler.stats["kv_remake_s"]
        examples = self.task.batch("train", self.data_pos, rl.prompts)
        prompts = [self.encode_prompt(ex.prompt) for ex in examples]
        seed = cfg.seed * 1_000_003 + self.step
        params = SamplingParams(n=rl.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                max_tokens=s.max_tokens, stop_token_ids=self.stop_ids(), seed=seed)
        samples = [(ex, p, smp) for ex, p, o in zip(examples, prompts, self._generate(prompts, params))
                   for smp in o.samples]
        t_rollout = time.perf_counter() - t0
        memory.end("rollout")
        rewards = torch.tensor([self.task.reward(self.tokenizer.decode(smp.token_ids), ex)
                                for ex, _, smp in samples])
        advantages = group_advantages(rewards, rl.n, rl.advantage)
        self.learner.optimizer.lr = lr_at(self.step, rl.steps, rl.lr, rl.lr_schedule, rl.lr_warmup_steps)
        batch = SequenceBatch.from_samples([p for _, p, _ in samples], [smp.token_ids for *_, smp in samples],
                                           [smp.logprobs for *_, smp in samples], advantages, params)
        old = self.learner.logprobs(batch)
        batch, outside = drop_unsupported(replace(batch, old_logprobs=old))
        if self.ref_model is not None:
            with torch.no_grad():
                batch = replace(batch, ref_logprobs=sequence_logprobs(self.ref_model, batch))
        mask = batch.mask(old.device)
        rl_batch = batch.to_rl_batch(old)
        correction = apply_correction(rl_batch, rl.correction)
        direction = correction.metrics if rl.correction.name == "triage" else diagnose_direction(
            rl_batch, rl.correction.triage)
        mismatch = mismatch_metrics(old, batch.sampler_logprobs.to(old.device), mask)
        t_update = time.perf_counter()
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed))
        loss_fn = partial(policy_loss, cfg=replace(rl.loss, normalizer=loss_normalizer(cfg)))
        if rl.on_nonfinite != "warn":
            loss_fn = skip_nonfinite(loss_fn)
        updates = [self._update(batch.rows(rows.tolist()), loss_fn, correction.rows(rows))
                   for rows in order.chunk(rl.minibatches)]
        self.data_pos += rl.prompts
        now = time.perf_counter()
        t_sync = self.sync_sampler()
        memory.end("learner")
        generated = int(mask.sum())
        record = {"kind": "rl", "step": self.step, "reward": rewards.mean().item(),
                  "reward_std": rewards.std().item(), "response_len": generated / len(samples),
                  "stop_frac": sum(smp.finish_reason == "stop" for *_, smp in samples) / len(samples),
                  **{k: float(v) for k, v in advantage_metrics(rewards, rl.n).items()},
                  **{f"mismatch/{k}": mismatch[k] for k in MISMATCH_KEYS},
                  **{k: float(v) for k, v in correction.metrics.items()},
                  **{k: float(v) for k, v in direction.items() if k.startswith("triage/")},
                  "mismatch/gap_mean": float(masked_mean(old - batch.sampler_logprobs.to(old.device), mask)),
                  # -log mu of the sampled tokens: a one-sample estimate of the sampling entropy per token
                  "rollout/entropy": float(masked_mean(-batch.sampler_logprobs.to(old.device), mask)),
                  "mismatch/outside_learner_support": outside,
                  **_mean_dicts(updates),
                  "rollout/tokens_per_s": generated / max(t_rollout, 1e-9),
                  "learner/tokens_per_s": sum(u["tokens"] for u in updates) / max(now - t_update, 1e-9),
                  "time/rollout_s": t_rollout, "time/update_s": now - t_update, "time/weight_sync_s": t_sync,
                  "time/kv_remake_s": self.sampler.stats["kv_remake_s"] - remake_s, **memory.metrics,
                  "time/step_s": time.perf_counter() - t0}
        self.log.log(record)
        self._check_step(updates, record["reward"])
        return record

    def _update(self, batch: SequenceBatch, loss_fn, correction) -> dict:
        try:
            return self.learner.step(batch, loss_fn, correction=correction,
                                     aggregation=self.cfg.rl.loss.aggregation)
        except ValueError:
            # the weight refresh refuses non-finite weights: say which and where
            self._check_weights(f"step {self.step}, after an update")
            raise

    def _check_step(self, updates: list[dict], reward: float) -> None:
        """After a step's updates: weights finite (else stop), losses and gradients finite (else
        `rl.on_nonfinite`), and the reward not stuck at 0 (a warning once per run of such steps)."""
        self._check_weights(f"step {self.step}, after its updates")
        bad = [(i, u) for i, u in enumerate(updates) if not (math.isfinite(u["loss"])
                                                             and math.isfinite(u["grad_norm"]))]
        if bad:
            listed = ", ".join(f"{i + 1} (loss {u['loss']}, grad_norm {u['grad_norm']})" for i, u in bad)
            self._nonfinite(f"step {self.step}: a non-finite loss or gradient in update(s) {listed} of "
                            f"{len(updates)}")
        self.zero_reward_steps = self.zero_reward_steps + 1 if reward == 0 else 0
        if self.zero_reward_steps == ZERO_REWARD_STEPS:
            self._diverged(f"steps {self.step - ZERO_REWARD_STEPS + 1}-{self.step}: the reward was 0 at "
                           f"{ZERO_REWARD_STEPS} consecutive steps: no learning signal (every advantage is "
                           f"0); the model may have diverged, or the task is too hard for it")

    def _diverged(self, what: str) -> None:
        """`rl.on_divergence`: a warning, or an error that stops the run."""
        if self.cfg.rl.on_divergence == "stop":
            raise DivergenceError(f"{what}; stopped (rl.on_divergence = \"stop\"; \"warn\" trains on)")
        self.warn(what)


def diagnose_direction(batch: RLBatch, cfg: TriageConfig) -> dict:
    """TRIAGE's diagnosis of the gap (region masses, imbalance, tails) without its weights: logged
    whatever the correction, so runs under any correction can be compared on it."""
    return triage(batch, replace(cfg, rebalance=False, repair=False)).metrics


def drop_unsupported(batch: SequenceBatch) -> tuple[SequenceBatch, float]:
    """Leave out of the loss the sampled tokens the learner gives probability 0 (log pi_old = -inf:
    outside its top-k / top-p set when sampler and learner disagree near the cut-off); their importance
    ratio is 0 and their gradient undefined. Returns the batch and the share of response tokens dropped."""
    old = batch.old_logprobs
    response = batch.mask(old.device)
    supported = torch.isfinite(old) | ~response
    dropped = int((~supported).sum())
    if not dropped:
        return batch, 0.0
    return replace(batch, token_mask=supported), dropped / int(response.sum())


def _mean_dicts(dicts: list[dict]) -> dict:
    keys = [k for k in dicts[0] if k not in ("tokens", "micro_batches", "step_seconds", "tokens_per_s")]
    out = {}
    for k in keys:
        values = [float(d[k]) for d in dicts if k in d]
        out[k if "/" in k else f"update/{k}"] = sum(values) / len(values) if values else math.nan
    return out
