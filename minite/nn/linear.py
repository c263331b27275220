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

from minite.nn import quantized_weight as qwm
from minite.nn import segmented_decode
from minite.nn.nvfp4_matmul import (
    LinearMatmul,
    QuantizedActivation,
    StaticScale,
    quantize_input,
    static_scale,
    use_kernels,
)
from minite.nn.pinned_weights import pinned
from minite.nn.quantized_weight import (
    QuantizedWeight,
    _one_launch,
    quantize_weight,
    quantize_weights,
    weight_key,
)
from minite.nn.segmented_matmul import SegmentedCopy, SegmentedMatmul, operand_layout, segmented_copy
from minite.nn.shared_scale import quantize_shared
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
                and qw.key[2] is w.dtype and qw.shape == w.shape:
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
        if qw.spec != self.recipe.weight or qw.shape != tuple(self.weight.shape):
            raise ValueError(f"quantized weight {qw.shape} / {qw.spec} does not fit {self!r}")
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


class SegmentedLinear(Linear):
    """Linears that read one input, stored as one parameter (q|k|v, gate|up): `y_j = x W_j^T` for the
    segments W_j of `.weight` [sum N_j, K] (rows `offsets[j]:offsets[j + 1]`, no bias) under `recipe`;
    `forward` returns the segments' outputs `[..., N_j]` as a tuple.

    Each segment is quantized as a tensor of its own (its own global scale), so codes, scales and
    outputs are those of separate `Linear`s with the same rows; under `fused_scale="shared"` all
    segments share one global scale, as serving engines decode a fused group (`minite.nn.shared_scale`);
    a checkpoint's NVFP4 containers are used as they are (`minite.nn.pinned_weights`). The checkpoint
    code maps the segments to Hugging Face's separate tensors (`minite.models.hf_layout`). Execution:
    bf16 recipes run one `F.linear` over the whole weight, calibration one per segment; NVFP4 on
    the kernels with more than `execution.decode_max_m` rows one GEMM launch over the segments'
    concatenated copy (`minite.nn.segmented_matmul`, made once per weight update); where the segments
    read their decode layouts (fewer rows, or the sampler form) and no gradient is needed, one launch
    over those layouts concatenated (`minite.nn.segmented_decode`); otherwise each segment's GEMM on
    its own, sharing one quantization of the input (on the kernels; the reference quantizes per GEMM,
    as a Linear does). The input's quantization can be handed over by the op before
    (`quantized`: the norm that quantized its output in the same launch). A calibrated static input
    scale is one for all segments: they read the same input, so separate linears would each have found
    the same amax.
    """

    def __init__(self, in_features: int, widths: tuple[int, ...], recipe: str | Recipe = "aligned",
                 dtype=None, device=None):
        if not widths or any(n <= 0 for n in widths):
            raise ValueError(f"SegmentedLinear needs positive segment widths, got {widths}")
        self.widths = tuple(int(n) for n in widths)
        self.offsets = tuple(sum(self.widths[:j]) for j in range(len(self.widths) + 1))
        self._qweights: tuple[QuantizedWeight, ...] | None = None
        self._copy: SegmentedCopy | None = None
        self._decode: segmented_decode.SegmentedDecode | None = None
        super().__init__(in_features, self.offsets[-1], bias=False, recipe=recipe, dtype=dtype, device=device)

    def reset_parameters(self) -> None:
        """Each segment initialized as a Linear of its own (the same draws, in segment order)."""
        with torch.no_grad():
            for w in self.segments():
                nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def segments(self) -> list[torch.Tensor]:
        """The segments' rows of `weight`, as views ([N_j, K] each)."""
        return [self.weight[a:b] for a, b in zip(self.offsets, self.offsets[1:])]

    def set_recipe(self, recipe: str | Recipe) -> None:
        super().set_recipe(recipe)
        self._qweights, self._copy, self._decode = None, None, None

    def quantized_weight(self) -> QuantizedWeight:
        raise TypeError("a SegmentedLinear has one quantized weight per segment: use quantized_weights()")

    def quantized_weights(self) -> tuple[QuantizedWeight, ...]:
        """Each segment's shared quantized weight, re-quantized only when the weight or the recipe changed."""
        qws, w, spec = self._qweights, self.weight, self.recipe.weight
        if qws is not None:
            key = qws[0].key  # the fast check of `Linear.quantized_weight`, on the first segment
            if key[0] == w._version and key[1] == w.data_ptr() and key[5] is spec and key[2] is w.dtype:
                return qws
        if not self.recipe.fp4:
            raise RuntimeError(f"recipe {self.recipe.name!r} does not quantize weights")
        views = self.segments()
        if qws is None or any(q.key != weight_key(v, spec) for q, v in zip(qws, views)):
            self.install_quantized_weights(self._quantize(views, spec))
        return self._qweights

    def quantizes_whole(self) -> bool:
        """Whether the segments are quantized together, not as separate weights: under one global
        scale (`fused_scale="shared"`), or from a checkpoint's pinned containers."""
        return self.recipe.fp4 and (self.recipe.fused_scale == "shared"
                                    or pinned(self.weight, self.recipe.weight) is not None)

    def _quantize(self, views: list[torch.Tensor], spec) -> list[QuantizedWeight]:
        pins = pinned(self.weight, spec)
        if pins is not None and len(pins) == len(views):  # a checkpoint's codes and scales, as they are
            return [qwm.from_container(q, spec, weight_key(v, spec)) for q, v in zip(pins, views)]
        if self.recipe.fused_scale == "shared":
            return quantize_shared(self.weight, self.offsets, views, spec)
        return _quantize_segments(views, spec)

    def install_quantized_weights(self, qweights) -> None:
        """Use `qweights` (one per segment, made from the segments' current rows) from now on."""
        if len(qweights) != len(self.widths):
            raise ValueError(f"{len(qweights)} quantized weights for {len(self.widths)} segments")
        self._qweights, self._copy, self._decode = tuple(qweights), None, None

    def refresh_quantized_weight(self, qweight: QuantizedWeight | None = None) -> None:
        """Re-quantize the segments now (and make the fused GEMM's copy where it runs)."""
        if qweight is not None:
            raise TypeError("install a SegmentedLinear's quantized weights with install_quantized_weights")
        self._qweights, self._copy, self._decode = None, None, None
        if self.recipe.fp4:
            self.quantized_weights()
            self.prepare()

    def set_quantized_weight(self, qw: QuantizedWeight) -> None:
        raise TypeError("a SegmentedLinear takes one quantized weight per segment: set_quantized_weights()")

    def set_quantized_weights(self, qweights) -> None:
        """Install the segments' quantized weights made elsewhere (weight sync); used until `weight`
        changes."""
        views, spec = self.segments(), self.recipe.weight
        if len(qweights) != len(views) or any(qw.spec != spec or qw.shape != tuple(v.shape)
                                              for qw, v in zip(qweights, views)):
            raise ValueError(f"quantized weights {[qw.shape for qw in qweights]} do not fit "
                             f"{self!r}")
        self.install_quantized_weights([dataclasses.replace(qw, key=weight_key(v, spec))
                                        for qw, v in zip(qweights, views)])

    def prepare(self) -> None:
        """Make the fused GEMM's concatenated copy now, where it would run (after a weight update)."""
        if self._fusable(self.weight.device):
            self.fused_copy()

    def fused_copy(self) -> SegmentedCopy:
        """The segments' concatenated copy, made once per quantized weights (and device); the segments'
        own copies become views into it."""
        qws, copy = self.quantized_weights(), self._copy
        dt, bk = operand_layout(self.weight.device)
        if copy is not None and copy.copy.device == self.weight.device and copy.copy.dtype == dt and \
                all(a is b for a, b in zip(copy.qweights, qws)):
            return copy
        copy = segmented_copy(qws, self.recipe, self.in_features, self.weight.device)
        self._qweights, self._copy = copy.qweights, copy
        return copy

    def decode_group(self, dtype: torch.dtype) -> segmented_decode.SegmentedDecode:
        """The segments' concatenated decode layout for `dtype` activations, made once per quantized
        weights (`minite.nn.segmented_decode`)."""
        qws, group = self.quantized_weights(), self._decode
        if group is not None and group.weight.scales.dtype == dtype and all(
                a is b for a, b in zip(group.qweights, qws)):
            return group
        group = self._decode = segmented_decode.segmented_decode(qws, self.recipe, dtype)
        return group

    def _fusable(self, device) -> bool:
        """The settings allow the one-launch GEMM (whatever the input): 2-3 segments, NVFP4 on the
        kernels with the 'dequantized' backward, per-row or per-tensor (not static) activation scales,
        fusion on and no fast mode; not in the sampler form (the concatenated copy is bf16)."""
        recipe = self.recipe
        e = recipe.execution
        return (len(self.widths) in (2, 3) and recipe.fp4 and recipe.backward == "dequantized"
                and not qwm.is_released(self.weight)
                and e.fused_projections and not e.fast and recipe.activation.scaling != "static"
                and use_kernels(recipe, device))

    def _fused_applies(self, x: torch.Tensor) -> bool:
        k = x.shape[-1]
        rows = x.numel() // max(k, 1)
        return (k % 16 == 0 and rows > self.recipe.execution.decode_max_m and x.dtype == self.weight.dtype
                and rows * max(self.widths) < 2**31 and self._fusable(x.device))

    def forward(self, x: torch.Tensor, quantized: QuantizedActivation | None = None
                ) -> tuple[torch.Tensor, ...]:
        views = self.segments()
        if self._calib_amax is not None:
            self._calib_amax = torch.maximum(self._calib_amax, x.detach().abs().amax().float())
            return tuple(F.linear(x, w) for w in views)
        if not self.recipe.fp4:  # one GEMM over the segments (bf16 promises no engine's bits)
            return F.linear(x, self.weight).split(self.widths, -1)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self!r} expects in_features={self.in_features}, got x {tuple(x.shape)}")
        recipe = self.recipe
        if self._fused_applies(x):
            return SegmentedMatmul.apply(x, self.fused_copy(), recipe, quantized, self.weight)
        qws, static = self.quantized_weights(), self._static_scale()
        if quantized is None and x.numel() and use_kernels(recipe, x.device):
            quantized = quantize_input(x, recipe, static)  # one quantization for every segment
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        rows = 0 if quantized is None else quantized.values.shape[0]
        if quantized is not None and segmented_decode.applies(qws, self.widths, recipe, x, rows, needs_grad):
            return segmented_decode.forward(x, self.decode_group(quantized.values.dtype), recipe, quantized)
        return tuple(LinearMatmul.apply(x, w, qw, recipe, static, quantized) for w, qw in zip(views, qws))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, widths={self.widths}, recipe={self.recipe.name}"


def _quantize_segments(views: list[torch.Tensor], spec) -> list[QuantizedWeight]:
    """Each segment quantized as its own tensor; same-shape segments in one stacked launch where the
    kernels serve it (bitwise the separate calls; their copies then lie back to back)."""
    same = all(v.shape == views[0].shape for v in views)
    if same and len(views) > 1 and _one_launch(views[0].detach(), spec, "auto"):
        return quantize_weights(views, spec)
    return [quantize_weight(v, spec) for v in views]
