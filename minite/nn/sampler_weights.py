"""The sampler-only form of a model: `to_sampler_weights(model)`.

A model that only samples needs, of each NVFP4 layer, the container (codes, block scales, global
scales) and the decode layout; the learner's bf16 parameter and the exact bf16 copy `e2m1 * s_b`
(`QuantizedWeight.unscaled`) are what a *trainable* model keeps. `to_sampler_weights` quantizes each
NVFP4 weight (where not done yet), keeps its `QuantizedWeight.packed` form, makes the decode layout
where the decode GEMMs will read it, and releases the parameter (`quantized_weight.release`: a
placeholder of one element). Embeddings, LM head, norms, the router and the recipe's bf16 layers stay
as they are.

Outputs are bitwise the full model's: every row count reads the decode layout, in row tiles above the
decode thresholds (`grouped_decode.decode_gemm_rows`, the grouped decode kernel: the aligned K order,
the same bits as the bf16 copy); the reference backend (CPU) multiplies a copy made for the call.
Segmented projections run their segments as one launch on their decode layouts concatenated along N
(`minite.nn.segmented_decode`), the same bits.

The form is for sampling: the quantized layers have no backward (a clear error), their recipe and
weights are fixed (re-quantizing a released parameter is an error), and the model is used on the
device it was converted on (`model.to(device)` would materialize the placeholders). New weights reach
it as quantized weights (`quantize_from` another model's parameter, then `install_packed`: what
`learner.weight_sync.sync_sampler_model` does), its static scales through a model that holds the
weights (`minite.nn.calibrate.calibrate_through`).
"""

from __future__ import annotations

import torch
from torch import nn

from minite.nn.linear import Linear, SegmentedLinear, _quantize_segments
from minite.nn.moe import EXPERT_WEIGHTS, MoEExperts
from minite.nn.nvfp4_matmul import use_grouped_kernels, use_kernels
from minite.nn.quantized_weight import QuantizedWeight, is_released, quantize_weight, release, weight_key
from minite.nn.shared_scale import quantize_shared


@torch.no_grad()
def to_sampler_weights(model: nn.Module) -> nn.Module:
    """Turn every NVFP4 layer of `model` into its sampler form, in place (module docstring); returns
    `model`. Layers already in that form are left as they are."""
    for module in list(model.modules()):
        for name, qws in _quantized(module).items():
            install_packed(module, name, qws)
    return model


def is_sampler_only(model: nn.Module) -> bool:
    """Whether some layer of `model` holds only its NVFP4 codes (`to_sampler_weights`)."""
    return any(is_released(p) for p in model.parameters())


def quantized_layers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """{parameter name: (module, weight name in it)} of every NVFP4 weight of `model`."""
    out = {}
    for prefix, module in model.named_modules():
        for name in nvfp4_weight_names(module):
            out[f"{prefix}.{name}" if prefix else name] = (module, name)
    return out


def install_packed(module: nn.Module, name: str, qweights) -> None:
    """Install `qweights` (one `QuantizedWeight` of `module.<name>`, or one per segment of a
    `SegmentedLinear`) in the sampler form and release the parameter."""
    qws = (qweights,) if isinstance(qweights, QuantizedWeight) else tuple(qweights)
    param = getattr(module, name)
    stub = param if is_released(param) else release(param)
    if stub is not param:
        setattr(module, name, stub)
    spec = module.recipe.weight
    if isinstance(module, SegmentedLinear):
        views = module.segments()
        if len(qws) != len(views) or any(q.shape != tuple(v.shape) for q, v in zip(qws, views)):
            raise ValueError(f"{len(qws)} quantized weights {[q.shape for q in qws]} do not fit {module!r}")
        packed = [_prepare(q, module, v.device).packed(weight_key(v, spec)) for q, v in zip(qws, views)]
        module.install_quantized_weights(packed)
        return
    (qw,) = qws
    if qw.shape != tuple(stub.shape) or qw.spec != spec:
        raise ValueError(f"quantized weight {qw.shape} / {qw.spec} does not fit {name!r} of {module!r}")
    packed = _prepare(qw, module, stub.device).packed(weight_key(stub, spec))
    if isinstance(module, MoEExperts):
        module._qweights[name] = packed
    else:
        module._qweight = packed


def nvfp4_weight_names(module: nn.Module) -> tuple[str, ...]:
    """The names of `module`'s own weights that its recipe quantizes to NVFP4 (none for bf16 modules)."""
    if isinstance(module, Linear) and module.recipe.fp4:
        return ("weight",)
    if isinstance(module, MoEExperts) and module.recipe.fp4:
        return EXPERT_WEIGHTS
    return ()


def _quantized(module: nn.Module) -> dict[str, object]:
    """{weight name: its quantized weight(s)} of the NVFP4 weights of `module` still holding their
    bf16 parameter (quantized now where the cache is stale)."""
    out = {}
    for name in nvfp4_weight_names(module):
        if is_released(getattr(module, name)):
            continue
        if isinstance(module, SegmentedLinear):
            out[name] = module.quantized_weights()
        elif isinstance(module, MoEExperts):
            out[name] = module.quantized_weight(name)
        else:
            out[name] = module.quantized_weight()
    return out


def _prepare(qw: QuantizedWeight, module: nn.Module, device: torch.device) -> QuantizedWeight:
    """`qw` with the decode layout made where the module's decode GEMMs read it (kernels on, a decode
    threshold above 0 or the fast mode, K a multiple of the layout's column group)."""
    from minite.kernels import lazy

    recipe, e = module.recipe, module.recipe.execution
    if isinstance(module, MoEExperts):
        runs, threshold = use_grouped_kernels(recipe, device), e.decode_max_rows_per_expert
    else:
        runs, threshold = use_kernels(recipe, device), e.decode_max_m
    if runs and (threshold > 0 or e.fast) and qw.shape[-1] % lazy.decode_gemm.KGROUP == 0:
        qw.decode_weight(lazy.gemm.operand_dtype(device))
    return qw


@torch.no_grad()
def quantize_from(module: nn.Module, name: str, source: torch.Tensor):
    """`module.<name>`'s quantized weight(s) (one per segment of a `SegmentedLinear`) made from
    `source` (another model's parameter of that shape, e.g. the learner's) with the module's recipe, on
    the module's device: what the module would quantize from its own parameter holding `source`."""
    spec = module.recipe.weight
    src = source.detach().to(getattr(module, name).device)
    if isinstance(module, SegmentedLinear):
        views = [src[a:b] for a, b in zip(module.offsets, module.offsets[1:])]
        if module.recipe.fused_scale == "shared":
            return quantize_shared(src, module.offsets, views, spec)
        return _quantize_segments(views, spec)
    return quantize_weight(src, spec)
