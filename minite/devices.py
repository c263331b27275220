"""The compute device a command runs on, checked before anything is built on it.

Without the check a missing GPU surfaces late and cryptically (`AssertionError: Torch not compiled
with CUDA enabled` from the first tensor moved there, after the setup work is done).
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu", "cuda", "meta")


def check_device(device: str | torch.device, flag: str = "--device") -> None:
    """Raise a `ValueError` naming `flag` when `device` cannot run here: not a device name, a type
    minite does not run on, CUDA without a usable GPU, or a GPU index past the last one."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag}={device!r} is not a device; use cpu or cuda") from None
    if dev.type not in DEVICE_TYPES:
        raise ValueError(f"{flag}={device!r}: minite runs on cpu or cuda")
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"{flag}={device!r}: CUDA is not available here; use {flag}=cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"{flag}={device!r}: this machine has {count} GPU(s) (cuda:0 to cuda:{count - 1})")
