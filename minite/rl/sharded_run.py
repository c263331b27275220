"""A training run across processes (`torchrun --nproc-per-node=N -m minite.cli train ...`).

`ShardedRun.start(cfg, run_dir, resume)` joins the launcher's process group (or, resuming a sharded
run without torchrun, makes a group of one process), or returns None for a run in one process. What
changes in the loop (`minite.rl.trainer`):

- files: rank 0 alone opens and locks the run folder (its path broadcast to the others) and writes
  into it: config, metrics, progress, warnings, report, checkpoints' small state. The others write
  nothing. The world size is in the first progress line and in summary.json (`world_size`).
- learner: the model sharded by FSDP2 (`minite.learner.fsdp`), every rank running its share of each
  batch; warm start included.
- samplers: one per rank on a whole model of its own, each generating its contiguous share of the
  prompts (request indices stay the global ones, so the tokens drawn do not depend on the world
  size); the outputs are gathered on every rank. After a step's updates each rank's sampler gets the
  learner's weights as codes and scales (`gather_quantized_weights`; a sampler with its own recipe:
  the weights, `gather_full_weights`); `time/weight_sync_s` is that sync.
- checkpoints: `step_N/sharded/` written by every rank through torch.distributed.checkpoint (fp32
  masters and AdamW moments, by parameter name: loadable at any world size, one process included),
  `step_N/state.pt` by rank 0 (step, RNG, data position, ...); atomic as in `minite.rl.checkpointing`.

Not sharded yet: a KL reference model (`rl.loss.kl_coef > 0`) and a learner recipe with static
activation scales; both are refused with an error.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch

from minite import distributed
from minite.learner.fsdp import ShardedLearner, nonfinite_parameter, save_sharded, shard_model
from minite.learner.sharded_weight_sync import gather_full_weights, gather_quantized_weights
from minite.models import Qwen3
from minite.recipe import get_recipe
from minite.rl.checkpointing import (
    LATEST,
    _fsync_dir,
    _fsync_tree,
    _prune,
    _write_atomic,
    checkpoints,
    rng_state,
    step_name,
)
from minite.rl.run_folder import RunFolder

SHARDED_DIR = "sharded"


def is_sharded_checkpoint(path: Path | None) -> bool:
    return path is not None and (path / SHARDED_DIR).is_dir()


class FollowerFolder:
    """A run folder as the ranks other than 0 see it: its path, nothing to lock or remove."""

    warning = None

    def __init__(self, path: Path):
        self.path = path

    def close(self, failed: bool = False) -> None:
        pass


class SilentLog:
    """The metrics log of ranks other than 0: records are dropped (rank 0 writes them)."""

    path = None

    def log(self, record: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class ShardedRun:
    def __init__(self, group: distributed.Group, cfg):
        self.group, self.cfg = group, cfg
        self.dtype = getattr(torch, cfg.model.dtype)

    @classmethod
    def start(cls, cfg, run_dir, resume: bool) -> ShardedRun | None:
        """The run's process group: torchrun's, or one process resuming a sharded run; else None."""
        if distributed.launched():
            group = distributed.init(cfg.model.device)
        elif resume and run_dir and is_sharded_checkpoint(_latest(Path(run_dir) / "checkpoints")):
            group = distributed.init_single(cfg.model.device)
        else:
            return None
        if cfg.rl.loss.kl_coef > 0:
            raise ValueError("rl.loss.kl_coef > 0 (a KL reference model) is not supported across processes "
                             "yet")
        if get_recipe(cfg.recipe.name, **cfg.recipe.overrides).activation.scaling == "static":
            raise ValueError(f"recipe {cfg.recipe.name!r} (static activation scales) is not supported for a "
                             "sharded learner yet; give it to the sampler (sampler.recipe)")
        return cls(group, cfg)

    @property
    def main(self) -> bool:
        return self.group.main

    def open_folder(self, path):
        """Rank 0 opens (and locks) the folder; every rank gets its path."""
        folder = None
        if self.main:
            try:
                folder = RunFolder.open(path)
            except BaseException as e:
                self.group.broadcast(str(e))
                raise
            self.group.broadcast(str(folder.path))
            return folder
        got = self.group.broadcast(None)
        if not Path(got).is_dir():
            raise ValueError(f"rank 0 could not open the run folder: {got}")
        return FollowerFolder(Path(got))

    def describe(self) -> str:
        return (f"{self.group.world_size} process(es) ({self.group.backend}): learner sharded by FSDP2, "
                f"one sampler per process")

    def shard(self, model: Qwen3) -> Qwen3:
        return shard_model(model, self.dtype)

    def nonfinite_parameter(self, model) -> str | None:
        return nonfinite_parameter(model, self.group)

    def learner(self, model, **kwargs) -> ShardedLearner:
        return ShardedLearner(model, self.group, **kwargs)

    def sampler_model(self, learner_model, recipe) -> Qwen3:
        """This rank's whole model for its sampler (the learner's recipe, or the sampler's own), synced."""
        model = Qwen3(learner_model.config, recipe).to(device=self.group.device, dtype=self.dtype)
        self.sync(learner_model, model)
        return model

    def sync(self, learner_model, sampler_model) -> None:
        if sampler_model.recipe == learner_model.recipe:
            gather_quantized_weights(learner_model, sampler_model, self.dtype)
        else:
            gather_full_weights(learner_model, sampler_model, self.dtype)

    def generate(self, sampler, prompts: list[list[int]], params) -> list:
        """Every prompt's output on every rank; this rank generated its share (global indices)."""
        mine = self.group.share(len(prompts))
        outs = sampler.generate([prompts[i] for i in mine], params, first_index=mine.start) if mine else []
        return sorted((o for part in self.group.gather(outs) for o in part), key=lambda o: o.index)

    def save_checkpoint(self, ckpt_dir: Path, step: int, learner: ShardedLearner, state: dict,
                        keep: int) -> Path:
        """Checkpoint `step`: every rank its shards, rank 0 the state; atomic (a temporary sibling
        renamed into place, then `latest`), the last `keep` kept."""
        final = ckpt_dir / step_name(step)
        tmp = Path(self.group.broadcast(str(ckpt_dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}")))
        if self.main:
            tmp.mkdir(parents=True)
        self.group.barrier()
        try:
            save_sharded(tmp / SHARDED_DIR, learner)
            self.group.barrier()
            if self.main:
                torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
                _fsync_tree(tmp)
                if final.exists():
                    shutil.rmtree(tmp)
                else:
                    os.rename(tmp, final)
                    _fsync_dir(ckpt_dir)
                _write_atomic(ckpt_dir / LATEST, final.name + "\n")
                _prune(ckpt_dir, keep)
        except BaseException:
            if self.main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.group.barrier()
        return final

    def load_checkpoint(self, ckpt_dir: Path, warn) -> tuple[Path, dict] | None:
        """(path, state) of the newest sharded checkpoint whose state loads (older ones after a
        warning), with state["learner"]["path"] its shards' folder; None when there is none. Raises
        ValueError when none loads."""
        failures = []
        for path in checkpoints(ckpt_dir):
            try:
                if not is_sharded_checkpoint(path):
                    raise FileNotFoundError(f"{path / SHARDED_DIR} does not exist (a one-process checkpoint)")
                state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
                if not {"step", "rng", "learner"} <= state.keys():
                    raise ValueError("not a training state")
            except Exception as e:
                failures.append(f"{path.name}: {type(e).__name__}: {e}")
                warn(f"checkpoint {path} cannot be loaded ({type(e).__name__}: {e}); trying the previous one")
                continue
            state["learner"] = {**state["learner"], "path": str(path / SHARDED_DIR)}
            return path, state
        if failures:
            raise ValueError(f"no checkpoint in {ckpt_dir} can be loaded ({'; '.join(failures)}); the run "
                             "cannot be resumed: start a new one (another run_dir)")
        return None

    def close(self) -> None:
        distributed.close()


def _latest(ckpt_dir: Path) -> Path | None:
    found = checkpoints(ckpt_dir)
    return found[0] if found else None
