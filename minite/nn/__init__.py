"""Modules and autograd Functions built on the recipe-driven numerics (no kernel code here)."""

from minite.nn.linear import Linear

__all__ = ["Linear"]
