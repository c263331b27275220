"""Modules and autograd Functions built on the recipe-driven numerics (no kernel code here)."""

from minite.nn.attention import Attention, attention, varlen_attention
from minite.nn.calibrate import calibrate
from minite.nn.linear import Linear, SegmentedLinear
from minite.nn.moe import MoEExperts, moe_reference
from minite.nn.norm import RMSNorm, rms_norm
from minite.nn.quantized_weight import QuantizedWeight, quantize_weight
from minite.nn.refresh import refresh_quantized_weights
from minite.nn.rope import apply_rope, rope_cos_sin, rope_inv_freq

__all__ = [
    "Attention", "Linear", "MoEExperts", "QuantizedWeight", "RMSNorm", "SegmentedLinear", "apply_rope",
    "attention", "calibrate", "moe_reference", "quantize_weight", "refresh_quantized_weights", "rms_norm",
    "rope_cos_sin", "rope_inv_freq", "varlen_attention",
]
