"""Weight sync: quantize once per update and share; or ship codes and scales to another model.

Separate sampler (another recipe, the naive deployment): `sync_sampler_model(sampler, learner)`
quantizes the learner's weights with the sampler's own recipe and chain. A sampler-only model
(`minite.nn.sampler_weights`, what the trainer builds) receives them straight into its NVFP4
containers: the sampler side keeps no bf16 copy of a quantized layer; its other tensors (embeddings,
norms, router, LM head, bf16 layers) are copied.

Colocated (one process, one device): the sampler runs the *same model object* as the learner. After
each optimizer step `sync_weights(model)` quantizes every NVFP4 weight once; each module caches its
`QuantizedWeight` keyed on the parameter's version, so the learner's next forward and every sampler
forward reuse that very object (no copy, no second quantizer) until the next step changes the weight.

Elsewhere (another model instance, later another process): `export_quantized_weights(model)` returns
a payload of plain tensors, the NVFP4 container of each quantized weight (codes, block scales, global
scales, amax) plus every other tensor as is (embeddings, norms, router, LM head, unquantized layers,
calibrated static input scales). `load_quantized_weights(model, payload)` installs it into a model
built with the same config and recipe WITHOUT quantizing anything: the exact unscaled operand
`e2m1 * s_b` is rebuilt from codes and scales (a decode, exact: docs/facts.md), the module's full-precision
weight is set to the dequantized values, and the `QuantizedWeight` is pinned to that weight's
version (a sampler-only model takes the containers alone). Forward outputs of the two models are then
bitwise equal.

Payload layout: {"recipe": name, "quantized": {"<module>.<weight>": {codes, block_scales,
global_scale, amax, shape, block, scaling, chain, hadamard}}, "tensors": {name: tensor}}; a segmented
projection's weight as {"segments": [one container per segment]} (each quantized as its own tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from minite.nn.calibrate import STATIC_SCALE_BUFFERS
from minite.nn.linear import Linear, SegmentedLinear
from minite.nn.moe import EXPERT_WEIGHTS, MoEExperts
from minite.nn.quantized_weight import QuantizedWeight, deferred_finite_checks, is_released
from minite.nn.refresh import refresh_quantized_weights
from minite.nn.sampler_weights import install_packed, is_sampler_only, quantize_from, quantized_layers
from minite.nvfp4 import NVFP4Tensor

CONTAINER_TENSORS = ("codes", "block_scales", "global_scale", "amax")
CONTAINER_META = ("shape", "block", "scaling", "chain", "hadamard")


def sync_weights(model: nn.Module) -> int:
    """Quantize every NVFP4 weight of `model` once, now; returns the number of modules refreshed."""
    return refresh_quantized_weights(model)


@torch.no_grad()
def sync_sampler_model(sampler_model: nn.Module, learner_model: nn.Module) -> None:
    """A sampler with its own model and recipe (the naive deployment): the learner's current weights
    (the model's parameters, not the optimizer's fp32 masters) quantized once with the sampler's own
    recipe and chain, as a separate inference engine does after a weight update: straight into the
    containers of a sampler-only model, else copied into its parameters and quantized there. Both
    models have one config; static input scales stay the sampler's own."""
    src = dict(learner_model.named_parameters())
    dst = dict(sampler_model.named_parameters())
    if src.keys() != dst.keys():
        missing, extra = sorted(src.keys() - dst.keys())[:4], sorted(dst.keys() - src.keys())[:4]
        raise ValueError(f"the sampler's model does not match the learner's: missing {missing}, "
                         f"unexpected {extra}")
    targets = quantized_layers(sampler_model) if is_sampler_only(sampler_model) else {}
    with deferred_finite_checks():  # one host sync for all the weights
        for name, p in dst.items():
            if name in targets:
                module, leaf = targets[name]
                _check_shape(p, src[name], name)
                install_packed(module, leaf, quantize_from(module, leaf, src[name]))
            else:
                _copy(p, src[name], name)
    if not targets:
        refresh_quantized_weights(sampler_model)


def quantized_weights(model: nn.Module) -> dict[str, QuantizedWeight]:
    """The `QuantizedWeight` objects the model's forward uses now, by "<module>.<weight>" name, a
    segmented projection's by "<module>.weight.<segment>" (quantizing only those whose cache is stale)."""
    out = {}
    for name, (module, leaf) in _quantized_targets(model).items():
        if isinstance(module, SegmentedLinear):
            out.update({f"{name}.{j}": qw for j, qw in enumerate(module.quantized_weights())})
        else:
            out[name] = module.quantized_weight() if leaf == "weight" else module.quantized_weight(leaf)
    return out


def _container(qw: QuantizedWeight) -> dict:
    q = qw.q
    return {**{k: getattr(q, k).detach().clone() for k in CONTAINER_TENSORS},
            **{k: getattr(q, k) for k in CONTAINER_META}}


@torch.no_grad()
def export_quantized_weights(model: nn.Module) -> dict:
    """Payload of codes and scales (+ the unquantized tensors) for `load_quantized_weights`."""
    quantized = {}
    for name, (module, leaf) in _quantized_targets(model).items():
        if isinstance(module, SegmentedLinear):
            quantized[name] = {"segments": [_container(qw) for qw in module.quantized_weights()]}
        else:
            quantized[name] = _container(module.quantized_weight() if leaf == "weight"
                                         else module.quantized_weight(leaf))
    tensors = {name: p.detach().clone() for name, p in model.named_parameters() if name not in quantized}
    for name, b in model.named_buffers():
        if name.rsplit(".", 1)[-1] in STATIC_SCALE_BUFFERS:
            tensors[name] = b.detach().clone()
    return {"recipe": getattr(getattr(model, "recipe", None), "name", None), "quantized": quantized,
            "tensors": tensors}


@torch.no_grad()
def load_quantized_weights(model: nn.Module, payload: dict) -> None:
    """Install a payload from `export_quantized_weights` into `model` (same config and recipe) without
    quantizing. Raises ValueError when the model's quantized layers or shapes do not match."""
    params = dict(model.named_parameters())
    targets = _quantized_targets(model)
    if set(targets) != set(payload["quantized"]):
        missing, extra = set(targets) - set(payload["quantized"]), set(payload["quantized"]) - set(targets)
        raise ValueError(f"the model's NVFP4 weights do not match the payload ({payload['recipe']!r}): "
                         f"missing {sorted(missing)[:4]}, unexpected {sorted(extra)[:4]}")
    for name, t in payload["tensors"].items():
        if name in params:
            _copy(params[name], t, name)
        else:
            prefix, _, leaf = name.rpartition(".")
            module = model.get_submodule(prefix)
            setattr(module, leaf, t.to(_device(model)).clone())
    for name, fields in payload["quantized"].items():
        module, leaf = targets[name]
        if isinstance(module, SegmentedLinear):
            parts = fields.get("segments", ()) if isinstance(fields, dict) else ()
            if len(parts) != len(module.widths):
                raise ValueError(f"{name}: payload has {len(parts)} segments, the model {len(module.widths)}")
            qws = [_install(f"{name}.{j}", f, p, module)
                   for j, (f, p) in enumerate(zip(parts, module.segments()))]
            if is_released(module.weight):
                install_packed(module, leaf, qws)
            else:
                module.set_quantized_weights(qws)
        elif is_released(getattr(module, leaf)):  # a sampler-only model: the containers only
            install_packed(module, leaf, _install(name, fields, getattr(module, leaf), module))
        elif leaf == "weight":
            module.set_quantized_weight(_install(name, fields, module.weight, module))
        else:
            module.set_quantized_weight(leaf, _install(name, fields, getattr(module, leaf), module))


def _install(name: str, fields: dict, param: torch.Tensor, module: nn.Module) -> QuantizedWeight:
    """The payload container `fields` as the QuantizedWeight of `param` (set to its dequantized values)."""
    spec = module.recipe.weight
    q = NVFP4Tensor(**{k: fields[k].to(param.device) for k in CONTAINER_TENSORS},
                    **{k: fields[k] for k in CONTAINER_META})
    if (tuple(q.shape) != tuple(param.shape) or q.block != tuple(spec.block) or q.scaling != spec.scaling
            or q.chain != spec.chain or q.hadamard != spec.hadamard):
        raise ValueError(f"{name}: payload {q.shape} {q.block}/{q.scaling}/{q.chain} does not match the "
                         f"model's {tuple(param.shape)} under recipe {module.recipe.name!r}")
    if is_released(param) or (isinstance(module, SegmentedLinear) and is_released(module.weight)):
        return QuantizedWeight(q, None, spec, key=())  # a sampler-only model: the container alone
    n = param.shape[-2]
    unscaled = q.unscaled()[..., :n, :].to(torch.bfloat16)  # drop rows padded to a 16x16 tile
    qw = QuantizedWeight(q, unscaled, spec, key=())
    param.copy_(qw.dequantize())
    return qw


def _quantized_targets(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """{payload name (the parameter's): (module, the weight's name in it)}."""
    out = {}
    for prefix, module in model.named_modules():
        if isinstance(module, Linear) and module.recipe.fp4:
            out[_join(prefix, "weight")] = (module, "weight")
        elif isinstance(module, MoEExperts) and module.recipe.fp4:
            for name in EXPERT_WEIGHTS:
                out[_join(prefix, name)] = (module, name)
    return out


def _copy(param: torch.Tensor, t: torch.Tensor, name: str) -> None:
    _check_shape(param, t, name)
    param.copy_(t)


def _check_shape(param: torch.Tensor, t: torch.Tensor, name: str) -> None:
    if param.shape != t.shape:
        raise ValueError(f"{name}: payload shape {tuple(t.shape)} != model shape {tuple(param.shape)}")


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
