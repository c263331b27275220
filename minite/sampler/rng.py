"""Counter-based random numbers: one uniform per (sample key, token index), whatever the batch.

Each sample (seed, request index, sample index) gets a 64-bit key (`sample_key`, from BLAKE2b). The
uniform that decides its token t is a pure function of the key and t (`minite.ref.rng`: a 32-bit
integer hash, the same bits on CPU and GPU, one launch on the kernels), so it does not depend on the
batch, holds inside a CUDA graph and after a preemption recomputes the sequence.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.ref.rng import uniforms as uniforms_reference


def sample_key(seed: int, request: int, sample: int) -> int:
    """A 64-bit key for sample `sample` of request `request` under `seed`."""
    digest = hashlib.blake2b(f"{seed}/{request}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniforms(keys: torch.Tensor, steps: torch.Tensor, execution: Execution = DEFAULT) -> torch.Tensor:
    """keys [B] int64 (64-bit keys stored as signed), steps [B] int64 -> fp32 [B] in [0, 1): one launch
    (`minite.kernels.rng`) where the execution runs the element-wise kernels, else the reference; the
    same bits."""
    if execution.elementwise_kernels(keys):
        return lazy.rng.uniforms(keys, steps)
    return uniforms_reference(keys, steps)


def key_tensor(keys: list[int], device=None) -> torch.Tensor:
    """64-bit unsigned keys (or small non-negative ints) -> int64 tensor [B] holding the same bits,
    copied to `device` without synchronizing it (`runner.to_device`)."""
    from minite.sampler.runner import to_device

    bits = np.fromiter((k & 0xFFFFFFFFFFFFFFFF for k in keys), dtype=np.uint64, count=len(keys))
    return to_device(bits.view(np.int64), device if device is not None else "cpu")
