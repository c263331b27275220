"""Static activation-scale calibration (for recipes with `activation.scaling == "static"`, e.g. `vllm`).

    with calibrate(model):
        model(batch)            # any number of forward passes, run in high precision
    # every Linear / MoEExperts that saw nonzero input now has input_scale = amax / 2688

Modules take part by defining `start_calibration()` and `finish_calibration(commit)`. During
calibration they record the running max |input| and compute unquantized. If the block raises, no
scale is stored.
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn


@contextmanager
def calibrate(model: nn.Module):
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
