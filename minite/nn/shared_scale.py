"""One weight global scale per fused group (q|k|v, gate|up): `Recipe.fused_scale == "shared"`.

Serving engines run a fused group as one GEMM with one weight global scale: vLLM's ModelOpt NVFP4
loader takes the largest `weight_scale_2` of q/k/v (and of gate/up) and decodes every member with it,
so segments quantized with their own scales would be served with wrong magnitudes. Under "shared" a
`SegmentedLinear`'s weight is quantized as one tensor: one amax (the group's largest), one S_enc /
S_dec, block scales and codes relative to that; each segment keeps its rows of the codes, the block
scales and the bf16 copy. The segment holding the group's amax gets exactly its separate
quantization; the others a global scale a little coarser than their own (docs/export.md measures
what it costs). An exported checkpoint then holds the numbers the model computed with, and an engine
serves them.

MoE experts need nothing: each expert's `gate_up_proj` is quantized as one tensor already, so an
expert's gate and up share their scale under every recipe. 16x16 weight blocks need each segment's
row count to be a multiple of 16, so that no tile straddles two segments.
"""

from __future__ import annotations

import torch

from minite.nn.quantized_weight import _DEFERRED, QuantizedWeight, _defer, quantize_weight, weight_key
from minite.nvfp4 import NVFP4Tensor


@torch.no_grad()
def quantize_shared(weight: torch.Tensor, offsets: tuple[int, ...], views: list[torch.Tensor], spec
                    ) -> list[QuantizedWeight]:
    """The segments' `QuantizedWeight`s (rows `offsets[j]:offsets[j + 1]` of `weight`, `views[j]`)
    under one global scale (module docstring)."""
    rows = [b - a for a, b in zip(offsets, offsets[1:])]
    if tuple(spec.block) == (16, 16) and any(n % 16 for n in rows):
        raise ValueError(f"fused_scale='shared' with 16x16 weight blocks needs each segment's rows to be a "
                         f"multiple of 16, got {rows}")
    whole = quantize_weight(weight.detach(), spec)
    q, out = whole.q, []
    for view, a, b in zip(views, offsets, offsets[1:]):
        member = NVFP4Tensor(q.codes[a:b], q.block_scales[a:b], q.global_scale, q.amax, (b - a, q.shape[-1]),
                             q.block, q.scaling, q.chain, q.hadamard)
        out.append(QuantizedWeight(member, whole.unscaled[a:b], spec, weight_key(view, spec)))
    if _DEFERRED:  # the segments get their host S_dec from the refresh's one sync too
        n = len(out)
        _defer([(tuple(v.shape), qw) for v, qw in zip(views, out)], q.global_scale.reshape(1).expand(n),
               q.amax.reshape(1).expand(n))
    return out
