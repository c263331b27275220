"""SwiGLU, `silu(gate) * up`, the MLP's (and the MoE experts') activation.

Where the execution runs the element-wise kernels (on CUDA by default) 16-bit rows run the one-launch
Triton kernel `minite.kernels.swiglu` (torch's formula, element-wise) instead of torch's two kernels;
told the recipe
of the NVFP4 GEMM that reads h next (`quantize_for`), the same launch also quantizes h for it (the
bits its own quantizer would give), handed over through the forward scope's memo.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn import nvfp4_matmul
from minite.recipe import Recipe


def swiglu(gate: torch.Tensor, up: torch.Tensor, execution: Execution = DEFAULT,
           quantize_for: Recipe | None = None) -> torch.Tensor:
    """silu(gate) * up for gate / up [..., I]."""
    if execution.elementwise_kernels(gate):
        kernel = lazy.swiglu
        if kernel.applies(gate, up):
            if quantize_for is not None and nvfp4_matmul.can_seed_quantized_input(gate, quantize_for):
                def produce(dtype, chain):
                    return kernel.swiglu_quantize(gate, up, dtype, chain)
                return nvfp4_matmul.produce_quantized(quantize_for, gate.device, produce)
            return kernel.swiglu(gate, up)
    return F.silu(gate) * up
