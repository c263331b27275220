"""RMSNorm, computed the Qwen3 way: `weight * (x / sqrt(mean(x^2) + eps))`.

The normalization runs in fp32 whatever the input dtype, the result is cast back to the input dtype
and only then scaled by the weight (in the weight's dtype), as transformers' Qwen3RMSNorm does.
Norms are never quantized. The reduction is over the last dimension of one row, so a token's
output does not depend on the other rows of the batch (torch's own reduction kernels do not promise
the same bits for every batch size on the GPU; the Triton kernel does).

Where the execution runs the element-wise kernels (`Execution.elementwise`: on CUDA by default)
`rms_norm` runs the one-launch Triton kernel `minite.kernels.norm.rms_norm` instead; told the recipe
of the NVFP4 linears that read its output (`quantize_for`), the same launch also quantizes the output
for them.
"""

from __future__ import annotations

import torch
from torch import nn

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn import nvfp4_matmul
from minite.recipe import Recipe


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, execution: Execution = DEFAULT,
             quantize_for: Recipe | None = None) -> torch.Tensor:
    """RMS-normalize `x [..., D]` over its last dimension and scale by `weight [D]`. `quantize_for`: the
    recipe of the linears that read the output next; where they run the NVFP4 kernels inside a forward
    scope, the kernel also quantizes the output for them (`kernels.norm.rms_norm_quantize`, the same
    bits as their own quantizer): one launch and one pass over the rows less."""
    if execution.elementwise_kernels(x):
        kernel = lazy.norm
        if x.shape[-1] <= kernel.MAX_D:
            if quantize_for is not None and nvfp4_matmul.can_seed_quantized_input(x, quantize_for):
                def produce(dtype, chain):
                    return kernel.rms_norm_quantize(x, weight, eps, dtype, chain)
                return nvfp4_matmul.produce_quantized(quantize_for, x.device, produce)
            return kernel.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: eight torch ops, fp32 statistics."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x has last dimension {x.shape[-1]}, weight has {weight.shape[0]}")
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1] fp32
    return weight * (xf * inv_rms).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale initialized to ones."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, execution: Execution = DEFAULT,
                quantize_for: Recipe | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, execution, quantize_for)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
