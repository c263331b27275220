"""SwiGLU, `silu(gate) * up`, the MLP's (and the MoE experts') activation.

Where the execution runs the element-wise kernels (on CUDA by default) 16-bit rows run the one-launch
Triton kernel `minite.kernels.swiglu` (torch's formula, element-wise) instead of torch's two kernels;
`swiglu_quantized` also quantizes h for the NVFP4 GEMM that reads it next (the bits its own
quantizer would give) and hands that quantization over explicitly.
"""

from __future__ import annotations

import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn import nvfp4_matmul
from minite.nn.nvfp4_matmul import QuantizedActivation
from minite.recipe import Recipe
from minite.ref.swiglu import swiglu as swiglu_reference


def swiglu(gate: torch.Tensor, up: torch.Tensor, execution: Execution = DEFAULT) -> torch.Tensor:
    """silu(gate) * up for gate / up [..., I]."""
    if execution.elementwise_kernels(gate) and lazy.swiglu.applies(gate, up):
        return lazy.swiglu.swiglu(gate, up)
    return swiglu_reference(gate, up)


def swiglu_quantized(gate: torch.Tensor, up: torch.Tensor, recipe: Recipe
                     ) -> tuple[torch.Tensor, QuantizedActivation | None]:
    """`swiglu` under `recipe.execution` and h's quantization for the NVFP4 GEMM that reads it next
    under `recipe`, where the kernel makes it in the same launch; else None."""
    execution = recipe.execution
    if (execution.elementwise_kernels(gate) and lazy.swiglu.applies(gate, up)
            and nvfp4_matmul.hands_over(gate, recipe)):
        def produce(dtype, chain):
            return lazy.swiglu.swiglu_quantize(gate, up, dtype, chain)
        return nvfp4_matmul.handed_over(recipe, gate.device, produce)
    return swiglu(gate, up, execution), None
