"""The segments of a `SegmentedLinear` (q|k|v, gate|up) as one launch on their packed weights.

Where a segment alone would read its decode layout (the Triton kernels, no `fast` mode, K a multiple
of the layout's column group): at most `execution.decode_max_m` rows (`kernels.decode_gemm`, the
aligned decode config) or a sampler-form weight at any row count (`kernels.grouped_decode`'s row
tiles), a forward without autograd runs the segments as one GEMM over their decode layouts
concatenated along N (`SegmentedDecode`, made once per quantized weights; each segment's own layout
becomes a view into it, so nothing is stored twice). Each segment keeps its own global scale in the
epilogue and its own output, bitwise what its own launch gives (the same K order and epilogue per
element). Segment widths must be multiples of the layout's 64-row tiles (every memory tile then
belongs to one segment). A forward that needs gradients runs the segments one by one (the same bits).

One launch instead of three puts the narrow k and v projections' few tiles beside q's, where a
decode step's launches are short and many.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minite.kernels import lazy
from minite.nn import nvfp4_matmul as nm
from minite.recipe import Recipe


@dataclass
class SegmentedDecode:
    """The segments' quantized weights, their decode layouts concatenated along N (for one activation
    dtype) and the epilogue factors."""

    qweights: tuple
    weight: object  # kernels.decode_gemm.DecodeWeight [sum N_j, K]
    widths: tuple[int, ...]
    scales: torch.Tensor  # fp32 [3]: each segment's epilogue factor, the last repeated for two segments


def applies(qweights: tuple, widths: tuple[int, ...], recipe: Recipe, x: torch.Tensor, rows: int,
            needs_grad: bool) -> bool:
    """Whether a forward of `rows` rows of x runs the segments as one decode-layout launch."""
    kd, e = lazy.decode_gemm, recipe.execution
    if needs_grad or e.fast or rows == 0 or len(widths) not in (2, 3) or x.shape[-1] % kd.KGROUP:
        return False
    if any(n % kd.TILE_N for n in widths) or not nm.use_kernels(recipe, x.device):
        return False
    return rows <= e.decode_max_m or all(nm.reads_codes(qw) for qw in qweights)


def segmented_decode(qweights: tuple, recipe: Recipe, dtype: torch.dtype) -> SegmentedDecode:
    """The `SegmentedDecode` of 2-3 segments for `dtype` activations; the segments' own decode layouts
    become views into the concatenated one."""
    kd = lazy.decode_gemm
    layouts = [qw.decode_weight(dtype) for qw in qweights]
    codes = torch.cat([w.codes for w in layouts])
    scales = torch.cat([w.scales for w in layouts])
    at = 0
    for qw, w in zip(qweights, layouts):
        tiles = w.codes.shape[0]
        qw.share_decode_weight(dtype, kd.DecodeWeight(codes[at:at + tiles], scales[at:at + tiles], w.n))
        at += tiles
    sw = [nm._weight_scale(qw, recipe).reshape(()) for qw in qweights]
    widths = tuple(w.n for w in layouts)
    return SegmentedDecode(tuple(qweights), kd.DecodeWeight(codes, scales, sum(widths)), widths,
                           torch.stack([*sw, sw[-1]][:3]))


def forward(x: torch.Tensor, seg: SegmentedDecode, recipe: Recipe, quantized: nm.QuantizedActivation,
            ) -> tuple[torch.Tensor, ...]:
    """x [..., K] quantized as `quantized` -> the segments' outputs [..., N_j]."""
    a, _, row_factor = quantized
    m = a.shape[0]
    if m <= recipe.execution.decode_max_m:
        outs = lazy.decode_gemm.decode_gemm_segments(a, row_factor, seg.weight, seg.scales, seg.widths,
                                                     recipe.epilogue, x.dtype)
    else:
        outs = lazy.grouped_decode.decode_rows_segments(a, row_factor, seg.weight, seg.scales, seg.widths,
                                                        recipe.epilogue, x.dtype)
    lead = x.shape[:-1]
    return tuple(o.view(*lead, o.shape[-1]) for o in outs)
