"""A model's memory by kind: measured on its tensors (`memory_by_kind`) or computed from its shapes
(`memory_from_shapes`, a model on the meta device: nothing allocated).

Kinds (bytes):
- `bf16_parameters` / `fp32_parameters`: the parameters the model holds (16-bit / fp32); a sampler-only
  model's released NVFP4 weights (`minite.nn.sampler_weights`) hold none;
- `fp32_masters`, `optimizer_state`, `gradients`: the learner's (`learner.optimizer.MasterAdamW`: an
  fp32 master of each 16-bit parameter, AdamW's two fp32 moments, the parameters' and masters' grads);
- `nvfp4_codes`, `block_scales`, `global_scales`: the NVFP4 containers (codes 0.5 B and E4M3 block
  scales 1/16 B per weight; S_dec, amax and the epilogue factors per tensor or expert);
- `decode_layouts`: the decode GEMMs' copy of the codes (int16 words of 4 codes, 16-bit block scales,
  rows padded to the memory tile: 0.625 B per weight), made on first decode use;
- `unscaled_copies`: the bf16 copies `e2m1 * s_b` the compute-bound GEMMs read (2 B per weight),
  with their K-padded / fp16 operand forms and the segmented projections' concatenated copies.

Every storage is counted once (views, stacked launches and tied embeddings share one), under the
first kind that reaches it in the order above.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from minite.nn.linear import Linear, SegmentedLinear
from minite.nn.moe import MoEExperts
from minite.nn.quantized_weight import QuantizedWeight, is_released
from minite.nn.sampler_weights import nvfp4_weight_names

KINDS = ("bf16_parameters", "fp32_parameters", "fp32_masters", "optimizer_state", "gradients", "nvfp4_codes",
         "block_scales", "global_scales", "decode_layouts", "unscaled_copies")
GB = 1e9


class _Counter:
    def __init__(self):
        self.bytes = dict.fromkeys(KINDS, 0)
        self.seen: set[tuple] = set()

    def add(self, kind: str, t: torch.Tensor | None) -> None:
        if t is None or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in self.seen:
            self.seen.add(key)
            self.bytes[kind] += storage.nbytes()


def memory_by_kind(model: nn.Module, optimizer=None) -> dict[str, int]:
    """The bytes `model` (and `optimizer`, a `MasterAdamW`, if given) hold now, by kind (module
    docstring), plus `total`."""
    c = _Counter()
    for p in model.parameters():
        if not is_released(p):
            c.add("bf16_parameters" if p.element_size() == 2 else "fp32_parameters", p)
    if optimizer is not None:
        for m in optimizer.masters:
            c.add("fp32_masters", m)
        for state in optimizer.optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    c.add("optimizer_state", t)
        for m in optimizer.masters:
            c.add("gradients", m.grad)
    for p in model.parameters():
        c.add("gradients", p.grad)
    for qw in quantized_weights_held(model):
        _add_quantized(c, qw)
    for m in model.modules():
        if isinstance(m, SegmentedLinear) and m._copy is not None:
            c.add("unscaled_copies", m._copy.copy)
    return {**c.bytes, "total": sum(c.bytes.values())}


def quantized_weights_held(model: nn.Module) -> list[QuantizedWeight]:
    """The `QuantizedWeight`s the model's modules hold now (none made here)."""
    out = []
    for m in model.modules():
        if isinstance(m, SegmentedLinear):
            out += list(m._qweights or ())
        elif isinstance(m, Linear) and m._qweight is not None:
            out.append(m._qweight)
        elif isinstance(m, MoEExperts):
            out += list(m._qweights.values())
    return out


def _add_quantized(c: _Counter, qw: QuantizedWeight) -> None:
    q, d = qw.q, qw._derived
    c.add("nvfp4_codes", q.codes)
    c.add("block_scales", q.block_scales)
    for t in (q.global_scale, q.amax, *d.epilogue_scales.values()):
        c.add("global_scales", t)
    for layout in d.decode.values():
        c.add("decode_layouts", layout.codes)
        c.add("decode_layouts", layout.scales)
    c.add("unscaled_copies", qw.unscaled)
    for t in d.operands.values():
        c.add("unscaled_copies", t)


def memory_from_shapes(model: nn.Module, *, sampler_only: bool = False, unscaled: bool = True,
                       decode: bool = True, learner: bool = False) -> dict[str, int]:
    """The bytes by kind computed from the shapes of `model` (any device; the meta device allocates
    nothing) in a given form: `sampler_only` (released NVFP4 parameters), `unscaled` (the bf16 copies of
    the NVFP4 weights; a sampler-only model holds none), `decode` (their decode layouts), `learner`
    (`MasterAdamW`'s masters, moments and gradients of every parameter the form keeps)."""
    from minite.kernels import lazy

    tile_n, kgroup = lazy.decode_gemm.TILE_N, lazy.decode_gemm.KGROUP
    out = dict.fromkeys(KINDS, 0)
    quantized = {id(getattr(m, leaf)): (m, leaf) for m in model.modules() for leaf in nvfp4_weight_names(m)}
    for p in model.parameters():
        if id(p) in quantized and sampler_only:
            continue
        n = p.numel()
        out["bf16_parameters" if p.element_size() == 2 else "fp32_parameters"] += n * p.element_size()
        if learner:
            out["fp32_masters"] += 4 * n if p.element_size() != 4 else 0
            out["optimizer_state"] += 8 * n
            out["gradients"] += n * p.element_size() + (4 * n if p.element_size() != 4 else 0)
    for module, leaf in quantized.values():
        shape = tuple(getattr(module, leaf).shape)
        tensors = math.prod(shape[:-2]) * (len(module.widths) if isinstance(module, SegmentedLinear) else 1)
        rows, k = shape[-2], shape[-1]
        lead = math.prod(shape[:-2])
        if tuple(module.recipe.weight.block) == (16, 16):
            rows = -(-rows // 16) * 16
        out["nvfp4_codes"] += lead * rows * k // 2
        out["block_scales"] += lead * rows * k // 16
        out["global_scales"] += 12 * tensors  # S_dec, amax, the epilogue factor (fp32)
        if not sampler_only and unscaled:
            out["unscaled_copies"] += 2 * math.prod(shape)
        if decode and k % kgroup == 0:
            segments = module.widths if isinstance(module, SegmentedLinear) else (shape[-2],)
            padded = sum(-(-n // tile_n) * tile_n for n in segments)
            out["decode_layouts"] += lead * padded * (k // 2 + k // 8)
    return {**out, "total": sum(out.values())}
