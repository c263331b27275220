"""Linear layer whose forward is W4A4 NVFP4 under a recipe (or plain bf16).

A linear layer runs three GEMMs (X [M, K] tokens x in-features, W [N, K] weight, Y [M, N]):

- forward  Y  = X W^T      (contract K)
- dgrad    dX = dY W       (contract N)
- wgrad    dW = dY^T X     (contract M, the tokens)

Which operand is quantized how:

- recipe `bf16` (`recipe.fp4 == False`): nothing is quantized; plain `F.linear`.
- forward (every fp4 recipe): X with `recipe.activation` (per-token 'row' scale for `aligned`,
  batch-dependent per-tensor 'tensor' for `te`, calibrated 'static' for `vllm`), W with
  `recipe.weight`; both in 1x16 (or 16x16) blocks along K. The GEMM multiplies the *unscaled*
  dequantized operands (e2m1 * block scale, exact in bf16) with fp32 accumulation and applies the
  global scales in the epilogue (`recipe.epilogue`, see `minite.ref.gemm`).
- backward `dequantized` (default, straight-through): dgrad and wgrad are high-precision GEMMs on
  the dequantized forward operands: dX = dY deq(W), dW = dY^T deq(X). dY is not quantized.
- backward `nvfp4` (TE-like): dgrad quantizes dY in 1x16 blocks along N with stochastic rounding and
  multiplies it with the forward's dequantized W (identical to TE's for 16x16 weight blocks);
  wgrad quantizes dY^T and X^T in 1x16 blocks along the token dimension M with the random Hadamard
  transform (RHT) on both, stochastic rounding on dY^T and RNE on X^T. Both stochastic roundings
  make the gradient unbiased with respect to dY's quantization.

The quantized weight is computed once per weight update and cached (see `quantized_weight`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minite.recipe import Recipe, get_recipe


class Linear(nn.Module):
    """`y = x W^T (+ b)` with `.weight` [out, in] (HF naming) executed under `recipe`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 recipe: str | Recipe = "aligned", dtype=None, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.set_recipe(recipe)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def set_recipe(self, recipe: str | Recipe) -> None:
        self.recipe = get_recipe(recipe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recipe.fp4:
            return F.linear(x, self.weight, self.bias)
        raise NotImplementedError("NVFP4 forward lands with minite.nvfp4")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}")
