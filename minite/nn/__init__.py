"""Modules and autograd Functions built on the recipe-driven numerics (no kernel code here)."""

from minite.nn.calibrate import calibrate
from minite.nn.linear import Linear
from minite.nn.moe import MoEExperts, moe_reference
from minite.nn.quantized_weight import QuantizedWeight, quantize_weight, refresh_quantized_weights

__all__ = [
    "Linear", "MoEExperts", "QuantizedWeight", "calibrate", "moe_reference", "quantize_weight",
    "refresh_quantized_weights",
]
