"""Weights quantized once per update into an object both engines share.

`QuantizedWeight` holds the NVFP4 container of a weight ([N, K] for a Linear, or [E, N, K] for MoE
experts, each expert quantized as its own tensor: per-expert global scale [E, 1, 1]) together with
the exact unscaled dequantized copy `e2m1 * s_b` in bf16 that the compute-bound GEMM multiplies
(exact: docs/facts.md, "The GPU: NVIDIA H200"). The learner's forward and the sampler use the
very same object. The Triton
GEMMs read that copy through `operand(dtype, k_multiple)`: the bf16 copy itself on the GPU, or a
cached fp16 / K-padded version of it (the CPU interpreter; K not a multiple of the kernel's K tile),
made once per quantized weight, i.e. once per update. The decode GEMM (few rows, packed weights)
reads `decode_weight(dtype)`: the codes in its decode layout with 16-bit block scales, also made
once per update (0.625 more bytes per weight, on the device that samples).

A weight read from an NVFP4 checkpoint carries its container (`minite.nn.pinned_weights`):
`quantize_weight` takes it as it is instead of quantizing.

Sampler form (`packed()`, `minite.nn.sampler_weights`): the container and the decode layout only,
`unscaled` None. What needs the bf16 copy then makes it on the spot and does not keep it
(`unscaled_values`, `operand`); the GEMMs above the decode threshold read the codes instead
(`minite.nn.nvfp4_matmul`). Its module's parameter is released (`release`): a placeholder of the
weight's shape, dtype and device holding one element, never quantized again.

Invalidation: a module caches its `QuantizedWeight` keyed on the parameter's autograd version
counter (`weight._version`, bumped by every in-place update: optimizer steps, `copy_`,
`load_state_dict`), its storage, dtype and the recipe's weight spec. Writes through `.data` bypass
the version counter: after those call `minite.nn.refresh.refresh_quantized_weights(model)`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from minite import nvfp4
from minite.nn.pinned_weights import pinned
from minite.nvfp4 import NVFP4Tensor, quantize
from minite.recipe import QuantSpec


class _Derived:
    """What the GEMMs make from one quantized weight, once per update, on first use; written only by
    `QuantizedWeight`'s own methods."""

    __slots__ = ("operands", "decode", "epilogue_scales", "host_global_scale")

    def __init__(self):
        self.operands: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # (dtype, K multiple) -> copy
        self.decode: dict[torch.dtype, object] = {}  # activation dtype -> decode layout
        self.epilogue_scales: dict[bool, torch.Tensor] = {}  # 'alpha' epilogue? -> fp32 flat factor
        self.host_global_scale: tuple[float, ...] | None = None


@dataclass(frozen=True)
class QuantizedWeight:
    q: NVFP4Tensor  # codes [..., N, K // 2], block scales [..., N, K // 16], global [] or [E, 1, 1]
    unscaled: torch.Tensor | None  # [..., N, K] bf16, e2m1 * s_b (exact); None in the sampler form
    spec: QuantSpec
    key: tuple  # what the cache was keyed on
    _derived: _Derived = field(default_factory=_Derived, init=False, repr=False, compare=False)

    @property
    def global_scale(self) -> torch.Tensor:
        return self.q.global_scale

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape, [N, K] or [E, N, K]."""
        return tuple(self.q.shape)

    def unscaled_values(self) -> torch.Tensor:
        """The bf16 copy e2m1 * s_b [..., N, K]: the stored one, or (sampler form) made now and not kept."""
        if self.unscaled is not None:
            return self.unscaled
        return self.q.unscaled()[..., :self.shape[-2], :].to(torch.bfloat16)

    def packed(self, key: tuple) -> QuantizedWeight:
        """This weight in the sampler form under cache key `key`: the container, the decode layouts,
        epilogue factors and host S_dec made so far; no bf16 copy, no operand copies."""
        new = QuantizedWeight(self.q, None, self.spec, key)
        d, nd = self._derived, new._derived
        nd.decode.update(d.decode)
        nd.epilogue_scales.update(d.epilogue_scales)
        nd.host_global_scale = d.host_global_scale
        return new

    @property
    def amax(self) -> torch.Tensor:
        return self.q.amax

    def batched(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unscaled [B, N, K] bf16, S_dec [B, 1, 1], amax [B, 1, 1]); B = 1 for a Linear."""
        n, k = self.shape[-2:]
        u = self.unscaled_values().reshape(-1, n, k)
        b = u.shape[0]
        return u, self.q.global_scale.reshape(b, 1, 1), self.q.amax.reshape(b, 1, 1)

    def host_global_scale(self) -> tuple[float, ...] | None:
        """S_dec as host floats (one per expert), where the refresh that made this weight brought them
        over with its one sync (`deferred_finite_checks`: every weight after an optimizer step); None
        otherwise (reading them now would synchronize)."""
        return self._derived.host_global_scale

    def record_host_global_scale(self, values: tuple[float, ...]) -> None:
        """S_dec as host floats, read by the sync that checked this weight (`deferred_finite_checks`)."""
        if len(values) != self.global_scale.numel():
            raise ValueError(f"{len(values)} host scales for a weight with {self.global_scale.numel()}")
        self._derived.host_global_scale = tuple(values)

    def epilogue_scale(self, alpha: bool) -> torch.Tensor:
        """The GEMM epilogue's weight factor, fp32 flat: [] (a Linear) or [E] (experts): amax for the
        'alpha' epilogue, S_dec otherwise; made once."""
        scales = self._derived.epilogue_scales
        if alpha not in scales:
            s = self.amax if alpha else self.global_scale
            scales[alpha] = s.reshape(-1 if s.ndim else ()).float()
        return scales[alpha]

    def with_unscaled(self, unscaled: torch.Tensor) -> QuantizedWeight:
        """This weight with `unscaled` (the same values stored elsewhere: a view into a fused group's
        concatenated copy, `minite.nn.segmented_matmul`) as its copy. The new object shares this one's
        derived values, less the operand copies made from the old copy, so what arrives later (the
        host S_dec at the end of `deferred_finite_checks`) reaches both; this one is meant to be dropped."""
        if tuple(unscaled.shape) != self.shape or unscaled.dtype != torch.bfloat16:
            raise ValueError(f"with_unscaled needs {self.shape} bf16, got {tuple(unscaled.shape)} "
                             f"{unscaled.dtype}")
        self._derived.operands.clear()
        new = replace(self, unscaled=unscaled)
        object.__setattr__(new, "_derived", self._derived)
        return new

    def operand(self, dtype: torch.dtype, k_multiple: int = 1) -> torch.Tensor:
        """The unscaled copy as a GEMM kernel operand: [..., N, Kp] in dtype (exact in bf16 and fp16),
        K zero-padded to a multiple of k_multiple, contiguous; made once and cached (in the sampler form
        made on every call and not kept: one weight's transient copy)."""
        key, operands = (dtype, k_multiple), self._derived.operands
        if key in operands:
            return operands[key]
        t = self.unscaled_values().to(dtype)
        pad = -t.shape[-1] % k_multiple
        t = (F.pad(t, (0, pad)) if pad else t).contiguous()
        if self.unscaled is not None:
            operands[key] = t
        return t

    def decode_weight(self, dtype: torch.dtype):
        """The codes and block scales ([N, K] or experts [E, N, K]) in the decode GEMMs' layout for
        `dtype` activations (`kernels.decode_gemm.pack_weight`); made once and cached."""
        from minite.kernels.decode_gemm import pack_weight

        decode = self._derived.decode
        if dtype not in decode:
            n = self.shape[-2]
            q = self.q
            decode[dtype] = pack_weight(q.codes[..., :n, :], q.block_scales[..., :n, :], dtype)
        return decode[dtype]

    def share_decode_weight(self, dtype: torch.dtype, layout) -> None:
        """Use `layout`, this weight's decode layout for `dtype` stored elsewhere (a view into a segmented
        group's concatenated one, `minite.nn.segmented_decode`), instead of its own."""
        own = self.decode_weight(dtype)
        if (layout.n, layout.codes.shape, layout.scales.shape) != (own.n, own.codes.shape, own.scales.shape):
            raise ValueError(f"decode layout {tuple(layout.codes.shape)} does not fit this weight's "
                             f"{tuple(own.codes.shape)}")
        self._derived.decode[dtype] = layout

    def decode_dtypes(self) -> tuple[torch.dtype, ...]:
        """The activation dtypes whose decode layout was made (`decode_weight`)."""
        return tuple(self._derived.decode)

    def dequantize(self) -> torch.Tensor:
        """fp32 e2m1 * s_b * S_dec, the weight's shape."""
        gs = self.q.global_scale
        if gs.ndim:
            gs = gs.reshape(-1, 1, 1)
        return self.unscaled_values().float() * gs


_RELEASED = "_minite_released"


def release(param: torch.Tensor) -> torch.nn.Parameter:
    """A placeholder for a parameter whose values live on only as a sampler-form `QuantizedWeight`:
    its shape, dtype and device, one element of storage (expanded), no gradient."""
    stub = torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
    out = torch.nn.Parameter(stub, requires_grad=False)
    setattr(out, _RELEASED, True)
    return out


def is_released(param: torch.Tensor | None) -> bool:
    """Whether `param` is a `release` placeholder (a sampler-only model's quantized weight)."""
    return getattr(param, _RELEASED, False)


def weight_key(weight: torch.Tensor, spec: QuantSpec) -> tuple:
    return (weight._version, weight.data_ptr(), weight.dtype, weight.device, tuple(weight.shape), spec)


# inside `deferred_finite_checks`, one entry per quantize launch to check at the end:
# ([(weight shape, QuantizedWeight)], S_dec flat, amax flat), the flat tensors in the members' order
_DEFERRED: list[list] = []


def _defer(members: list[tuple[tuple, QuantizedWeight]], sdec: torch.Tensor, amax: torch.Tensor) -> None:
    _DEFERRED[-1].append((members, sdec.reshape(-1), amax.reshape(-1)))


@contextmanager
def deferred_finite_checks():
    """Within the block, `quantize_weight` does not check its weight for inf/NaN on the spot (a host
    sync per weight); at the end one sync checks every weight quantized meanwhile (a non-finite
    weight has a non-finite amax) and raises ValueError if any was not finite. That sync also
    records each weight's S_dec on the host (`QuantizedWeight.host_global_scale`)."""
    _DEFERRED.append([])
    try:
        yield
        pending = _DEFERRED[-1]
    finally:
        _DEFERRED.pop()
    if pending:
        # the same sync also brings every S_dec to the host (`QuantizedWeight.host_global_scale`): one
        # entry per tensor (or expert) each, finiteness flags first, in a few launches for all weights
        # (the tensors of a stacked launch arrive whole: host ops per launch, not per weight)
        amax = torch.cat([a.float() for _, _, a in pending])
        total = amax.numel()
        host = torch.cat([torch.isfinite(amax).float(), *(sdec.float() for _, sdec, _ in pending)]).tolist()
        bad, at = [], 0
        for members, _, _ in pending:
            for shape, qw in members:
                n = qw.global_scale.numel()
                if not all(host[at:at + n]):
                    bad.append(shape)
                qw.record_host_global_scale(tuple(host[total + at:total + at + n]))
                at += n
        if bad:
            raise ValueError(f"{len(bad)} weight(s) hold inf or NaN (shapes {bad[:4]}); not quantizable")


@torch.no_grad()
def quantize_weight(weight: torch.Tensor, spec: QuantSpec, backend: str = "auto") -> QuantizedWeight:
    """weight [N, K] or [E, N, K] (one global scale per expert) -> QuantizedWeight. `backend` is
    `minite.nvfp4.quantize`'s; modules keep the default 'auto' (the kernels on CUDA) whatever their
    recipe's backend: RNE codes and scales are bitwise the same, and this runs once per update.
    A weight holding inf or NaN raises ValueError (at the end of `deferred_finite_checks` there)."""
    if weight.ndim not in (2, 3):
        raise ValueError(f"weights are [N, K] or [E, N, K]; got shape {tuple(weight.shape)}")
    if is_released(weight):
        raise ValueError("this weight was released (a sampler-only model, `minite.nn.sampler_weights`): "
                         "only its NVFP4 codes remain; build the model again to change its recipe or weights")
    key = weight_key(weight, spec)
    w = weight.detach()
    n, k = weight.shape[-2:]
    pins = pinned(weight, spec)
    if pins is not None and len(pins) == 1:  # a checkpoint's codes and scales, used as they are
        q = pins[0]
        unscaled = q.unscaled()[..., :n, :].to(torch.bfloat16)
    elif _one_launch(w, spec, backend):
        if not _DEFERRED:
            nvfp4._check_finite(w)
        q, unscaled = _quantize_at_once(w, spec)
    else:
        kw = dict(pad=spec.block == (16, 16), backend=backend, check_finite=not _DEFERRED, **spec.kwargs())
        if weight.ndim == 2:
            q = quantize(w, **kw)
        else:
            q = _stack([quantize(we, **kw) for we in w])
        unscaled = q.unscaled()[..., :n, :].to(torch.bfloat16)  # drop rows padded to a 16x16 tile
    if unscaled.shape[-1] != k:
        raise ValueError(f"weight in_features {k} must be divisible by 16")
    qw = QuantizedWeight(q, unscaled, spec, key)
    if _DEFERRED:
        _defer([(tuple(weight.shape), qw)], qw.global_scale, qw.amax)
    return qw


def from_container(q: NVFP4Tensor, spec: QuantSpec, key: tuple) -> QuantizedWeight:
    """A `QuantizedWeight` of an existing container (a checkpoint's, a share of a bigger one): its
    exact bf16 copy made from the codes and scales, nothing quantized."""
    n = q.shape[-2]
    return QuantizedWeight(q, q.unscaled()[..., :n, :].to(torch.bfloat16), spec, key)


def _one_launch(w: torch.Tensor, spec: QuantSpec, backend: str) -> bool:
    """Whether `kernels.nvfp4.quantize_tensors` serves this weight: the kernels run here, per-tensor
    scaling with RNE and no RHT (every recipe's weights), shapes that need no padding."""
    n, k = w.shape[-2:]
    return (nvfp4.use_kernels(w, backend) and spec.scaling == "tensor" and spec.rounding == "rne"
            and not spec.hadamard and k % 16 == 0 and n > 0 and (tuple(spec.block) == (1, 16) or n % 16 == 0)
            and w.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _quantize_at_once(w: torch.Tensor, spec: QuantSpec) -> tuple[NVFP4Tensor, torch.Tensor]:
    """A weight [N, K] or all experts [E, N, K] in one kernel launch: (the container, the bf16 copy),
    bitwise what the per-tensor `quantize` calls and `unscaled()` give."""
    from minite.kernels import nvfp4 as kq

    w3 = w.reshape(-1, *w.shape[-2:])
    codes, sb, sdec, amax, vals = kq.quantize_tensors(w3, spec.block, spec.chain)
    if w.ndim == 2:
        codes, sb, vals, sdec, amax = codes[0], sb[0], vals[0], sdec.reshape(()), amax.reshape(())
    else:
        sdec, amax = sdec.reshape(-1, 1, 1), amax.reshape(-1, 1, 1)
    q = NVFP4Tensor(codes, sb, sdec, amax, tuple(w.shape), tuple(spec.block), "tensor", spec.chain, False)
    return q, vals


@torch.no_grad()
def quantize_weights(weights: list[torch.Tensor], spec: QuantSpec) -> list[QuantizedWeight]:
    """`quantize_weight` of several 2D weights of one shape and dtype, stacked into one launch (each
    keeps its own per-tensor scale: bitwise the separate calls); the kernels' case (`_one_launch`)."""
    w = torch.stack([t.detach() for t in weights])  # [E, N, K]
    if not _one_launch(w, spec, "auto"):
        raise ValueError("quantize_weights serves the one-launch case (kernels, per-tensor RNE scaling)")
    if not _DEFERRED:
        nvfp4._check_finite(w)
    q, vals = _quantize_at_once(w, spec)
    sdec, amax = q.global_scale.reshape(-1), q.amax.reshape(-1)
    # each weight's views in one `unbind` per field (host time: the refresh ends the step, no GPU work
    # queued behind it)
    views = zip(q.codes.unbind(0), q.block_scales.unbind(0), sdec.unbind(0), amax.unbind(0), vals.unbind(0))
    out = [QuantizedWeight(NVFP4Tensor(c, b, g, a, tuple(t.shape), q.block, "tensor", q.chain, False), v,
                           spec, weight_key(t, spec)) for t, (c, b, g, a, v) in zip(weights, views)]
    if _DEFERRED:
        _defer([(tuple(t.shape), qw) for t, qw in zip(weights, out)], sdec, amax)
    return out


def _stack(qs: list[NVFP4Tensor]) -> NVFP4Tensor:
    q0 = qs[0]
    return NVFP4Tensor(
        codes=torch.stack([q.codes for q in qs]),
        block_scales=torch.stack([q.block_scales for q in qs]),
        global_scale=torch.stack([q.global_scale for q in qs]).reshape(-1, 1, 1),
        amax=torch.stack([q.amax for q in qs]).reshape(-1, 1, 1),
        shape=(len(qs), *q0.shape), block=q0.block, scaling=q0.scaling, chain=q0.chain,
        hadamard=q0.hadamard,
    )

