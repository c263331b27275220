"""Re-quantize a model's weights after an update, all at once: `refresh_quantized_weights(model)`.

2D weights (a Linear's, or each segment of a `SegmentedLinear`) of one shape, dtype and spec are
quantized together (`quantized_weight.quantize_weights`: a launch per group, not per weight; the same
bits as one `quantize_weight` each), every weight is checked for inf/NaN with one host sync at the end
(`deferred_finite_checks`, which also brings each S_dec to the host), and the segmented linears'
concatenated copies (`minite.nn.segmented_matmul`) are made in the same pass, queued with the
quantizer's launches rather than in the next forward.
"""

from __future__ import annotations

import torch

from minite.nn import quantized_weight as qw
from minite.nn.linear import SegmentedLinear
from minite.nn.pinned_weights import pinned

# bytes of weights stacked for one `quantize_weights` launch (the stack is a transient copy)
STACK_BYTES = 1 << 29
# segments stack in multiples of this (a module's 2 or 3 same-shape segments, in module order, are then
# never split: their copies lie back to back in the stack and the concatenated copy is a view of it)
SEGMENT_STACK_MULTIPLE = 6


def refresh_quantized_weights(model: torch.nn.Module) -> int:
    """Re-quantize every cached weight in `model` now (checking them all for inf/NaN with one host
    sync); returns how many modules were refreshed. Segments stack apart from plain weights (a stack
    shared with another weight would stay allocated for the segmented copy that views it)."""
    groups: dict[tuple, list] = {}  # (shape, dtype, device, spec, segment?) -> [(module, segment | None)]
    segmented: dict[SegmentedLinear, list] = {}
    n = 0
    with qw.deferred_finite_checks():
        for m in model.modules():
            if not hasattr(m, "refresh_quantized_weight"):
                continue
            n += 1
            recipe = getattr(m, "recipe", None)
            spec = getattr(recipe, "weight", None)
            w = getattr(m, "weight", None)
            if isinstance(m, SegmentedLinear) and m.quantizes_whole():  # one quantization, or a checkpoint's
                m.refresh_quantized_weight()
                continue
            if isinstance(m, SegmentedLinear):
                units = list(enumerate(m.segments())) if recipe.fp4 else []
                segmented[m] = [None] * len(units)
            elif (getattr(recipe, "fp4", False) and isinstance(w, torch.Tensor) and w.ndim == 2
                  and pinned(w, spec) is None):
                units = [(None, w)]
            else:
                m.refresh_quantized_weight()
                continue
            if all(qw._one_launch(t.detach(), spec, "auto") for _, t in units):
                for j, t in units:
                    key = (tuple(t.shape), t.dtype, t.device, spec, j is not None)
                    groups.setdefault(key, []).append((m, j))
                continue
            m.refresh_quantized_weight()  # not the kernels' one-launch case
            segmented.pop(m, None)
        for (_, _, _, spec, is_segment), members in groups.items():
            w0 = _tensor(*members[0])
            per = max(1, STACK_BYTES // (w0.numel() * w0.element_size()))
            if is_segment:  # a module's same-shape segments in one stack: back to back there
                per = max(SEGMENT_STACK_MULTIPLE, per - per % SEGMENT_STACK_MULTIPLE)
            for i in range(0, len(members), per):
                chunk = members[i:i + per]
                with torch.no_grad():
                    made = qw.quantize_weights([_tensor(m, j) for m, j in chunk], spec)
                for (m, j), q in zip(chunk, made):
                    if j is None:
                        m.refresh_quantized_weight(q)
                    else:
                        segmented[m][j] = q
        for m, qws in segmented.items():
            if qws:
                m.install_quantized_weights(qws)
                m.prepare()  # the concatenated copy, queued before the one sync
            else:
                m.refresh_quantized_weight()
    return n


def _tensor(module: torch.nn.Module, segment: int | None) -> torch.Tensor:
    return module.weight if segment is None else module.segments()[segment]
