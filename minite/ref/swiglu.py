"""SwiGLU, `silu(gate) * up` element-wise in the inputs' dtype (torch's two ops). `minite.kernels.swiglu`
gives these bits on 16-bit rows (torch's formula, element by element).
"""

import torch
import torch.nn.functional as F


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> [..., I]."""
    return F.silu(gate) * up
