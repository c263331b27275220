"""The switch for the fused element-wise kernels (`minite.kernels.norm`, `minite.kernels.rope`): one
launch each instead of the reference's chains of small torch kernels, for learner and sampler alike.

By default (None) they run on CUDA tensors: on the H200 they took a 1.7B bf16 decode step from 14.7 to
11.2 ms (`benchmarks/results/`). `use_fused_kernels(True)` also runs them on CPU tensors under the
Triton interpreter (TRITON_INTERPRET=1), `use_fused_kernels(False)` turns them off (the plain torch
ops everywhere). Their backward passes are kernels too: RoPE's gives the reference's autograd bits,
RMSNorm's the same formula in other summation orders (`minite.kernels.norm`).
"""

from __future__ import annotations

import torch

from minite import kernels

_STATE: dict[str, bool | None] = {"on": None}


def use_fused_kernels(on: bool | None = True) -> None:
    """True: on CUDA and under the interpreter; False: nowhere; None: the default (CUDA only)."""
    _STATE["on"] = on


def fused_applies(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs its fused kernel now."""
    on = _STATE["on"]
    if on is False or not (x.is_cuda or (on and x.device.type == "cpu")):
        return False
    return kernels.available() and (x.is_cuda or kernels.interpreted())
