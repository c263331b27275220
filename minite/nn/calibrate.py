"""Static activation-scale calibration (for recipes with `activation.scaling == "static"`, e.g. `vllm`).

    with calibrate(model):
        model(batch)            # any number of forward passes, run in high precision
    # every Linear / MoEExperts that saw nonzero input now has input_scale = amax / 2688

Modules take part by defining `start_calibration()` and `finish_calibration(commit)`. During
calibration they record the running max |input| and compute unquantized. If the block raises, no
scale is stored. `static_scales` / `load_static_scales` save and restore the calibrated scales (they
are non-persistent buffers, outside the state dict: checkpoints carry them separately).

A sampler-only model (`minite.nn.sampler_weights`) cannot run the high-precision forward (its NVFP4
layers hold codes, not weights): `calibrate_through(model, source)` calibrates it on the forward of
`source`, a model of the same config holding the same weights (the learner's), whose own scales are
left as they were.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from minite.nn.quantized_weight import is_released

STATIC_SCALE_BUFFERS = ("input_scale", "gate_up_input_scale", "down_input_scale")


def uses_static_scales(model: nn.Module) -> bool:
    recipe = getattr(model, "recipe", None)
    return recipe is not None and recipe.fp4 and recipe.activation.scaling == "static"


def needs_calibration(model: nn.Module) -> bool:
    """True when some module that takes part in calibration has no static scale yet."""
    return any(getattr(m, leaf, 0) is None for m in model.modules() if hasattr(m, "start_calibration")
               for leaf in STATIC_SCALE_BUFFERS)


def static_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """The calibrated static input scales, by buffer name (copies, on the CPU)."""
    return {name: b.detach().cpu().clone() for name, b in model.named_buffers()
            if name.rsplit(".", 1)[-1] in STATIC_SCALE_BUFFERS}


def load_static_scales(model: nn.Module, scales: dict[str, torch.Tensor]) -> None:
    """Install scales from `static_scales` (same model config); unknown names are errors."""
    for name, t in scales.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf not in STATIC_SCALE_BUFFERS:
            raise ValueError(f"{name!r} is not a static input scale")
        module = model.get_submodule(prefix)
        ref = getattr(module, "weight", None)
        if ref is None:
            ref = next(module.parameters())
        setattr(module, leaf, t.to(ref.device))


@contextmanager
def calibrate(model: nn.Module):
    if any(is_released(p) for p in model.parameters()):
        raise RuntimeError("a sampler-only model holds NVFP4 codes, not weights, and cannot calibrate on its "
                           "own forward: use calibrate_through(model, a model holding the weights)")
    mods = [m for m in model.modules() if hasattr(m, "start_calibration")]
    for m in mods:
        m.start_calibration()
    try:
        yield model
    except BaseException:
        for m in mods:
            m.finish_calibration(commit=False)
        raise
    for m in mods:
        m.finish_calibration(commit=True)


@contextmanager
def calibrate_through(model: nn.Module, source: nn.Module):
    """`calibrate(source)` for `model`: the forwards of `source` in the block (same config, same
    weights) give `model` its static scales; `source`'s own scales stay as they were."""
    mods = [m for m in source.modules() if hasattr(m, "start_calibration")]
    before = [{leaf: getattr(m, leaf) for leaf in STATIC_SCALE_BUFFERS if hasattr(m, leaf)} for m in mods]
    try:
        with calibrate(source):
            yield source
        load_static_scales(model, static_scales(source))
    finally:
        for m, values in zip(mods, before):
            for leaf, value in values.items():
                setattr(m, leaf, value)
