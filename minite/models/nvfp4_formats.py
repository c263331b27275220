"""The two NVFP4 checkpoint formats miniTE writes and reads: tensors per quantized linear, configs.

Per quantized linear `{m}` (N out-features, K in-features; decode in both: x = e2m1 * s_b * S_dec):

| what | ModelOpt (`NVFP4`) | compressed-tensors (`nvfp4-pack-quantized`) |
| --- | --- | --- |
| codes, uint8 [N, K/2] (even element: low nibble) | `weight` | `weight_packed` |
| block scales, float8_e4m3fn [N, K/16] | `weight_scale` | `weight_scale` |
| weight global scale, float32 | `weight_scale_2` [] = S_dec | `weight_global_scale` [1] = S_enc |
| static activation scale, float32 | `input_scale` [] = decode | `input_global_scale` [1] = encode |

Config: ModelOpt writes `quantization_config` {"quant_method": "modelopt", "quant_algo": "NVFP4",
"group_size": 16, "exclude_modules": [...]} in config.json and the same under "quantization" in
`hf_quant_config.json`; compressed-tensors writes {"quant_method": "compressed-tensors", "format":
"nvfp4-pack-quantized", "config_groups": {...: {"targets": ["Linear"], "weights": 4-bit float,
tensor_group, group 16, ...}}, "ignore": [...]}. Sources: docs/export.md.

Everything the formats cannot hold exactly (our weight amax, which TE's GEMM alpha uses; S_dec where
the file holds 1 / S_dec; the exact static input scale) goes into `minite_nvfp4.json` beside them,
which other readers ignore and our import uses where it agrees with the format's own tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from minite.models.hf_layout import CheckpointError

FORMATS = ("modelopt", "compressed-tensors")
CT_FORMAT = "nvfp4-pack-quantized"
MODELOPT_CONFIG = "hf_quant_config.json"
SIDECAR = "minite_nvfp4.json"
GROUP = 16

# the tensor suffixes of one quantized linear: codes, block scales, global scale, static input scale
FIELDS = {
    "modelopt": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
}


def detect(path: Path, hf_config: dict) -> str | None:
    """The NVFP4 format of the checkpoint at `path`, None for an unquantized one; a quantization this
    reader does not take is refused by name."""
    qc = hf_config.get("quantization_config")
    if qc is None and (path / MODELOPT_CONFIG).is_file():  # ModelOpt exports without config.json's copy
        quantization = json.loads((path / MODELOPT_CONFIG).read_text()).get("quantization", {})
        qc = {"quant_method": "modelopt", **quantization}
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "modelopt" and qc.get("quant_algo") == "NVFP4":
        return "modelopt"
    if method == "compressed-tensors" and qc.get("format") == CT_FORMAT:
        return "compressed-tensors"
    what = qc.get("quant_algo") if method == "modelopt" else qc.get("format")
    raise CheckpointError(f"{path}: quantization {method!r} / {what!r} is not supported; miniTE reads NVFP4 "
                          f"checkpoints of ModelOpt (quant_algo NVFP4) and compressed-tensors ({CT_FORMAT})")


def global_to_file(fmt: str, s_dec: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    return s_dec.reshape(()).float() if fmt == "modelopt" else s_enc.reshape(1).float()


def global_from_file(fmt: str, t: torch.Tensor) -> torch.Tensor:
    """The file's weight global scale -> S_dec, fp32 []."""
    t = t.float().reshape(())
    return t if fmt == "modelopt" else 1.0 / t


def input_to_file(fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Our static input scale (decode: calibrated amax / 2688) -> the file's."""
    return scale.reshape(()).float() if fmt == "modelopt" else (1.0 / scale.float()).reshape(1)


def input_from_file(fmt: str, t: torch.Tensor) -> torch.Tensor:
    t = t.float().reshape(())
    return t if fmt == "modelopt" else 1.0 / t


def quantization_config(fmt: str, ignore: list[str], static_inputs: bool) -> dict:
    """config.json's `quantization_config`: `ignore` names the linears kept in bf16; W4A4 with static
    activation scales where the model has them, else weight-only (the format cannot describe dynamic
    per-token activation scales)."""
    if fmt == "modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP,
                "kv_cache_quant_algo": None, "exclude_modules": ignore}
    args = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP,
            "strategy": "tensor_group"}
    inputs = {**args, "dynamic": "local"} if static_inputs else None
    scheme = {"targets": ["Linear"], "weights": {**args, "dynamic": False}, "input_activations": inputs,
              "format": CT_FORMAT}
    return {"quant_method": "compressed-tensors", "format": CT_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": scheme}, "ignore": ignore, "kv_cache_scheme": None}


def modelopt_quant_config(ignore: list[str], version: str) -> dict:
    """ModelOpt's `hf_quant_config.json`."""
    return {"producer": {"name": "minite", "version": version},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": GROUP,
                             "exclude_modules": ignore}}


def hex_floats(t: torch.Tensor) -> list[str]:
    return [float(v).hex() for v in t.reshape(-1).tolist()]


def from_hex(values: list[str]) -> torch.Tensor:
    return torch.tensor([float.fromhex(v) for v in values], dtype=torch.float32)
