"""Atomic training checkpoints: save every N steps, resume as if never stopped.

Layout of a run folder's `checkpoints/`:

    step_000010/model/         the model in Hugging Face safetensors (`save_pretrained`), with what
                               `hf_extras` adds (the trainer: tokenizer and generation_config, so
                               transformers' Auto classes load it); other models of the run (the KL
                               reference: ref_model/) likewise
    step_000010/state.pt       {"step", "learner" (optimizer moments + fp32 masters), "rng", "data", ...}
    latest                     the name of the newest complete checkpoint ("step_000010")

A checkpoint is written into a hidden temporary sibling, every file fsynced, then renamed into place
(atomic on POSIX); `latest` is rewritten (temp file, fsync, `os.replace`) only after that. A run
killed at any moment therefore leaves either the previous `latest` or the new one, never a pointer to
a half-written checkpoint; leftover temporaries are ignored and cleaned up by the next save. Only
the last `keep` checkpoints are kept.

Loading falls back: `load_latest_checkpoint` tries the checkpoint `latest` names, then the older ones
kept, newest first, and resumes from the first that loads (a file truncated or overwritten after the
save, a file deleted), warning about each one it passes over and why. The ones passed over are moved
aside to `broken-step_N` (kept for inspection; never resumed from or pruned) and `latest` is pointed
at the one loaded, so the next save of that step writes a fresh checkpoint.

RNG states: torch (CPU and, when present, CUDA), Python `random` and NumPy. The sampler draws from
counter-based random numbers keyed by the per-step seed (`minite.sampler.rng`), so its state is the
step number itself.
"""

from __future__ import annotations

import io
import os
import random
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import torch

from minite.files import writing
from minite.models import load_pretrained, save_pretrained

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def rng_state() -> dict:
    """The global RNG states a training step may draw from."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: str | Path, step: int, models: dict[str, torch.nn.Module], state: dict,
                    keep: int = 2, hf_extras=None) -> Path:
    """Write checkpoint `step` (`models` by folder name, e.g. {"model": m}, and `state`, to which "step"
    and "rng" are added) atomically, point `latest` at it, prune all but the newest `keep`.
    `hf_extras(model_dir)` adds files to each model's folder before the checkpoint is complete."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / step_name(step)
    tmp = ckpt_dir / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for name, model in models.items():
            save_pretrained(model, tmp / name)
            if hf_extras is not None:
                hf_extras(tmp / name)
        # through memory: a full disk then fails in our write, which names the path (torch's own
        # writer reports it as an internal assertion)
        buf = io.BytesIO()
        torch.save({**state, "step": step, "rng": rng_state()}, buf)
        with writing(tmp / "state.pt"):
            (tmp / "state.pt").write_bytes(buf.getvalue())
        _fsync_tree(tmp)
        if final.exists():
            # a complete checkpoint of this step (`latest` may name it) is never replaced in place
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, final)
            _fsync_dir(ckpt_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(ckpt_dir / LATEST, final.name + "\n")
    _prune(ckpt_dir, keep)
    return final


def checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The checkpoints to resume from, newest first: the one `latest` names (which may be missing or
    broken), then the older complete ones kept. Empty when `latest` does not exist (no save finished)."""
    ckpt_dir = Path(ckpt_dir)
    pointer = ckpt_dir / LATEST
    if not pointer.is_file():
        return []
    kept = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=_step,
                  reverse=True)
    name = pointer.read_text(errors="replace").strip()
    if not STEP_DIR.match(name):  # an unreadable pointer: every checkpoint kept is a candidate
        return kept
    newest = ckpt_dir / name
    return [newest] + [p for p in kept if _step(p) < _step(newest)]


def _step(path: Path) -> int:
    return int(STEP_DIR.match(path.name)[1])


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The newest checkpoint to resume from (`checkpoints`), or None when there is none yet."""
    found = checkpoints(ckpt_dir)
    return found[0] if found else None


def load_checkpoint(path: str | Path, recipe, dtype: torch.dtype, device,
                    required: tuple[str, ...] = ("model",)) -> tuple[dict, dict]:
    """({name: model}, state) of a checkpoint; the caller restores learner state, then `set_rng_state`.
    A missing `state.pt` or a missing model of `required` raises FileNotFoundError."""
    path = Path(path)
    if not (path / "state.pt").is_file():
        raise FileNotFoundError(f"{path / 'state.pt'} does not exist")
    for name in required:
        if not (path / name / "config.json").is_file():
            raise FileNotFoundError(f"{path / name / 'config.json'} does not exist")
    models = {sub.name: load_pretrained(sub, recipe=recipe, dtype=dtype, device=device)
              for sub in sorted(path.iterdir()) if (sub / "config.json").is_file()}
    try:
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or overwritten file fails in the zip reader or the unpickler
        raise ValueError(f"{path / 'state.pt'} cannot be read ({_reason(e)}); it is truncated or "
                         f"corrupt") from e
    if not isinstance(state, dict) or not {"step", "rng", "learner"} <= state.keys():
        raise ValueError(f"{path / 'state.pt'} is not a training state (no step, rng, learner)")
    return models, state


def load_latest_checkpoint(ckpt_dir: str | Path, recipe, dtype: torch.dtype, device, warn=print,
                           required: tuple[str, ...] = ("model",)) -> tuple[Path, dict, dict] | None:
    """(path, models, state) of the newest checkpoint that loads (module docstring), or None when
    there is none; `warn(text)` is told of each one passed over. Raises ValueError when none loads."""
    ckpt_dir = Path(ckpt_dir)
    failures = []
    for path in checkpoints(ckpt_dir):
        try:
            models, state = load_checkpoint(path, recipe, dtype, device, required)
        except Exception as e:  # whatever a damaged file raises (safetensors, pickle, zip, OS errors)
            failures.append((path, _reason(e)))
            warn(f"checkpoint {path} cannot be loaded ({failures[-1][1]}); trying the previous one")
            continue
        if failures:
            _set_aside([p for p, _ in failures])
            _write_atomic(ckpt_dir / LATEST, path.name + "\n")
            warn(f"resuming from {path}; {', '.join(p.name for p, _ in failures)} moved aside to "
                 f"{ckpt_dir}/broken-*")
        return path, models, state
    if failures:
        listed = "; ".join(f"{p.name}: {why}" for p, why in failures)
        raise ValueError(f"no checkpoint in {ckpt_dir} can be loaded ({listed}); the run cannot be resumed: "
                         f"start a new one (another run_dir)")
    return None


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


def _set_aside(paths: list[Path]) -> None:
    """Rename broken checkpoints to `broken-<name>` (a suffix when that exists)."""
    for path in paths:
        if not path.exists():
            continue
        target = path.with_name(f"broken-{path.name}")
        if target.exists():
            target = path.with_name(f"broken-{path.name}-{uuid.uuid4().hex[:8]}")
        os.rename(path, target)
    if paths:
        _fsync_dir(paths[0].parent)


def _prune(ckpt_dir: Path, keep: int) -> None:
    steps = sorted((p for p in ckpt_dir.iterdir() if p.is_dir() and STEP_DIR.match(p.name)), key=_step)
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in ckpt_dir.glob(".step_*.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
