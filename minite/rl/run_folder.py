"""A run folder owned by one process: a lock naming its holder, unique default names, no overwrites.

`RunFolder.open(path, resume)` creates or opens the folder and takes `run.lock` in it: an exclusive
`fcntl.flock` on the file, which holds the holder's pid and host. The kernel drops a flock when its
process dies (kill -9 included), so a lock file whose lock nobody holds is stale: its holder was
killed before it could remove it, and the next run takes it over with a warning. A second writer
while the holder lives is refused with `RunFolderBusy` naming the holder.

Default names (`runs/<timestamp>`) have a one-second resolution; two runs started in the same second
get `runs/<timestamp>`, `runs/<timestamp>-2`, ...: each name is claimed by an atomic `mkdir`.

`close(failed=True)` removes a folder this process created when nothing but the lock, the config copy
and TensorBoard's empty event files were written into it (a run that failed before its first record).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
from datetime import datetime
from pathlib import Path

LOCK_FILE = "run.lock"
# what a run writes before its first record (metrics.jsonl or a checkpoint): nothing to keep
SCAFFOLDING = {LOCK_FILE, "config.toml", "tensorboard"}
# files that mean the folder already holds a run
RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "checkpoints")


class RunFolderBusy(ValueError):
    """Another live process holds the run folder's lock."""


def new_run_dir(root: str | Path = "runs", now: datetime | None = None) -> Path:
    """Create and return a fresh `root/<YYYYmmdd-HHMMSS>[-k]` (atomic: concurrent callers get distinct
    folders)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    for k in range(1, 10_000):
        path = root / (stamp if k == 1 else f"{stamp}-{k}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{root} holds 10000 runs named {stamp}*; choose a run_dir")


def existing_run_files(path: Path) -> list[str]:
    """The files of an earlier run in folder `path` (empty when it holds none)."""
    return [name for name in RUN_FILES if (path / name).exists()]


class RunFolder:
    """The run folder and its lock; `close()` releases it (`with RunFolder.open(...)` does too)."""

    def __init__(self, path: Path, lock_fd: int, created: bool, warning: str | None = None):
        self.path, self._fd, self.created, self.warning = path, lock_fd, created, warning

    @classmethod
    def open(cls, path: str | Path | None) -> RunFolder:
        """Create (None: a fresh default name) or open the folder and take its lock."""
        if path is None:
            path, created = new_run_dir(), True
        else:
            path = Path(path)
            created = not path.exists()
            path.mkdir(parents=True, exist_ok=True)
        try:
            fd, warning = _lock(path / LOCK_FILE)
        except BaseException:
            if created:
                shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd, created, warning)

    def close(self, failed: bool = False) -> None:
        """Release the lock (removing the lock file); after a failure also remove the folder if this
        process created it and wrote nothing worth keeping into it."""
        if self._fd is None:
            return
        discard = failed and self.created and self._only_scaffolding()
        try:
            (self.path / LOCK_FILE).unlink(missing_ok=True)  # while still holding it: no one else can
        finally:
            os.close(self._fd)
            self._fd = None
        if discard:
            shutil.rmtree(self.path, ignore_errors=True)

    def _only_scaffolding(self) -> bool:
        return all(p.name in SCAFFOLDING for p in self.path.iterdir())

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(failed=kind is not None)

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # the lock goes with the descriptor; the file stays (stale, harmless)


def _lock(path: Path) -> tuple[int, str | None]:
    """Take the exclusive lock on `path`, write our pid and host into it; (fd, warning or None)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunFolderBusy(f"{path.parent} is in use by another run ({holder}, lock file {path}); "
                                f"wait for it to end, stop it, or choose another run_dir") from None
        except BaseException:
            os.close(fd)
            raise
        # the holder may have removed the file between our open and our lock: then lock the new one
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    previous = _read_holder(fd)
    warning = (f"took over the stale lock {path} of {previous}, which is no longer running (killed "
               f"before it could release it)") if previous else None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    os.fsync(fd)
    return fd, warning


def _read_holder(fd: int) -> str:
    return os.pread(fd, 200, 0).decode(errors="replace").strip()
