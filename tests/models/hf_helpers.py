"""Build random-weight transformers Qwen3 / Qwen3-MoE models from our tiny configs (nothing downloaded)."""

from __future__ import annotations

import torch
import transformers

from minite.models.config import ModelConfig


def hf_config(config: ModelConfig):
    """The transformers config object for `config` (eager attention, fp32)."""
    cls = transformers.Qwen3MoeConfig if config.is_moe else transformers.Qwen3Config
    hf = cls(**config.to_hf())
    hf._attn_implementation = "eager"
    return hf


@torch.no_grad()
def random_hf_model(config: ModelConfig, seed: int = 0):
    """A transformers model whose every parameter (norms included) is random, so no mapping error hides."""
    cls = transformers.Qwen3MoeForCausalLM if config.is_moe else transformers.Qwen3ForCausalLM
    model = cls(hf_config(config)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()
