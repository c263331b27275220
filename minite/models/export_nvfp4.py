"""Write a model's NVFP4 weights as a ModelOpt or compressed-tensors checkpoint (`minite export`).

Each quantized projection (`minite.models.nvfp4_layout`) is written in the format's tensors
(`minite.models.nvfp4_formats`) from the very `QuantizedWeight` the model computes with: its codes,
block scales and global scale, nothing quantized again. An MoE layer's experts are written per expert
(gate and up rows of an expert share its global scale). Everything else (embedding, LM head, norms,
the router, the projections of bf16 layers) is written in bf16 under its Hugging Face name, and the
linears among them are listed as excluded / ignored in the quantization config. Calibrated static
input scales (a static recipe such as `vllm`) are written as the format's input scales; without them
the config declares weights-only NVFP4 (the formats cannot describe per-token activation scales).

Fused groups: vLLM decodes q/k/v (and gate/up) with one weight global scale, the largest of the
group's. Exporting a model whose recipe scales them separately (`fused_scale="separate"`) warns that
the checkpoint will not be served as the model computes; `fused_scale="shared"` quantizes each group
under one scale (`minite.nn.shared_scale`), so the export serves exactly what the model computed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from minite import __version__
from minite.models.checkpoint import to_hf_tensors, write_checkpoint
from minite.models.nvfp4_formats import (
    FIELDS,
    FORMATS,
    MODELOPT_CONFIG,
    SIDECAR,
    global_to_file,
    hex_floats,
    input_to_file,
    modelopt_quant_config,
    quantization_config,
)
from minite.models.nvfp4_layout import checkpoint_modules, is_quantized
from minite.nn.linear import SegmentedLinear
from minite.ref.nvfp4 import global_scales


@torch.no_grad()
def nvfp4_tensors(model, fmt: str) -> tuple[dict[str, torch.Tensor], list[str], dict, bool]:
    """(tensors by Hugging Face name, the linears left in bf16, the sidecar, whether static input
    scales were written)."""
    if fmt not in FORMATS:
        raise ValueError(f"format={fmt!r} is not supported; choose one of {list(FORMATS)}")
    codes_f, scales_f, glob_f, inp_f = FIELDS[fmt]
    tensors = to_hf_tensors(model, torch.bfloat16)
    ignore = [name.removesuffix(".weight") for name in tensors if _is_linear(name, model)]
    modules, static = {}, False
    entries = [e for e in checkpoint_modules(model) if is_quantized(e)]
    for e in entries:
        q = e.quantized_weight().q
        expert = e.part if q.global_scale.ndim else None  # experts: one global scale each
        index = () if expert is None else (expert,)
        codes, sb = q.codes[index][e.rows], q.block_scales[index][e.rows]
        s_dec, amax = q.global_scale.reshape(-1)[expert or 0], q.amax.reshape(-1)[expert or 0]
        s_enc, chain_dec = global_scales(amax, q.chain)
        if not torch.equal(chain_dec, s_dec):  # a container not from our chain (an imported one)
            s_enc = 1.0 / s_dec
        del tensors[f"{e.name}.weight"]
        ignore.remove(e.name)
        tensors[f"{e.name}.{codes_f}"] = codes.cpu().clone()  # own storage: members of one quantization
        tensors[f"{e.name}.{scales_f}"] = sb.cpu().clone()
        tensors[f"{e.name}.{glob_f}"] = global_to_file(fmt, s_dec, s_enc).cpu().clone()
        side = {"s_dec": hex_floats(s_dec), "amax": hex_floats(amax)}
        scale = getattr(e.module, e.input_scale_buffer, None)
        if scale is not None and e.module.recipe.activation.scaling == "static":
            tensors[f"{e.name}.{inp_f}"] = input_to_file(fmt, scale).cpu().clone()
            side["input_scale"] = hex_floats(scale)[0]
            static = True
        modules[e.name] = side
    recipe = getattr(model, "recipe", None)
    sidecar = {"producer": f"minite {__version__}", "format": fmt,
               "recipe": getattr(recipe, "name", None), "fused_scale": getattr(recipe, "fused_scale", None),
               "weight_block": list(recipe.weight.block) if recipe is not None else [1, 16],
               "modules": modules}
    return tensors, sorted(ignore), sidecar, static


def export_nvfp4(model, path: str | Path, fmt: str, overwrite: bool = False,
                 max_shard_size: int | str = "5GB") -> Path:
    """Write `model` as an NVFP4 checkpoint of format `fmt` at `path` (atomically); returns the path."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    if not any(is_quantized(e) for e in checkpoint_modules(model)):
        raise ValueError(f"recipe {model.recipe.name!r} quantizes no weight: export under an NVFP4 recipe")
    tensors, ignore, sidecar, static = nvfp4_tensors(model, fmt)
    _warn_separate_fused_scales(model, fmt)
    config = model.config.to_hf(torch.bfloat16)
    config["quantization_config"] = quantization_config(fmt, ignore, static)
    files = {SIDECAR: sidecar}
    if fmt == "modelopt":
        files[MODELOPT_CONFIG] = modelopt_quant_config(ignore, __version__)
    write_checkpoint(path, tensors, config, files, max_shard_size=max_shard_size)
    return path


def _is_linear(hf_tensor: str, model) -> bool:
    """Whether a bf16 tensor is a linear layer's weight (the projections, the router, the LM head)."""
    if not hf_tensor.endswith(".weight") or hf_tensor.endswith(("norm.weight", "embed_tokens.weight")):
        return False
    return model.lm_head is not None or hf_tensor != "lm_head.weight"


def _warn_separate_fused_scales(model, fmt: str) -> None:
    for module in model.modules():
        if not isinstance(module, SegmentedLinear) or not module.recipe.fp4:
            continue
        scales = [qw.global_scale for qw in module.quantized_weights()]
        if not all(torch.equal(s, scales[0]) for s in scales):
            warnings.warn(f"fused projections carry separate weight global scales ({fmt} readers such as "
                          "vLLM decode a fused group with its largest): this export will not serve the "
                          "numbers the model computes; quantize under fused_scale='shared' for one that does",
                          stacklevel=3)
            return
