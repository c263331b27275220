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

Execution (`recipe.execution`): on the Triton kernels (on CUDA by default) the forward is the fused
row quantizer + W4A4 GEMM in the batch-invariant 'aligned' config at every M, so the learner's and
the sampler's rows agree bit for bit; recipes the kernels do not cover fall back to the reference
GEMM (`minite.nn.nvfp4_matmul` lists them). `execution.fast` trades that alignment for speed (the
'decode' config on packed weights for M <= 64, 'prefill' above). On CUDA the forward never
synchronizes with the host: a non-finite input gives NaN outputs instead of the CPU's ValueError.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from minite.nn.nvfp4_matmul import LinearMatmul, QuantizedActivation, StaticScale, static_scale, use_kernels
from minite.nn.quantized_weight import QuantizedWeight, quantize_weight, weight_key
from minite.recipe import Recipe, get_recipe

TE_AMAX_TO_SCALE = 2688.0  # 6 * 448: calibrated input_scale = amax / 2688 (ModelOpt's convention)


class Linear(nn.Module):
    """`y = x W^T (+ b)` with `.weight` [out, in] (HF naming) executed under `recipe`.

    `input_scale` (fp32 [], non-persistent buffer, None until `minite.nn.calibrate` sets it) is the
    static activation decode scale used by recipes with `activation.scaling == "static"`.
    """

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
        self.register_buffer("input_scale", None, persistent=False)
        self._qweight: QuantizedWeight | None = None
        self._calib_amax: torch.Tensor | None = None
        self._static: StaticScale | None = None
        self.set_recipe(recipe)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def set_recipe(self, recipe: str | Recipe) -> None:
        self.recipe = get_recipe(recipe)
        self._qweight = None

    def quantized_weight(self) -> QuantizedWeight:
        """The shared quantized weight, re-quantized only when the weight or the recipe changed."""
        qw, w, spec = self._qweight, self.weight, self.recipe.weight
        # fast check of the cache key (`weight_key`: version, storage, dtype, device, shape, spec)
        if qw is not None and qw.key[0] == w._version and qw.key[1] == w.data_ptr() and qw.key[5] is spec \
                and qw.key[2] is w.dtype and qw.unscaled.shape == w.shape:
            return qw
        if not self.recipe.fp4:
            raise RuntimeError(f"recipe {self.recipe.name!r} does not quantize weights")
        if qw is None or qw.key != weight_key(w, spec):
            self._qweight = quantize_weight(w, spec)
        return self._qweight

    def refresh_quantized_weight(self, qweight: QuantizedWeight | None = None) -> None:
        """Re-quantize the weight now, or install `qweight` (made from it by `quantize_weights`)."""
        self._qweight = qweight
        if self.recipe.fp4 and qweight is None:
            self.quantized_weight()

    def set_quantized_weight(self, qw: QuantizedWeight) -> None:
        """Install a quantized weight made elsewhere (weight sync); used until `weight` changes."""
        if qw.spec != self.recipe.weight or tuple(qw.unscaled.shape) != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {tuple(qw.unscaled.shape)} / {qw.spec} does not fit {self!r}")
        self._qweight = dataclasses.replace(qw, key=weight_key(self.weight, self.recipe.weight))

    def forward(self, x: torch.Tensor, quantized: QuantizedActivation | None = None) -> torch.Tensor:
        """`quantized`: x's quantization, where the op before made it (`nvfp4_matmul.QuantizedActivation`)."""
        if self._calib_amax is not None:
            self._calib_amax = torch.maximum(self._calib_amax, x.detach().abs().amax().float())
            return F.linear(x, self.weight, self.bias)
        if not self.recipe.fp4:
            return F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self!r} expects in_features={self.in_features}, got x {tuple(x.shape)}")
        y = LinearMatmul.apply(x, self.weight, self.quantized_weight(), self.recipe, self._static_scale(),
                               quantized)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def graph_safe(self) -> bool:
        """Whether forward never synchronizes with the host (a CUDA graph can capture it): bf16, or
        NVFP4 on the Triton kernels (the reference quantizer builds small host tensors per call)."""
        return not self.recipe.fp4 or use_kernels(self.recipe, self.weight.device)

    def _static_scale(self) -> StaticScale | None:
        """The calibrated input scale in the form the GEMM takes, made again only when `input_scale`
        changed (a new calibration, a load, a device move)."""
        if self.recipe.activation.scaling != "static":
            return None
        s = self.input_scale
        if s is None:
            raise RuntimeError(
                f"{self!r} uses static activation scaling (recipe {self.recipe.name!r}) but was never "
                "calibrated: run `with minite.nn.calibrate(model): model(batch)` first")
        cached = self._static
        if cached is None or cached.key != (s.data_ptr(), s._version, self.recipe.activation.chain):
            cached = self._static = static_scale(s, self.recipe)
        return cached

    def start_calibration(self) -> None:
        self._calib_amax = torch.zeros((), dtype=torch.float32, device=self.weight.device)

    def finish_calibration(self, commit: bool = True) -> None:
        """Store input_scale = amax / 2688 (if any nonzero input was seen) and leave calibration."""
        amax, self._calib_amax = self._calib_amax, None
        if commit and amax is not None and amax > 0:
            self.input_scale = amax / TE_AMAX_TO_SCALE

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, recipe={self.recipe.name}")
