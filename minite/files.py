"""Output files written whole or not at all, and write errors that name the path and what to do.

`write_atomic` writes a temporary sibling and renames it over the target, so a full disk or a crash
mid-write leaves the previous file as it was (never a truncated report). `writing(path)` turns an
`OSError` raised while writing `path` into a `WriteError` whose message names the path and the remedy
(free space, fix permissions); `describe_os_error` is the one line the `minite` command prints for
any `OSError`.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# what went wrong, then what to do
CAUSES = {
    errno.ENOSPC: ("no space left on the device", "free space there or use another path"),
    errno.EDQUOT: ("disk quota exceeded", "free space there or use another path"),
    errno.EFBIG: ("file too large for this file system", "use another path"),
    errno.EACCES: ("permission denied", "check the permissions or use another path"),
    errno.EPERM: ("operation not permitted", "check the permissions or use another path"),
    errno.EROFS: ("read-only file system", "use another path"),
}


def _cause(e: OSError) -> str:
    what, todo = CAUSES.get(e.errno, ((e.strerror or str(e)).lower(), None))
    return f"{what}; {todo}" if todo else what


class WriteError(OSError):
    """Writing a file failed; `str()` is the whole message (path, cause, what to do)."""

    def __init__(self, path: str | Path, cause: OSError):
        super().__init__(cause.errno, f"cannot write {path}: {_cause(cause)}", str(path))

    def __str__(self) -> str:
        return self.strerror


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Re-raise an `OSError` of the block as a `WriteError` naming `path`."""
    try:
        yield
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(path, e) from e


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write `data` to `path` through a temporary sibling renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with writing(path):
        try:
            _write_file(tmp, data.encode() if isinstance(data, str) else data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def append_line(path: str | Path, line: str) -> None:
    """Append one line (a trailing newline is added) to `path` in a single write."""
    with writing(path), open(path, "a") as f:
        f.write(line + "\n")


def make_dir(path: str | Path) -> Path:
    """`mkdir -p path`, a failure named as a write error."""
    path = Path(path)
    with writing(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


def check_output_dir(path: str | Path, flag: str = "--out") -> None:
    """Before any compute: `path` must be a folder or not exist yet, under a folder this process may
    write into (the folder itself is not created here, so a failed command leaves nothing behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder; name a folder (it is created if needed)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise WriteError(path, PermissionError(errno.EACCES, "Permission denied", str(existing)))


def describe_os_error(e: OSError) -> str:
    """One line for an `OSError`: its own message when it has one, else the path, cause and remedy."""
    if isinstance(e, WriteError) or e.errno is None or not e.filename:
        return str(e)
    return f"{e.filename}: {_cause(e)}"
