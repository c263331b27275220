"""A sampler-only `Qwen3` built part by part: never the whole bf16 model on the device.

`build_sampler_model(config, recipe, fill, device=..., dtype=...)` makes the model's skeleton on the
meta device, then its parts in order (the embeddings, each decoder layer, the final norm, the LM head):
each is allocated on the device, filled, and its NVFP4 weights are quantized there and released
(`minite.nn.sampler_weights.to_sampler_weights`) before the next part is made. Peak memory: the
sampler form plus one part's bf16 weights (a Qwen3-30B-A3B layer's experts: 1.2 GB in bf16).

Fills, `fill(prefix, part)` writing the part's parameters in place:
- `random_fill(seed, std)`: `Qwen3.init_weights`' draws, part by part (the very weights `init_weights`
  gives the whole model from a generator on the device seeded with `seed`);
- `state_fill(state)`: a mapping of our parameter names to tensors (anywhere; copied to the device);
- `checkpoint_fill(path)`: a Hugging Face directory, each part's tensors read when it is made
  (`load_sampler_model(path, recipe)` also reads the config). NVFP4 checkpoints (ModelOpt,
  compressed-tensors) load with `load_pretrained` on the host, then `sampler_model_from(model, device)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

from minite.models.checkpoint import read_config, read_state
from minite.models.config import ModelConfig
from minite.models.qwen3 import Qwen3, init_parameters
from minite.nn.sampler_weights import to_sampler_weights
from minite.recipe import Recipe

Fill = Callable[[str, nn.Module], None]


def model_parts(model: Qwen3) -> list[tuple[str, nn.Module]]:
    """(prefix, module) of the model's parts in parameter order: embeddings, layers, norm, LM head."""
    parts = [("embed_tokens", model.embed_tokens)]
    parts += [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    parts.append(("norm", model.norm))
    if model.lm_head is not None:
        parts.append(("lm_head", model.lm_head))
    return parts


@torch.no_grad()
def build_sampler_model(config: ModelConfig, recipe: str | Recipe, fill: Fill, *,
                        device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                        progress: Callable[[str], None] | None = None) -> Qwen3:
    """The sampler-only model of `config` under `recipe` on `device`, filled part by part (module
    docstring). `progress(message)` hears of each part made."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Qwen3(config, recipe).to(dtype)
    parts = model_parts(model)
    for i, (prefix, part) in enumerate(parts):
        part.to_empty(device=device)
        fill(prefix, part)
        to_sampler_weights(part)
        if progress is not None:
            progress(f"sampler model: {prefix} ({i + 1}/{len(parts)})")
    return model.eval()


@torch.no_grad()
def sampler_model_from(model: Qwen3, device: str | torch.device) -> Qwen3:
    """`model` (on the host) moved to `device` part by part, each part turned into its sampler form on
    arrival; in place, returns `model`."""
    for _, part in model_parts(model):
        part.to(device)
        to_sampler_weights(part)
    return model.eval()


def random_fill(seed: int, std: float = 0.02, device: str | torch.device = "cpu") -> Fill:
    """Random weights: the draws `Qwen3.init_weights(std, torch.Generator(device).manual_seed(seed))`
    makes on the whole model, part by part."""
    generator, local = torch.Generator(device).manual_seed(seed), {}

    def fill(prefix: str, part: nn.Module) -> None:
        init_parameters(part, std, generator, prefix, local)

    return fill


def state_fill(state: Mapping[str, torch.Tensor]) -> Fill:
    """Weights from `state` (our parameter names, e.g. a model's `state_dict()`)."""

    def fill(prefix: str, part: nn.Module) -> None:
        for name, param in part.named_parameters(prefix=prefix):
            if name not in state:
                raise KeyError(f"the state has no tensor {name!r}")
            t = state[name]
            if tuple(t.shape) != tuple(param.shape):
                raise ValueError(f"{name}: state shape {tuple(t.shape)} != model shape {tuple(param.shape)}")
            param.copy_(t)

    return fill


def checkpoint_fill(path: str | Path) -> Fill:
    """Weights from the Hugging Face directory `path`, each part's tensors read when it is made."""

    def fill(prefix: str, part: nn.Module) -> None:
        params = dict(part.named_parameters(prefix=prefix))
        device = next(iter(params.values())).device
        dtype = next(iter(params.values())).dtype
        state = read_state(path, {n: p for n, p in params.items()}, dtype, device)
        for name, param in params.items():
            param.copy_(state.pop(name))

    return fill


def load_sampler_model(path: str | Path, recipe: str | Recipe, *, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.bfloat16,
                       progress: Callable[[str], None] | None = None) -> Qwen3:
    """The sampler-only model of the Hugging Face checkpoint at `path` (bf16 weights), part by part."""
    return build_sampler_model(read_config(path), recipe, checkpoint_fill(path), device=device, dtype=dtype,
                               progress=progress)
