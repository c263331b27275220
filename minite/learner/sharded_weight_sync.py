"""Weight sync from a sharded learner into every rank's sampler: codes and scales, not bf16.

`gather_quantized_weights(learner_model, sampler_model, dtype)` runs on every rank after a step's
updates. Each rank quantizes the rows it owns, once: its fp32 master shard in the compute dtype (the
values the learner's forward gathers). A weight with one global scale needs the amax of the whole
tensor: the shards' amaxes are max-reduced first (one collective for all weights), and each shard is
quantized with that amax standing in an extra row, so its codes and block scales are bitwise the rows
of the whole tensor's quantization (block scales are per row, or per 16-row tile: shards of 16x16
weights must hold whole tiles). A segmented projection (q|k|v, gate|up) has one amax per segment:
the rows of each segment in a shard are quantized with their segment's amax, and the gathered codes
and block scales are split back into the segments. Expert tensors [E, N, K] are sharded by experts,
each quantized whole by its owner. Then the codes (uint8), block scales (E4M3) and, for the tensors
that are not quantized (embeddings, norms, router, LM head, bf16 layers), their values in the compute
dtype are all-gathered in buckets of `BUCKET_BYTES` and installed with `load_quantized_weights` (no second
quantization). The sampler's forward then multiplies the very codes the learner's forward would make.

`gather_full_weights` is the naive deployment's sync: the whole weights in the compute dtype, which
the sampler's own recipe quantizes with its own chain.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from minite.learner.weight_sync import (
    CONTAINER_META,
    _quantized_targets,
    load_quantized_weights,
    sync_sampler_model,
)
from minite.nn.linear import SegmentedLinear
from minite.nn.quantized_weight import quantize_weight

BUCKET_BYTES = 1 << 30  # bytes per rank of one all-gather


def _rows_per_rank(n: int, world: int) -> list[int]:
    """FSDP2's split of dim 0 (torch.chunk): ceil(n / world) rows per rank, the last ones fewer or none."""
    per = math.ceil(n / world) if n else 0
    return [max(0, min(per, n - r * per)) for r in range(world)]


@torch.no_grad()
def _pieces(p: DTensor, module: nn.Module, rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's rows of each segment of weight `p` (a plain weight: one segment), as [start, end)
    in the local shard."""
    rows = _rows_per_rank(p.shape[0], world)
    start = sum(rows[:rank])
    end = start + rows[rank]
    widths = module.widths if isinstance(module, SegmentedLinear) else (p.shape[0],)
    out, s0 = [], 0
    for w in widths:
        a, b = max(s0, start), min(s0 + w, end)
        out.append((a - start, max(a, b) - start))
        s0 += w
    return out


def _amax(local: torch.Tensor, piece: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
    a, b = piece
    if b <= a:
        return torch.zeros((), device=device)
    return local[a:b].to(dtype).abs().amax().float()


def _segments(fields: dict, module: SegmentedLinear) -> dict:
    """The gathered whole-tensor codes and block scales split into the segments, each with its own
    global scale: the payload of a segmented weight."""
    out, s0 = [], 0
    for j, w in enumerate(module.widths):
        r0, r1 = s0, s0 + w
        seg = {k: fields[k] for k in CONTAINER_META if k != "shape"}
        seg.update(shape=(w, module.in_features), codes=fields["codes"][r0:r1],
                   block_scales=fields["block_scales"][r0:r1],
                   global_scale=fields["global_scale"][j], amax=fields["amax"][j])
        out.append(seg)
        s0 += w
    return {"segments": out}


def _local_quantized_pieces(p: DTensor, spec, dtype: torch.dtype, pieces: list[tuple[int, int]],
                            amaxes: list[torch.Tensor]):
    """`_local_quantized` per segment: each segment's local rows with its own whole-segment amax;
    -> the shard's codes and block scales (in row order) and one S_dec and amax per segment."""
    local = p.to_local()
    codes, scales, gs, am = [], [], [], []
    for (a, b), amax in zip(pieces, amaxes):
        c, s, g, m = _quantize_rows(local[a:b].to(dtype), spec, amax, p.shape)
        codes.append(c)
        scales.append(s)
        gs.append(g)
        am.append(m)
    return torch.cat(codes), torch.cat(scales), torch.stack(gs), torch.stack(am)


def _local_quantized(p: DTensor, spec, dtype: torch.dtype, amax: torch.Tensor | None):
    """The codes, block scales, S_dec and amax of this rank's rows of weight `p` (fp32 shard -> dtype);
    `amax` is the whole tensor's for per-tensor scaling (None: expert tensors, each expert whole)."""
    local = p.to_local().to(dtype)
    if amax is None:
        if local.shape[0] == 0:
            return None
        q = quantize_weight(local, spec).q
        return q.codes, q.block_scales, q.global_scale, q.amax
    return _quantize_rows(local, spec, amax, p.shape)


def _quantize_rows(local: torch.Tensor, spec, amax: torch.Tensor, shape) -> tuple:
    """Rows of a tensor (of `shape`) whose whole amax is `amax`, quantized as they are in the whole."""
    tile = spec.block[0]
    if local.shape[0] % tile:
        raise ValueError(f"a shard of {tuple(shape)} holds {local.shape[0]} rows of a segment, not whole "
                         f"{tile}-row tiles of its {spec.block} blocks; choose a world size that splits it "
                         f"into tiles")
    # the whole tensor's amax in an extra tile: the global scales are the whole tensor's (also on a
    # rank without rows of it), the shard's rows quantize as they do in the whole tensor
    extra = local.new_zeros(tile, shape[1])
    extra[0, 0] = amax.to(local.dtype)
    q = quantize_weight(torch.cat([local, extra]), spec).q
    n = local.shape[0]
    return q.codes[:n], q.block_scales[:n], q.global_scale, q.amax


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@torch.no_grad()
def gather_quantized_weights(learner_model: nn.Module, sampler_model: nn.Module, dtype: torch.dtype) -> None:
    """Install the sharded learner's current weights into `sampler_model` (a whole model of the same
    config and recipe on this rank) as codes and scales; every rank calls it (module docstring)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    targets = _quantized_targets(sampler_model)
    params = dict(learner_model.named_parameters())
    device = next(iter(params.values())).to_local().device
    # (name, segment) -> this rank's rows of it: one amax per weight, or per segment of a segmented one
    pieces = {n: _pieces(params[n], targets[n][0], rank, world) for n, p in params.items()
              if n in targets and p.ndim == 2}
    keys = [(n, j) for n, ps in pieces.items() for j in range(len(ps))]
    local_amax = [_amax(params[n].to_local(), pieces[n][j], dtype, device) for n, j in keys]
    amaxes = torch.stack(local_amax) if local_amax else None
    if amaxes is not None:
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX)
    amax_of = dict(zip(keys, amaxes if amaxes is not None else []))
    # (name, field, per-rank rows, row shape, dtype, local tensor or None)
    items = []
    quantized = {}
    for name, p in params.items():
        rows = _rows_per_rank(p.shape[0], world)
        if name in targets:
            module, leaf = targets[name]
            spec = module.recipe.weight
            if name in pieces:
                got = _local_quantized_pieces(p, spec, dtype, pieces[name], [amax_of[name, j] for j in
                                                                             range(len(pieces[name]))])
            else:
                got = _local_quantized(p, spec, dtype, None)
            k = p.shape[-1]
            shapes = {"codes": ((*p.shape[1:-1], k // 2), torch.uint8),
                      "block_scales": ((*p.shape[1:-1], k // 16), torch.float8_e4m3fn)}
            local = dict(zip(("codes", "block_scales"), got[:2])) if got else {}
            for field, (shape, dt) in shapes.items():
                items.append((name, field, rows, shape, dt, local.get(field)))
            if p.ndim == 3:  # one S_dec and amax per expert: gathered with the experts
                for i, field in ((2, "global_scale"), (3, "amax")):
                    items.append((name, field, rows, (1, 1), torch.float32, got[i] if got else None))
            else:  # one S_dec and amax per segment (a plain weight: one segment)
                quantized[name] = {"global_scale": got[2], "amax": got[3]}
            meta = {"block": tuple(spec.block), "scaling": spec.scaling, "chain": spec.chain,
                    "hadamard": spec.hadamard}
            quantized.setdefault(name, {}).update({k: meta[k] for k in CONTAINER_META if k in meta})
            quantized[name]["shape"] = tuple(p.shape)
        else:
            items.append((name, "tensor", rows, tuple(p.shape[1:]), dtype,
                          p.to_local().to(dtype) if rows[dist.get_rank()] else None))
    gathered = _all_gather(items, world, device)
    tensors = {}
    for (name, field, *_), full in zip(items, gathered):
        if field == "tensor":
            tensors[name] = full
        else:
            quantized[name][field] = full
    for name, fields in quantized.items():
        module = targets[name][0]
        if params[name].ndim == 2:
            quantized[name] = _segments(fields, module) if isinstance(module, SegmentedLinear) else {
                **fields, "global_scale": fields["global_scale"][0], "amax": fields["amax"][0]}
    recipe = getattr(getattr(sampler_model, "recipe", None), "name", None)
    load_quantized_weights(sampler_model, {"recipe": recipe, "quantized": quantized, "tensors": tensors})


def _all_gather(items: list, world: int, device: torch.device) -> list[torch.Tensor]:
    """Each item's whole tensor from every rank's rows (padded to the first rank's count for the
    collective), bucketed: one all-gather per `BUCKET_BYTES` of this rank's data."""
    out: list[torch.Tensor] = []
    start = 0
    while start < len(items):
        size, end = 0, start
        while end < len(items) and (end == start or size + _padded_bytes(items[end]) <= BUCKET_BYTES):
            size += _padded_bytes(items[end])
            end += 1
        out.extend(_gather_bucket(items[start:end], world, device))
        start = end
    return out


ALIGN = 16  # bytes: each item starts at a multiple in the bucket (a dtype view needs its alignment)


def _item_bytes(item) -> int:
    _, _, rows, shape, dt, _ = item
    return rows[0] * math.prod(shape) * torch.empty((), dtype=dt).element_size()


def _padded_bytes(item) -> int:
    return -(-_item_bytes(item) // ALIGN) * ALIGN


def _gather_bucket(items: list, world: int, device: torch.device) -> list[torch.Tensor]:
    parts = []
    for item in items:
        _, _, rows, shape, dt, local = item
        buf = torch.zeros(rows[0], *shape, dtype=dt, device=device)
        if local is not None:
            buf[: local.shape[0]] = local.reshape(-1, *shape)
        pad = _padded_bytes(item) - _item_bytes(item)
        parts.append(_bytes(buf) if not pad else torch.cat([_bytes(buf), _bytes(buf).new_zeros(pad)]))
    send = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send)
    out, at = [], 0
    for item in items:
        _, _, rows, shape, dt, _ = item
        n = _item_bytes(item)
        pieces = [recv[r][at: at + n].view(dt).reshape(rows[0], *shape)[: rows[r]] for r in range(world)]
        out.append(torch.cat(pieces))
        at += _padded_bytes(item)
    return out


@torch.no_grad()
def gather_full_weights(learner_model: nn.Module, sampler_model: nn.Module, dtype: torch.dtype) -> None:
    """The naive deployment's sync: the whole weights in `dtype` into the sampler's own model, which
    quantizes them with its own recipe (`sync_sampler_model`)."""
    full = _FullWeights({name: p.to(dtype).full_tensor() for name, p in learner_model.named_parameters()})
    sync_sampler_model(sampler_model, full)


class _FullWeights(nn.Module):
    """Named whole tensors with a module's `named_parameters` (what `sync_sampler_model` reads)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self._tensors = tensors

    def named_parameters(self, *args, **kwargs):
        return iter(self._tensors.items())
