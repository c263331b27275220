"""RMSNorm, computed the Qwen3 way: `weight * (x / sqrt(mean(x^2) + eps))`.

The normalization runs in fp32 whatever the input dtype, the result is cast back to the input dtype
and only then scaled by the weight (in the weight's dtype), as transformers' Qwen3RMSNorm does.
Norms are never quantized. The reduction is over the last dimension of one row, so a token's
output does not depend on the other rows of the batch (torch's own reduction kernels do not promise
the same bits for every batch size on the GPU; the Triton kernel does).

Where the execution runs the element-wise kernels (`Execution.elementwise`: on CUDA by default)
`rms_norm` runs the one-launch Triton kernel `minite.kernels.norm.rms_norm` instead;
`rms_norm_quantized` also quantizes the output for the NVFP4 linear that reads it, in the same
launch, and hands that quantization over explicitly (the decoder layer passes it to q|k|v and
gate|up). With a `residual` the norm first adds it (the decoder layer's `h = x + attention`), in
the same launch where the kernel runs and nothing needs a gradient (the sampler): torch's add's bits
either way, so the learner's forward, which adds apart, gives the same h and the same norm.
"""

from __future__ import annotations

import torch
from torch import nn

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn import nvfp4_matmul
from minite.nn.nvfp4_matmul import QuantizedActivation
from minite.recipe import Recipe
from minite.ref.norm import rms_norm as rms_norm_reference


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             execution: Execution = DEFAULT) -> torch.Tensor:
    """RMS-normalize `x [..., D]` over its last dimension and scale by `weight [D]`."""
    if execution.elementwise_kernels(x) and x.shape[-1] <= lazy.norm.MAX_D:
        return lazy.norm.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_quantized(x: torch.Tensor, weight: torch.Tensor, eps: float, recipe: Recipe
                       ) -> tuple[torch.Tensor, QuantizedActivation | None]:
    """`rms_norm` under `recipe.execution`, and the output's quantization for the NVFP4 linear that
    reads it next under `recipe`, where the kernel makes it in the same launch
    (`kernels.norm.rms_norm_quantize`, the bits of the linear's own quantizer: one launch and one pass
    over the rows less); else None (the linear quantizes)."""
    execution = recipe.execution
    if (execution.elementwise_kernels(x) and x.shape[-1] <= lazy.norm.MAX_D
            and nvfp4_matmul.hands_over(x, recipe)):
        def produce(dtype, chain):
            return lazy.norm.rms_norm_quantize(x, weight, eps, dtype, chain)
        return nvfp4_matmul.handed_over(recipe, x.device, produce)
    return rms_norm(x, weight, eps, execution), None


def _fuses_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    execution: Execution) -> bool:
    grad = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or weight.requires_grad)
    return not grad and execution.elementwise_kernels(x) and x.shape[-1] <= lazy.norm.MAX_D


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 execution: Execution = DEFAULT, quantize_for: Recipe | None = None):
    """h = x + residual -> (h, the norm of h as `rms_norm` / `rms_norm_quantized` give it)."""
    if quantize_for is not None:
        execution = quantize_for.execution
    if not _fuses_residual(x, residual, weight, execution):
        h = x + residual
        if quantize_for is not None:
            return h, rms_norm_quantized(h, weight, eps, quantize_for)
        return h, rms_norm(h, weight, eps, execution)
    if quantize_for is not None and nvfp4_matmul.hands_over(x, quantize_for):
        held = []

        def produce(dtype, chain):
            h, *outs = lazy.norm.add_rms_norm(x, residual, weight, eps, dtype, chain)
            held.append(h)
            return outs
        normed = nvfp4_matmul.handed_over(quantize_for, x.device, produce)
        return held[0], normed
    h, out = lazy.norm.add_rms_norm(x, residual, weight, eps)
    return h, ((out, None) if quantize_for is not None else out)


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension with a learned scale initialized to ones."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, execution: Execution = DEFAULT, quantize_for: Recipe | None = None,
                residual: torch.Tensor | None = None):
        """The normed x; with `quantize_for` (the next linear's recipe, whose execution it runs under)
        the pair `rms_norm_quantized` gives; with `residual`, (x + residual, the norm of that)."""
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps, execution, quantize_for)
        if quantize_for is not None:
            return rms_norm_quantized(x, self.weight, self.eps, quantize_for)
        return rms_norm(x, self.weight, self.eps, execution)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
