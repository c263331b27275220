"""One weight global scale per fused group (q/k/v, gate/up): `Recipe.fused_scale == "shared"`.

Serving engines run a fused group as one GEMM with one weight global scale: vLLM's ModelOpt NVFP4
loader takes the largest `weight_scale_2` of q/k/v (and of gate/up) and decodes every member with it,
so members quantized with their own scales would be served with wrong magnitudes. Under "shared" the
members are quantized as one tensor: their weights concatenated along N, one amax (the group's
largest), one S_enc / S_dec, block scales and codes relative to that; each member keeps its rows of
the codes, the block scales and the bf16 copy. The member holding the group's amax gets exactly its
separate quantization; the others a global scale a little coarser than their own, which costs
accuracy only where a member's amax is much smaller than its siblings' (docs/export.md measures it).
An exported checkpoint then holds the numbers the model computed with, and an engine serves them.

MoE experts need nothing: each expert's `gate_up_proj` is quantized as one tensor already, so an
expert's gate and up share their scale under every recipe. 16x16 weight blocks need each member's row
count to be a multiple of 16, so that no tile straddles two members.
"""

from __future__ import annotations

import torch
from torch import nn

from minite.nn.pinned_weights import pinned
from minite.nn.quantized_weight import _DEFERRED, QuantizedWeight, _defer, quantize_weight, weight_key
from minite.nvfp4 import NVFP4Tensor


def link_scale_groups(model: nn.Module) -> None:
    """Tell each member of a fused group (`fused_projection_groups()` of its owner) its group."""
    for owner in model.modules():
        groups = getattr(owner, "fused_projection_groups", None)
        for linears in groups() if groups is not None else ():
            for lin in linears:
                lin.scale_group = tuple(linears)


def shares_scale(module: nn.Module) -> bool:
    """Whether `module` is quantized with its group's one global scale."""
    recipe = getattr(module, "recipe", None)
    return bool(getattr(module, "scale_group", None)) and recipe.fp4 and recipe.fused_scale == "shared"


@torch.no_grad()
def quantize_group(linears: tuple) -> list[QuantizedWeight]:
    """The members' `QuantizedWeight`s under one global scale (module docstring)."""
    spec = linears[0].recipe.weight
    if any(lin.recipe.weight != spec for lin in linears):
        raise ValueError("the members of a fused group run different weight specs; one scale needs one spec")
    rows = [lin.weight.shape[0] for lin in linears]
    if tuple(spec.block) == (16, 16) and any(n % 16 for n in rows):
        raise ValueError(f"fused_scale='shared' with 16x16 weight blocks needs each member's rows to be a "
                         f"multiple of 16, got {rows}")
    if all(pinned(lin.weight, spec) is not None for lin in linears):  # a checkpoint's, as they are
        return [quantize_weight(lin.weight, spec) for lin in linears]
    whole = quantize_weight(torch.cat([lin.weight.detach() for lin in linears]), spec)
    q, out, start = whole.q, [], 0
    for lin, n in zip(linears, rows):
        part = slice(start, start + n)
        member = NVFP4Tensor(q.codes[part], q.block_scales[part], q.global_scale, q.amax,
                             (n, q.shape[-1]), q.block, q.scaling, q.chain, q.hadamard)
        out.append(QuantizedWeight(member, whole.unscaled[part], spec, weight_key(lin.weight, spec)))
        start += n
    if _DEFERRED:  # the members get their host S_dec from the refresh's one sync too
        _defer([(tuple(lin.weight.shape), qw) for lin, qw in zip(linears, out)],
               q.global_scale.reshape(1).expand(len(out)), q.amax.reshape(1).expand(len(out)))
    return out


def refresh_group(linears: tuple) -> None:
    """Quantize the group now and install each member's share."""
    for lin, qw in zip(linears, quantize_group(linears)):
        lin._qweight = qw
