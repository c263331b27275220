"""Hugging Face checkpoints (config.json + safetensors, single file or sharded) to and from `Qwen3`.

Tensor names map one to one (`model.` + our name, `lm_head.weight` as is) except two kinds, and
`minite.models.hf_layout` (`hf_tensors` / `hf_pieces`) is the one place that maps them (the NVFP4
export and import reuse it):

- the segmented projections: our `layers.{l}.self_attn.qkv_proj.weight` [Nq + 2 Nkv, H] is Hugging
  Face's `q_proj`, `k_proj`, `v_proj` weights one after the other, `layers.{l}.mlp.gate_up_proj.weight`
  [2I, H] its `gate_proj` and `up_proj` (`SEGMENTS`);
- the MoE experts: Hugging Face stores each expert's `gate_proj`, `up_proj`, `down_proj` weights
  (`model.layers.{l}.mlp.experts.{e}.gate_proj.weight` [I, H], ...), we keep them fused per layer as
  `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj` [E, H, I]. Loading also accepts
  the fused names transformers 5 uses in memory (`model.layers.{l}.mlp.experts.gate_up_proj`); saving
  writes per-expert tensors, the format of published Qwen3-MoE checkpoints.

Saving writes into a temporary sibling directory and renames it into place, so a crash never leaves
a half-written checkpoint at `path`; the split into shards and the index are huggingface_hub's
(`split_torch_state_dict_into_shards`: the file names and index transformers writes).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from minite.files import WriteError, writing
from minite.models.config import ModelConfig, UnsupportedConfigError
from minite.models.hf_layout import (  # noqa: F401 (re-exported for the callers of checkpoint)
    EXPERT_PARAM,
    SEGMENTED_PARAM,
    SEGMENTS,
    CheckpointError,
    expert_pieces,
    from_hf_pieces,
    fused_expert_name,
    hf_name,
    hf_pieces,
    hf_tensors,
    segment_pieces,
    segment_widths,
)
from minite.models.import_nvfp4 import NVFP4Checkpoint
from minite.models.qwen3 import Qwen3
from minite.nn.quantized_weight import is_released
from minite.recipe import Recipe

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
def to_hf_tensors(model: Qwen3, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names (segmented projections and experts split),
    contiguous, on CPU."""
    if any(is_released(p) for p in model.parameters()):
        raise CheckpointError("a sampler-only model holds NVFP4 codes, not weights: save the full model, or "
                              "export its codes and scales (minite export)")
    out = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu", dtype or tensor.dtype)
        pieces = hf_tensors(name, tensor, model.config)
        # pieces of one tensor are views of it: each its own copy (safetensors shares no storage)
        out.update({hf: t.clone() if len(pieces) > 1 else t.contiguous() for hf, t in pieces.items()})
    return out


def read_json(file: Path) -> dict:
    """A JSON object from `file`; a parse error names the file, the line and the column."""
    try:
        data = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise CheckpointError(f"{file} is not a text file; restore or re-download it") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                              "fix it or re-download the model") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} holds a JSON {type(data).__name__}, expected an object")
    return data


def open_safetensors(file: str | Path):
    """`safe_open(file)`, a truncated or corrupt file named as such (safetensors checks the header and
    that the data covers every tensor when opening, so nothing has been read yet)."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist" if not file.exists() else f"{file} is not a file")
    try:
        return safe_open(file, "pt")
    except SafetensorError as e:
        detail = str(e).removeprefix("Error while deserializing header: ")
        raise CheckpointError(f"{file} is not a valid safetensors file ({detail}); it may be truncated "
                              "or corrupt: re-download or re-save it") from None


def _hf_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist")
    return read_json(file)


def read_config(path: str | Path) -> ModelConfig:
    """Parse `path/config.json`; a bad field is named with the file."""
    file = Path(path) / "config.json"
    return _model_config(_hf_config(Path(path)), file)


def _model_config(hf_config: dict, file: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(hf_config)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{file}: {e}") from None


def load_pretrained(path: str | Path, recipe: str | Recipe = "aligned", dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> Qwen3:
    """Build a `Qwen3` from a Hugging Face model directory; `dtype` defaults to config.json's (else bf16).
    A ModelOpt or compressed-tensors NVFP4 checkpoint keeps its codes and scales as they are
    (`minite.models.import_nvfp4`)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a model folder (config.json and safetensors)"
                              if path.exists() else f"{path} does not exist")
    hf_config = _hf_config(path)
    config = _model_config(hf_config, path / "config.json")
    dtype = dtype or _config_dtype(hf_config)
    files = _tensor_files(path)
    with torch.device("meta"):
        model = Qwen3(config, recipe)
    expected = model.state_dict()
    nvfp4 = NVFP4Checkpoint.open(path, hf_config, model, files)  # None: not an NVFP4 checkpoint
    quantized = {}
    if nvfp4 is not None:  # its quantized modules are read apart, the rest as usual
        quantized = nvfp4.read(_Reader(files), dtype, device)
        files = {k: f for k, f in files.items() if k not in nvfp4.tensors}
        expected = {k: v for k, v in expected.items() if k not in nvfp4.params}
    state = {**_read_state(path, files, expected, config, dtype, device), **quantized}
    model.load_state_dict(state, strict=True, assign=True)
    if nvfp4 is not None:
        nvfp4.install(model)
    return model


def save_pretrained(model: Qwen3, path: str | Path, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None, overwrite: bool = False) -> None:
    """Write config.json and safetensors (sharded above `max_shard_size`, with an index) atomically."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    tensors = to_hf_tensors(model, dtype)
    config = model.config.to_hf(dtype or next(iter(tensors.values())).dtype)
    write_checkpoint(path, tensors, config, max_shard_size=max_shard_size)


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], config: dict,
                     json_files: dict | None = None, max_shard_size: int | str = "5GB") -> None:
    """config.json, the safetensors (sharded above `max_shard_size` by huggingface_hub's splitter, with
    an index) and further JSON files {name: object} written into a temporary sibling directory, then
    renamed to `path`."""
    split = split_torch_state_dict_into_shards(tensors, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=_parse_size(max_shard_size))
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    with writing(path):
        tmp.mkdir(parents=True)
    try:
        for name, obj in {"config.json": config, **(json_files or {})}.items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        for file, names in split.filename_to_tensors.items():
            _save_file({name: tensors[name] for name in names}, tmp / file, path)
        if split.is_sharded:
            index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
            (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        swap_into_place(tmp, path)
    except OSError as e:  # a full disk or permissions: named by the checkpoint's path
        shutil.rmtree(tmp, ignore_errors=True)
        raise (e if isinstance(e, WriteError) else WriteError(path, e)) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _save_file(tensors: dict[str, torch.Tensor], file: Path, target: Path) -> None:
    """safetensors' `save_file`; its I/O failures (a Rust `IoError` wrapped in `SafetensorError`) become
    the `OSError` they are, so that a full disk reads as one."""
    try:
        save_file(tensors, file, metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"code: (\d+)", str(e))
        raise WriteError(target, OSError(int(code.group(1)) if code else None, str(e))) from e


def read_state(path: str | Path, expected: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
               device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors named in `expected` (our names -> tensors of their shapes, e.g. on the meta device:
    a part of a model) read from the Hugging Face directory `path`, in `dtype` (default: config.json's)
    on `device`; the checkpoint's other tensors are left unread (a model read part by part)."""
    path = Path(path)
    hf_config = _hf_config(path)
    config = _model_config(hf_config, path / "config.json")
    files = _tensor_files(path)
    wanted = set()
    for name, meta in expected.items():
        fused = bool(EXPERT_PARAM.match(name)) and fused_expert_name(name) in files
        wanted.update(hf for hf, _ in hf_pieces(name, meta.shape, config, fused_experts=fused))
    if config.tie_word_embeddings and "embed_tokens.weight" in expected:
        wanted.add("lm_head.weight")
    part = {name: f for name, f in files.items() if name in wanted}
    return _read_state(path, part, expected, config, dtype or _config_dtype(hf_config), device)


def _tensor_files(path: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{path / INDEX} has no weight_map")
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise CheckpointError(f"shard {file.name} named in {INDEX} does not exist")
        return files
    if (path / SINGLE).is_file():
        with open_safetensors(path / SINGLE) as f:
            return {name: path / SINGLE for name in f.keys()}  # noqa: SIM118
    raise CheckpointError(f"{path} has neither {SINGLE} nor {INDEX}")


def _read_state(path: Path, files: dict[str, Path], expected: dict, config: ModelConfig,
                dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Read, check and assemble every tensor of `expected` (our names) from the checkpoint `files`."""
    plan = {}  # our name -> list of (hf name, expected shape)
    for name, meta in expected.items():
        fused = bool(EXPERT_PARAM.match(name)) and fused_expert_name(name) in files
        plan[name] = hf_pieces(name, meta.shape, config, fused_experts=fused)
    wanted = {hf for pieces in plan.values() for hf, _ in pieces}
    tied_head = config.tie_word_embeddings and "lm_head.weight" in files
    missing = sorted(wanted - files.keys())
    extra = sorted(files.keys() - wanted - ({"lm_head.weight"} if tied_head else set()))
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks tensor {missing[0]}" + _more(missing))
    if extra:
        raise CheckpointError(f"checkpoint {path} has unexpected tensor {extra[0]}" + _more(extra))
    reader = _Reader(files)
    try:
        state = {}
        for name, pieces in plan.items():
            parts = [reader.get(hf, shape) for hf, shape in pieces]
            state[name] = from_hf_pieces(name, parts).to(device=device, dtype=dtype)
        if tied_head:
            head = reader.get("lm_head.weight", tuple(expected["embed_tokens.weight"].shape))
            if not torch.equal(head.to(dtype), state["embed_tokens.weight"].cpu()):
                raise CheckpointError("tie_word_embeddings is true but tensor lm_head.weight differs from "
                                      "model.embed_tokens.weight")
    finally:
        reader.close()
    return state


class _Reader:
    """Lazily opened safetensors files; `get` checks the tensor's shape."""

    def __init__(self, files: dict[str, Path]):
        self.files, self.open = files, {}

    def get(self, name: str, shape: tuple[int, ...] | None) -> torch.Tensor:
        file = self.files[name]
        if file not in self.open:
            self.open[file] = open_safetensors(file)
        handle = self.open[file]
        if name not in handle.keys():  # noqa: SIM118
            raise CheckpointError(f"tensor {name} is listed in {INDEX} but missing from {file.name}")
        tensor = handle.get_tensor(name)
        if shape is not None and tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)} in {file}, expected "
                                  f"{list(shape)}")
        return tensor

    def close(self) -> None:
        self.open.clear()


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more: {names[1:4]}...)" if len(names) > 1 else ""


def _config_dtype(hf_config: dict) -> torch.dtype:
    name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"config.json dtype={name!r} is not a torch dtype")
    return dtype


def _parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '5GB' (10^9) or '500MiB' (2^20)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B\s*", size.upper().replace("IB", "iB"))
    if not match:
        raise ValueError(f"max_shard_size={size!r}: use bytes or a string like '5GB' / '500MiB'")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit or " "))


def swap_into_place(tmp: Path, path: Path) -> None:
    """Rename `tmp` to `path`; an existing `path` is moved aside first and removed after."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
