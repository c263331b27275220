"""The switch for the fused element-wise kernels (`minite.kernels.norm`, `minite.kernels.rope`): one
launch each instead of the reference's chains of small torch kernels, for learner and sampler alike.

Off by default until measured on the GPU; `use_fused_kernels(True)` turns them on wherever the Triton
kernels can run (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). The backward passes go
through the references (recomputed under autograd).
"""

from __future__ import annotations

import torch

_STATE = {"on": False}


def use_fused_kernels(on: bool = True) -> None:
    _STATE["on"] = on


def fused_applies(x: torch.Tensor) -> bool:
    """Whether an op on `x` runs its fused kernel now."""
    if not _STATE["on"]:
        return False
    from minite import kernels

    return kernels.available() and (x.is_cuda or kernels.interpreted())
