"""Qwen3 dense and Qwen3-MoE models on recipe-driven modules, with Hugging Face checkpoint load/save."""

from minite.models.checkpoint import CheckpointError, load_pretrained, save_pretrained
from minite.models.config import ModelConfig, UnsupportedConfigError, tiny_qwen3, tiny_qwen3_moe
from minite.models.qwen3 import Qwen3

__all__ = ["CheckpointError", "ModelConfig", "Qwen3", "UnsupportedConfigError", "load_pretrained",
           "save_pretrained", "tiny_qwen3", "tiny_qwen3_moe"]
