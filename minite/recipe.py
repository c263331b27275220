"""Frozen descriptions of the numerics a model runs with.

A `Recipe` says how each operand of a linear layer is quantized (`QuantSpec`: scaling policy, block
shape, rounding, scale chain, Hadamard), how the GEMM epilogue applies the global scales, how the
backward pass is computed, which layers stay bf16, how the attention's keys and values are stored
(`kv_cache`: the model dtype, or quantized per token and kv head to fp8 or NVFP4 by
`minite.ref.kv_quant`, in the sampler's cache and the learner's forward alike), and how it executes
(`execution`, a `minite.execution.Execution`: reference or kernels, fast paths, thresholds; by
default the Triton kernels on CUDA where they cover the recipe and the reference elsewhere). Every
named recipe keeps keys and values in the model dtype. Named recipes:

- `bf16`: no quantization (the baseline).
- `aligned` (project default for RL): per-token activation scale, 1x16 weight blocks with a per-tensor
  weight scale, RNE, no RHT; epilogue `acc * (S_dec_row[m] * S_dec_w)` in fp32.
- `te`: Transformer Engine's NVFP4BlockScaling forward: dynamic per-tensor activation amax (so a
  token's codes depend on its batch), 16x16 weight blocks, epilogue alpha = amax_a*amax_w/7225344.
- `vllm`: a vLLM/FlashInfer-style sampler: static calibrated activation scale, 1x16 weights, the
  `vllm` scale chain.
- `torchao`: torchao's NVFP4Tensor chain (2^-6 floor on block scales, bf16 output scaling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from minite.execution import Execution, check_choice

SCALINGS = ("tensor", "row", "static")
BLOCKS = ((1, 16), (16, 16))
ROUNDINGS = ("rne", "stochastic")
CHAINS = ("te", "vllm", "torchao")
EPILOGUES = ("sdec", "alpha", "bf16_scalar")
BACKWARDS = ("dequantized", "nvfp4")
FUSED_SCALES = ("separate", "shared")
KV_CACHES = ("bf16", "fp8", "nvfp4")  # bf16: the model dtype, unquantized


@dataclass(frozen=True)
class QuantSpec:
    """How one GEMM operand is quantized; the keyword arguments of `minite.nvfp4.quantize`."""

    scaling: str = "row"
    block: tuple[int, int] = (1, 16)
    rounding: str = "rne"
    chain: str = "te"
    hadamard: bool = False

    def __post_init__(self):
        check_choice("scaling", self.scaling, SCALINGS)
        check_choice("block", tuple(self.block), BLOCKS)
        check_choice("rounding", self.rounding, ROUNDINGS)
        check_choice("chain", self.chain, CHAINS)

    def kwargs(self) -> dict:
        return dict(scaling=self.scaling, block=tuple(self.block), rounding=self.rounding,
                    chain=self.chain, hadamard=self.hadamard)


@dataclass(frozen=True)
class Recipe:
    name: str
    fp4: bool = True
    activation: QuantSpec = field(default_factory=lambda: QuantSpec(scaling="row"))
    weight: QuantSpec = field(default_factory=lambda: QuantSpec(scaling="tensor"))
    epilogue: str = "sdec"
    backward: str = "dequantized"
    execution: Execution = field(default_factory=Execution)
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    # "shared": q/k/v and gate/up quantize with one weight global scale per group, as serving engines
    # run them (`minite.nn.linear.SegmentedLinear`); "separate": each projection its own
    fused_scale: str = "separate"
    # how attention stores k and v (`minite.ref.kv_quant`); every named recipe keeps the model dtype
    kv_cache: str = "bf16"

    def __post_init__(self):
        check_choice("epilogue", self.epilogue, EPILOGUES)
        check_choice("fused_scale", self.fused_scale, FUSED_SCALES)
        check_choice("backward", self.backward, BACKWARDS)
        check_choice("kv_cache", self.kv_cache, KV_CACHES)
        if isinstance(self.execution, dict):  # a config's table
            object.__setattr__(self, "execution", Execution(**self.execution))
        if not isinstance(self.execution, Execution):
            raise TypeError(f"execution must be an Execution, got {type(self.execution).__name__}")
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")

    def replace(self, **changes) -> Recipe:
        return dataclasses.replace(self, **changes)

    def with_execution(self, **changes) -> Recipe:
        """This recipe with its execution changed: `recipe.with_execution(backend="ref")`."""
        return self.replace(execution=self.execution.replace(**changes))


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", fp4=False),
    "aligned": Recipe("aligned"),
    "te": Recipe(
        "te",
        activation=QuantSpec(scaling="tensor"),
        weight=QuantSpec(scaling="tensor", block=(16, 16)),
        epilogue="alpha",
    ),
    "vllm": Recipe(
        "vllm",
        activation=QuantSpec(scaling="static", chain="vllm"),
        weight=QuantSpec(scaling="tensor", chain="vllm"),
        epilogue="alpha",
    ),
    "torchao": Recipe(
        "torchao",
        activation=QuantSpec(scaling="tensor", chain="torchao"),
        weight=QuantSpec(scaling="tensor", chain="torchao"),
        epilogue="bf16_scalar",
    ),
}


def get_recipe(recipe: str | Recipe, **overrides) -> Recipe:
    """A named recipe (or the given one) with overrides: `get_recipe("te", epilogue="sdec")`."""
    if isinstance(recipe, Recipe):
        base = recipe
    elif recipe in RECIPES:
        base = RECIPES[recipe]
    else:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return base.replace(**overrides) if overrides else base
