"""Batched W4A4 matmul `y[b] = x[b] @ W[b]^T` as autograd Functions: the core of Linear and MoE.

Shapes: x [B, M, K] (B = 1 for a Linear, B = active experts for MoE, M padded per expert), weights
[E, N, K] with `experts` [B] picking W[b] = W[experts[b]] (None: B == E, or a 2D [N, K] weight).
`grouped_nvfp4_matmul` is the MoE form without padding: rows sorted by expert, `offsets` [E + 1].

Forward (the contract of `minite.ref.gemm`): activations quantized with `recipe.activation` ('row':
one call; 'tensor'/'static': one global scale per batch entry, like one tensor per expert), weights
from the shared `QuantizedWeight`; acc = unscaled_x @ unscaled_w^T in fp32, then `recipe.epilogue`.

Execution (`recipe.execution`, `minite.execution.Execution`; its `backend` 'auto', the default, is
'triton' for CUDA tensors and 'ref' elsewhere):
- 'ref': plain PyTorch on any device (the reference quantizer and fp32 GEMMs).
- 'triton': on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1) with Triton available, and
  when the activations are quantized the way the fused kernels do it (1x16 blocks, RNE, no RHT; any
  chain, weight block shape or epilogue: `aligned`, `te`, `vllm`, `torchao`), the forward quantizes
  the input to exact e2m1 * s_b values plus fp32 decode scales (`kernels.nvfp4.quantize_unscaled`
  per row; `quantize_unscaled_global` for one per-tensor or calibrated static scale) and runs
  `kernels.gemm.w4a4_gemm` (dense) or `kernels.grouped_gemm.grouped_w4a4_gemm` (experts, one launch,
  row-scaled recipes only) in the batch-invariant 'aligned' configuration on the weight's unscaled
  copy, whatever M is. Few rows read the packed weights in a decode layout instead, in the same K
  order (the same bits): M <= `execution.decode_max_m` through `kernels.decode_gemm.aligned_decode_config`,
  MoE experts at <= `execution.decode_max_rows_per_expert` rows per expert on average through
  `kernels.grouped_decode`. A sampler-form weight (no bf16 copy, `minite.nn.sampler_weights`) reads
  its decode layout at every row count (`grouped_decode.decode_gemm_rows` for a dense weight, the
  grouped decode kernel for experts: row tiles, the same K order and bits; K not a multiple of 32:
  the aligned tiles dequantize its packed codes in registers). MoE experts under a per-tensor or
  static activation scale (one scale per expert), stochastic rounding or RHT on activations run the
  reference GEMM, with activations and weights quantized by the kernels on CUDA (bitwise the same
  codes and scales). `execution.fast` gives up the alignment for speed: M <= 64 runs the decode GEMM
  on the weight's decode layout (K a multiple of 32, split-K where N is small), larger M 'prefill'.
  Kernel outputs equal the reference wherever the fp32 accumulation across 16-blocks is exact (nearly
  all outputs) and differ by at most one fp32 rounding per 16-block otherwise (`minite.ref.gemm`).

Non-finite inputs: on the CPU the quantizer raises a ValueError, as `minite.nvfp4.quantize` does. On
CUDA that check would synchronize with the host on every call, so it is skipped and replaced by a
device-side mark: a row ('row' scaling) or a whole batch entry ('tensor' / 'static') holding a
non-finite value gets a NaN global scale, so its outputs (and gradients) are NaN.

Backward (see `minite.nn.linear` for the three GEMMs), the same for both backends: 'dequantized' uses
dY as is and the dequantized forward operands (bf16 models: bf16 GEMMs on the unscaled operands, the
scales applied around them; fp32 models: fp32 GEMMs); 'nvfp4' quantizes dY for dgrad (1x16 along N,
stochastic rounding, per-tensor scale) and dY^T, X^T for wgrad (1x16 along the tokens M, zero-padded
to 16, RHT on both, stochastic rounding on dY^T, RNE on X^T), its GEMMs in fp32 on dequantized
values. The grouped form pads its rows to [E, C, *] first (one host sync, C = the largest
expert's row count), or, where `execution.grouped_mm` is on, runs bf16 rows on `torch._grouped_mm`
unpadded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from minite import nvfp4
from minite.execution import runs_kernels
from minite.kernels import lazy
from minite.nn.quantized_weight import QuantizedWeight
from minite.nvfp4 import quantize
from minite.recipe import QuantSpec, Recipe
from minite.ref.gemm import apply_epilogue, epilogue_scale

DGRAD_DY_SPEC = QuantSpec(scaling="tensor", block=(1, 16), rounding="stochastic")
WGRAD_DY_SPEC = QuantSpec(scaling="tensor", block=(1, 16), rounding="stochastic", hadamard=True)
WGRAD_X_SPEC = QuantSpec(scaling="tensor", block=(1, 16), rounding="rne", hadamard=True)
FAST_DECODE_MAX_M = 64  # the kernels' 'decode' config serves M <= 64
# `execution.decode_max_m` (64): on the H200 at Qwen3-8B shapes the aligned decode layout ran 1.9-3.3x
# the aligned tile on the copy at M <= 32, 1.3-1.7x at 64 (benchmarks/results/h200/decode_gemm.json).
# `execution.decode_max_rows_per_expert` (64): MoE experts of a decode step read the packed weights
# (0.625 bytes per weight, dequantized in registers) on `kernels.grouped_decode`.


class Operand(NamedTuple):
    """A quantized batched operand, as much of it as the GEMM needs."""

    unscaled: torch.Tensor  # [B, R, C] fp32, e2m1 * s_b (exact in bf16)
    global_scale: torch.Tensor  # [B, R, 1] (row) or [B, 1, 1] fp32, S_dec
    amax: torch.Tensor  # same shape as global_scale

    def dequantize(self) -> torch.Tensor:
        return self.unscaled * self.global_scale  # [B, R, C] fp32


def quantize_backend(recipe: Recipe) -> str:
    """The `minite.nvfp4.quantize` backend a recipe's quantizations use: the kernels on CUDA unless
    the recipe forces the reference."""
    return "ref" if recipe.execution.backend == "ref" else "auto"


def kernels_cover(recipe: Recipe) -> bool:
    """Whether the fused activation quantizer + W4A4 GEMM kernels implement this recipe's forward:
    1x16 activation blocks, RNE, no RHT, any activation scaling ('row'; 'tensor' and 'static' for
    dense layers, see `row_scaled`), any chain, weight block shape or epilogue."""
    a = recipe.activation
    return (recipe.fp4 and tuple(a.block) == (1, 16) and a.rounding == "rne" and not a.hadamard
            and recipe.weight.scaling != "row")


def row_scaled(recipe: Recipe) -> bool:
    """Per-token activation scales: a row's quantization needs no other row, so the grouped MoE
    kernels (rows of many experts in one launch) and the ops that quantize their output for the next
    GEMM (norm, SwiGLU) can produce it. 'tensor' / 'static' scaling run on the kernels for dense
    layers (one global scale for the whole input) and on the reference for MoE experts."""
    return recipe.activation.scaling == "row"


_USE_KERNELS: dict = {}  # (id(recipe), device type) -> (recipe, answer): asked on every linear call


def use_kernels(recipe: Recipe, device: torch.device) -> bool:
    """Whether a forward on `device` under `recipe` runs the Triton kernels (module docstring)."""
    dev = device.type if isinstance(device, torch.device) else torch.device(device).type
    hit = _USE_KERNELS.get((id(recipe), dev))
    if hit is not None and hit[0] is recipe:
        return hit[1]
    answer = _use_kernels(recipe, dev)
    if len(_USE_KERNELS) > 1024:  # recipes made over and over (sweeps): keep the cache small
        _USE_KERNELS.clear()
    _USE_KERNELS[(id(recipe), dev)] = (recipe, answer)
    return answer


def _use_kernels(recipe: Recipe, device_type: str) -> bool:
    return kernels_cover(recipe) and runs_kernels(recipe.execution.backend, device_type)


def use_grouped_kernels(recipe: Recipe, device: torch.device) -> bool:
    """Whether MoE experts on `device` under `recipe` run the grouped kernels (sorted rows, one
    launch): the kernels run the recipe and its activations are row-scaled."""
    return use_kernels(recipe, device) and row_scaled(recipe)


def _mark_non_finite(x: torch.Tensor, scales, per_row: bool) -> list[torch.Tensor]:
    """NaN into `scales` for the rows (per_row: x [..., R, C], scales [..., R, 1]) or batch entries
    (x [B, R, C], scales [B, 1, 1]) of x holding a non-finite value: the device-side replacement of
    the host-side finiteness check on CUDA (no synchronization)."""
    if per_row:
        ok = torch.isfinite(x).all(dim=-1, keepdim=True)
    else:
        ok = torch.isfinite(x).flatten(1).all(dim=1).reshape(-1, 1, 1)
    return [s.masked_fill(~ok, float("nan")) for s in scales]


def quantize_operand(x: torch.Tensor, spec: QuantSpec, static_scale: torch.Tensor | None = None,
                     generator: torch.Generator | None = None, backend: str = "ref") -> Operand:
    """x [B, R, C] quantized along C; 'tensor'/'static' scaling gets one global scale per b
    (static_scale [B] holds the decode scales). Non-finite x: see the module docstring."""
    kw = spec.kwargs()
    host_check = x.device.type != "cuda"
    if spec.scaling == "row":
        q = quantize(x, generator=generator, check_finite=host_check, backend=backend, **kw)
        gs, amax = q.global_scale, q.amax
        if not host_check:
            gs, amax = _mark_non_finite(x, (gs, amax), per_row=True)
        return Operand(q.unscaled(), gs, amax)
    if spec.scaling == "static" and static_scale is None:
        raise RuntimeError("static activation scaling needs a calibrated input scale")
    qs = [quantize(x[b], generator=generator, static_scale=None if static_scale is None else static_scale[b],
                   check_finite=host_check, backend=backend, **kw) for b in range(x.shape[0])]
    gs = torch.stack([q.global_scale for q in qs]).reshape(-1, 1, 1)
    amax = torch.stack([q.amax for q in qs]).reshape(-1, 1, 1)
    if not host_check:
        gs, amax = _mark_non_finite(x, (gs, amax), per_row=False)
    return Operand(torch.stack([q.unscaled() for q in qs]), gs, amax)


def matmul_t(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b[B, N, K]^T in fp32 -> [B, M, N]; B == 1 runs one 2D mm (as `ref.gemm` does)."""
    if a.shape[0] == 1:
        return (a[0].float() @ b[0].float().T).unsqueeze(0)
    return torch.bmm(a.float(), b.float().transpose(1, 2))


class StaticScale(NamedTuple):
    """A calibrated activation decode scale and what the kernel quantizer derives from it, made once
    per calibration (`static_scale`), so the forward neither syncs nor copies constants to the device."""

    scale: torch.Tensor  # [1] fp32, S_dec (the reference path's input)
    kernel: torch.Tensor | None  # [3] fp32 (S_enc, S_dec, amax = S_dec * 2688); None on the reference
    key: tuple  # identifies the scale it was made from (the quantized-input memo's key)


def static_scale(scale: torch.Tensor, recipe: Recipe) -> StaticScale:
    """The `StaticScale` of a calibrated input scale under `recipe` (its chain)."""
    s = scale.reshape(1)
    key = (scale.data_ptr(), scale._version, recipe.activation.chain)
    if not use_kernels(recipe, scale.device):
        return StaticScale(s, None, key)
    return StaticScale(s, lazy.nvfp4.static_global_scales(s, recipe.activation.chain), key)


class _Scales(NamedTuple):
    global_scale: torch.Tensor
    amax: torch.Tensor


class QuantizedActivation(NamedTuple):
    """A GEMM input quantized on the kernels, as its rows: what an op that quantizes its output (a
    norm, SwiGLU) hands the linear that reads it, and what a segmented linear shares among its
    segments. Bitwise what the linear's own quantizer would give."""

    values: torch.Tensor  # [R, K] e2m1 * s_b in the kernels' operand dtype
    sdec: torch.Tensor  # [R, 1] fp32 S_dec (with 'tensor' / 'static' scaling every row the one value)
    row_factor: torch.Tensor  # [R, 1] fp32, the epilogue's row factor: S_dec, or amax for 'alpha'


def quantize_input(x: torch.Tensor, recipe: Recipe, static: StaticScale | None = None) -> QuantizedActivation:
    """x [..., K] quantized on the kernels for a dense linear under `recipe` (`use_kernels`)."""
    return QuantizedActivation(*_quantize_rows(x.reshape(-1, x.shape[-1]), recipe, static))


def hands_over(x: torch.Tensor, recipe: Recipe) -> bool:
    """Whether the op producing x quantizes it for the NVFP4 linear that reads it next (`handed_over`):
    that linear runs the kernels with per-row scales, and K is a multiple of 16."""
    return x.shape[-1] % 16 == 0 and use_kernels(recipe, x.device) and row_scaled(recipe)


def handed_over(recipe: Recipe, device: torch.device, produce) -> tuple[torch.Tensor, QuantizedActivation]:
    """Run an op that also quantizes its output for the linear reading it next (where `hands_over`):
    `produce(operand dtype, chain)` -> (out, values e2m1 * s_b, S_dec, amax) -> (out, its quantization)."""
    out, values, sdec, amax = produce(lazy.gemm.operand_dtype(device), recipe.activation.chain)
    k = out.shape[-1]
    factor = amax if recipe.epilogue == "alpha" else sdec
    return out, QuantizedActivation(values.reshape(-1, k), sdec.reshape(-1, 1), factor.reshape(-1, 1))


def _quantize_rows(x2: torch.Tensor, recipe: Recipe, static: StaticScale | None = None):
    kg, kq = lazy.gemm, lazy.nvfp4
    chain, scaling = recipe.activation.chain, recipe.activation.scaling
    nvfp4._check_args(x2, "row", (1, 16), "rne", chain, None)
    nvfp4._pad_or_raise(x2, (1, 16), pad=False)
    host_check = x2.device.type != "cuda"
    if host_check:
        nvfp4._check_finite(x2)
    dt = kg.operand_dtype(x2.device)
    # on CUDA a row (or, with one global scale, the whole input) holding inf or NaN gets NaN scales
    # from the kernel itself (no host check)
    if scaling != "row":
        if scaling == "static" and static is None:
            raise RuntimeError("static activation scaling needs a calibrated input scale")
        a, sdec, amax = kq.quantize_unscaled_global(x2, dt, chain, None if static is None else static.kernel)
        return a, sdec, amax if recipe.epilogue == "alpha" else sdec
    if recipe.epilogue == "alpha":
        a, sdec, _, _, amax = kq.quantize_unscaled(x2, dt, chain, return_codes=True)
    else:
        a, sdec = kq.quantize_unscaled(x2, dt, chain)
        amax = sdec
    return a, sdec, amax


def _pad_k(a: torch.Tensor, k: int) -> torch.Tensor:
    return F.pad(a, (0, k - a.shape[-1])) if a.shape[-1] != k else a


def _weight_scale(qweight: QuantizedWeight, recipe: Recipe) -> torch.Tensor:
    """The weight's epilogue factor, fp32 flat: [] (a Linear) or [E] (experts); made once per weight."""
    return qweight.epilogue_scale(recipe.epilogue == "alpha")


def _dense_kernel(x2: torch.Tensor, qweight: QuantizedWeight, recipe: Recipe,
                  static: StaticScale | None = None, quantized: QuantizedActivation | None = None):
    """x2 [M, K] times a 2D weight on the kernels -> (out [M, N] in x2.dtype, a, S_dec); `quantized`:
    x2's quantization, made by the op before (else quantized here)."""
    kd, kg = lazy.decode_gemm, lazy.gemm
    a, sdec, row_factor = quantized if quantized is not None else _quantize_rows(x2, recipe, static)
    m, k = a.shape
    n = qweight.shape[-2]
    sw = _weight_scale(qweight, recipe)
    fast = recipe.execution.fast
    config = "prefill" if fast else "aligned"
    if m <= (FAST_DECODE_MAX_M if fast else recipe.execution.decode_max_m) and k % kd.KGROUP == 0:
        # few rows: the weight read packed (decode layout), in the aligned K order unless `fast`
        out = kd.decode_gemm(a, row_factor, qweight.decode_weight(a.dtype), sw, recipe.epilogue,
                             x2.dtype, None if fast else kd.aligned_decode_config(m, k))
    elif reads_codes(qweight) and k % kd.KGROUP == 0 and not fast:
        # a sampler-form weight: the decode layout at any row count, in BM-row tiles (the same bits)
        out = lazy.grouped_decode.decode_gemm_rows(a, row_factor, qweight.decode_weight(a.dtype), sw,
                                                   recipe.epilogue, x2.dtype)
    elif reads_codes(qweight):
        cfg = kg.pick_config(config, m, n)
        codes, scales = packed_operand(qweight, cfg["BK"])  # [N, Kp // 2], [N, Kp // 16]
        out = kg.w4a4_gemm(_pad_k(a, 2 * codes.shape[-1]), row_factor.reshape(-1), codes, sw, scales,
                           recipe.epilogue, x2.dtype, cfg)
    else:
        cfg = kg.pick_config(config, m, n)
        w = qweight.operand(a.dtype, cfg["BK"])  # [N, Kp]
        ap = _pad_k(a, w.shape[-1])
        out = kg.gemm_on_copy(ap, row_factor.reshape(-1), w, sw, recipe.epilogue, x2.dtype, cfg)
    return out, a, sdec


def reads_codes(qweight: QuantizedWeight) -> bool:
    """Whether a GEMM above the decode threshold reads this weight packed: a sampler-form weight (no
    bf16 copy); else the bf16 copy."""
    return qweight.unscaled is None


def packed_operand(qweight: QuantizedWeight, k_multiple: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's codes [..., N, Kp // 2] and E4M3 block scales [..., N, Kp // 16] as the GEMMs'
    packed operand, K zero-padded to a multiple of k_multiple (code 0 and scale 0 add nothing; a
    padded copy of the packed bytes only where K needs it)."""
    q, n = qweight.q, qweight.shape[-2]
    codes, scales = q.codes[..., :n, :], q.block_scales[..., :n, :]
    pad = -(2 * codes.shape[-1]) % k_multiple
    if pad:
        codes = F.pad(codes, (0, pad // 2))
        scales = F.pad(scales.view(torch.uint8), (0, pad // 16)).view(torch.float8_e4m3fn)
    return codes, scales


def _grouped_kernel(xs: torch.Tensor, qweight: QuantizedWeight, recipe: Recipe, offsets: torch.Tensor,
                    quantized: QuantizedActivation | None = None, rows: torch.Tensor | None = None):
    """xs [R, K] sorted by expert, offsets [E + 1] -> (out [R, N] in xs.dtype, a, S_dec); one launch.
    `rows` [R]: sorted row r is xs[rows[r]] (xs the tokens, quantized once each; a, S_dec theirs)."""
    from minite import kernels
    from minite.kernels import grouped_decode as gd
    from minite.kernels import grouped_gemm as gg

    a, sdec, row_factor = quantized if quantized is not None else _quantize_rows(xs, recipe)
    config = "prefill" if recipe.execution.fast else "aligned"
    bk = gg.CONFIGS["interpret" if kernels.interpreted() else config]["BK"]
    e, n, k = qweight.shape
    sw = _weight_scale(qweight, recipe)
    r = xs.shape[0] if rows is None else rows.numel()
    few_rows = r <= recipe.execution.decode_max_rows_per_expert * e
    if (few_rows or reads_codes(qweight) and not recipe.execution.fast) and k % gd.KGROUP == 0:
        # few rows per expert (decode), or a sampler-form weight at any row count: read the 4-bit codes
        # in the decode layout, not a bf16 copy
        out = gd.grouped_decode_gemm(a, row_factor, qweight.decode_weight(a.dtype), sw, offsets,
                                     recipe.epilogue, xs.dtype, rows=rows)
        return out, a, sdec
    ga, gf = (a, row_factor) if rows is None else (a[rows], row_factor[rows])  # the sorted rows
    if reads_codes(qweight):
        codes, scales = packed_operand(qweight, bk)  # [E, N, Kp // 2], [E, N, Kp // 16]
        out = gg.grouped_w4a4_gemm(_pad_k(ga, 2 * codes.shape[-1]), gf, codes, sw, offsets, scales,
                                   recipe.epilogue, xs.dtype, config)
        return out, a, sdec
    w = qweight.operand(a.dtype, bk)  # [E, N, Kp]
    out = gg.grouped_w4a4_gemm(_pad_k(ga, w.shape[-1]), gf, w, sw, offsets, None, recipe.epilogue,
                               xs.dtype, config)
    return out, a, sdec


def _expert_offsets(experts: torch.Tensor, rows: int, num_experts: int) -> torch.Tensor:
    """Ascending, distinct `experts` [B], each owning `rows` consecutive rows -> offsets [E + 1]."""
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device).index_fill_(0, experts, rows)
    return F.pad(torch.cumsum(counts, 0), (1, 0))


class NVFP4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, qweight: QuantizedWeight, recipe: Recipe, static_scale, experts,
                quantized=None):
        b, m, k = x.shape
        static = static_scale if isinstance(static_scale, StaticScale) else None
        if static is not None:
            static_scale = static.scale
        dense = len(qweight.shape) == 2
        if use_kernels(recipe, x.device) and x.numel() and (row_scaled(recipe) or (dense and b == 1)):
            x2 = x.reshape(b * m, k)
            if dense:
                out, a, sdec = _dense_kernel(x2, qweight, recipe, static, quantized)
            else:
                e = qweight.shape[0]
                ids = torch.arange(e, device=x.device) if experts is None else experts
                out, a, sdec = _grouped_kernel(x2, qweight, recipe, _expert_offsets(ids, m, e))
            out = out.reshape(b, m, -1)
            xu, xs = a.reshape(b, m, k), sdec.reshape(b, m, 1)
        else:
            wu, ws, wa = qweight.batched()  # [E, N, K] bf16, [E, 1, 1], [E, 1, 1]
            if experts is not None:
                wu, ws, wa = wu[experts], ws[experts], wa[experts]
            xo = quantize_operand(x, recipe.activation, static_scale, backend=quantize_backend(recipe))
            acc = matmul_t(xo.unscaled, wu)  # [B, M, N] fp32
            scale = epilogue_scale(xo, _Scales(ws, wa), recipe.epilogue)  # [B, M | 1, 1]
            out = apply_epilogue(acc, scale, recipe.epilogue, x.dtype)
            xu, xs = xo.unscaled.to(torch.bfloat16), xo.global_scale
        ctx.mode, ctx.experts, ctx.weight_meta = recipe.backward, experts, (weight.shape, weight.dtype)
        ctx.qweight, ctx.x_dtype, ctx.backend = qweight, x.dtype, quantize_backend(recipe)
        ctx.save_for_backward(*((xu, xs) if recipe.backward == "dequantized" else (x,)))
        host_ws = qweight.host_global_scale()
        lean = (recipe.backward == "dequantized" and host_ws is not None and dense
                and qweight.unscaled is not None and x.dtype == weight.dtype == xu.dtype == torch.bfloat16)
        ctx.dense_bf16 = (qweight.unscaled, host_ws[0]) if lean else None
        return out

    @staticmethod
    def backward(ctx, dy):
        _check_trainable(ctx.qweight)
        if ctx.dense_bf16 is not None and dy.dtype == torch.bfloat16:
            return (*_dense_bf16_grads(ctx, dy), None, None, None, None, None)
        wu, ws, _ = ctx.qweight.batched()
        if ctx.experts is not None:
            wu, ws = wu[ctx.experts], ws[ctx.experts]
        host_ws = ctx.qweight.host_global_scale() if ctx.experts is None and wu.shape[0] == 1 else None
        dx, dw = _grads(ctx, dy, wu, ws, ctx.saved_tensors, host_ws[0] if host_ws else None)
        if dx is not None:
            dx = dx.to(ctx.x_dtype)
        if dw is not None:
            dw = _scatter_experts(dw, ctx.experts, ctx.weight_meta[0]).to(ctx.weight_meta[1])
        return dx, dw, None, None, None, None, None


class GroupedNVFP4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xs, weight, qweight: QuantizedWeight, recipe: Recipe, offsets, row_experts,
                quantized=None, rows=None, keep=True):
        """`rows`: sorted row r is xs[rows[r]]; `keep`: save what the backward needs (grad mode on)."""
        out, a, sdec = _grouped_kernel(xs, qweight, recipe, offsets, quantized, rows)
        ctx.mode, ctx.qweight, ctx.x_dtype, ctx.w_dtype = recipe.backward, qweight, xs.dtype, weight.dtype
        ctx.backend, ctx.grouped_mm = quantize_backend(recipe), recipe.execution.grouped_mm_on(weight.device)
        ctx.tokens = xs.shape[0] if rows is not None else None
        if keep:
            saved = (a, sdec) if recipe.backward == "dequantized" else (xs,)
            if rows is not None:
                saved = tuple(t[rows] for t in saved)
            ctx.save_for_backward(offsets, row_experts, rows, *saved)
        return out

    @staticmethod
    def backward(ctx, dy):
        _check_trainable(ctx.qweight)
        offsets, row_experts, rows, *saved = ctx.saved_tensors
        dx, dw = GroupedNVFP4Matmul._sorted_grads(ctx, dy, offsets, row_experts, saved)
        if dx is not None and rows is not None:
            # the backward of the gather xs[rows]: each token's rows summed (what autograd's indexing does)
            dx = dx.new_zeros(ctx.tokens, dx.shape[-1]).index_put_((rows,), dx, accumulate=True)
        return dx, dw, None, None, None, None, None, None, None

    @staticmethod
    def _sorted_grads(ctx, dy, offsets, row_experts, saved):
        if ctx.grouped_mm and ctx.mode == "dequantized" and dy.dtype == torch.bfloat16 and \
                grouped_mm_applies(dy, ctx.qweight.unscaled):
            return _grouped_mm_grads(ctx, dy.contiguous(), offsets, row_experts, *saved)
        num_experts = offsets.numel() - 1
        # the padded [E, C, *] layout of the reference path; C costs one host sync (backward only)
        cap = int((offsets[1:] - offsets[:-1]).max())
        rank = torch.arange(dy.shape[0], device=dy.device) - offsets[row_experts]

        def pad(t):
            return t.new_zeros(num_experts, cap, t.shape[-1]).index_put((row_experts, rank), t)

        wu, ws, _ = ctx.qweight.batched()
        dx, dw = _grads(ctx, pad(dy), wu, ws, [pad(t) for t in saved])
        if dx is not None:
            dx = dx[row_experts, rank].to(ctx.x_dtype)
        if dw is not None:
            dw = dw.to(ctx.w_dtype)
        return dx, dw


def _check_trainable(qweight: QuantizedWeight) -> None:
    if qweight.unscaled is None:
        raise RuntimeError("a sampler-only model (`minite.nn.sampler_weights`) has no backward: its "
                           "quantized layers hold NVFP4 codes, not trainable weights; train the full model")


def grouped_mm_applies(t: torch.Tensor, w: torch.Tensor) -> bool:
    """`torch._grouped_mm` can take bf16 rows `t` [R, N] against weights `w` [E, N, K] here: it exists;
    CUDA sm90+ or the CPU; 16-byte aligned strides (N and K multiples of 8)."""
    if not hasattr(torch, "_grouped_mm") or t.shape[-1] % 8 or w.shape[-1] % 8:
        return False
    if t.device.type == "cuda":
        return torch.cuda.get_device_capability(t.device) >= (9, 0)
    return t.device.type == "cpu"


def _grouped_mm_grads(ctx, dy, offsets, row_experts, a, sdec):
    """The 'dequantized' backward of bf16 experts on sorted rows, one `torch._grouped_mm` per GEMM:
    no padding to [E, C, *], no host sync. dX = (dY @ Wu_e) * S_dec_w[e]; dW_e = (dY * S_dec_x)^T @ Xu
    over expert e's rows (bf16 operands, fp32 accumulation; the scales applied around the GEMMs)."""
    wu, ws, _ = ctx.qweight.batched()  # [E, N, K] bf16, S_dec_w [E, 1, 1]
    offs = offsets[1:].to(torch.int32)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = torch._grouped_mm(dy, wu.to(dy.dtype), offs=offs)
        _scale_bf16(dx, ws.reshape(-1)[row_experts][:, None], inplace=True)
        dx = dx.to(ctx.x_dtype)
    if ctx.needs_input_grad[1]:
        dyx = _scale_bf16(dy, sdec)  # [R, N], the fp32 product rounded to bf16
        dw = torch._grouped_mm(dyx.t(), a.to(dy.dtype), offs=offs).to(ctx.w_dtype)  # [E, N, K]
    return dx, dw


class LinearMatmul(NVFP4Matmul):
    """`NVFP4Matmul` for a Linear: x [..., K] as one batch entry -> [..., N] (`quantized`: x's
    `QuantizedActivation` where the op before made it). The reshapes happen inside, so autograd
    records no view nodes around the GEMM (host time on every call)."""

    @staticmethod
    def forward(ctx, x, weight, qweight: QuantizedWeight, recipe: Recipe, static_scale, quantized=None):
        ctx.x_shape = x.shape
        out = NVFP4Matmul.forward(ctx, x.reshape(1, -1, x.shape[-1]), weight, qweight, recipe, static_scale,
                                  None, quantized)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dx, dw, *_ = NVFP4Matmul.backward(ctx, dy.reshape(1, -1, dy.shape[-1]))
        return None if dx is None else dx.reshape(ctx.x_shape), dw, None, None, None, None


def _dense_bf16_grads(ctx, dy: torch.Tensor):
    """`_grads`' bf16 'dequantized' case for one 2D weight whose S_dec the host knows, with the same
    ops (the same bits) and less host work: 2D GEMMs, the dW row scale launched without re-checks.
    dy [1, M, N] -> (dX [1, M, K] or None, dW [N, K] or None)."""
    xu, xs = ctx.saved_tensors  # [1, M, K] bf16, [1, M | 1, 1] fp32
    wu, s = ctx.dense_bf16  # [N, K] bf16, S_dec_w as a float
    m, k = xu.shape[1:]
    dy2 = dy.view(m, -1) if dy.is_contiguous() else dy.reshape(m, -1)
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = torch.mm(dy2, wu).mul_(s).view(1, m, k)
    if ctx.needs_input_grad[1]:
        dyx = torch.empty_like(dy2, memory_format=torch.contiguous_format)
        if dy2.is_cuda and dy2.is_contiguous():
            lazy.scale.scale_rows_2d(dy2, xs.reshape(-1), dyx)
        else:
            torch.mul(dy2, xs.reshape(-1, 1), out=dyx)
        dw = torch.mm(dyx.t(), xu.view(m, k))
    return dx, dw


def _scale_bf16(x: torch.Tensor, row_scale: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """bf16 x [..., C] times fp32 row_scale [..., 1] (the product in fp32, rounded once to bf16): the
    one-pass kernel on CUDA (`minite.kernels.scale`), torch's mixed-dtype mul elsewhere; same bits."""
    out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.is_cuda and x.is_contiguous():
        if row_scale.numel() != 1:  # one scale for all rows stays a single number (no per-row copy)
            row_scale = row_scale.expand(*x.shape[:-1], 1).reshape(-1)
        return lazy.scale.scale_rows(x, row_scale, out=out)
    return torch.mul(x, row_scale, out=out)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N]; B == 1 (a Linear) as one 2D `torch.mm`, as a bf16 Linear's own
    backward runs it (and with less host work than the batched call)."""
    return torch.mm(a[0], b[0]).unsqueeze(0) if a.shape[0] == 1 else torch.bmm(a, b)


def _grads(ctx, dy: torch.Tensor, wu: torch.Tensor, ws: torch.Tensor, saved, host_ws: float | None = None):
    """(dX [B, M, K], dW [B, N, K]) from dY [B, M, N] (None where not needed). `host_ws`: the one
    weight's S_dec as a host float, when known (then dX's scale is torch's bf16 times a Python scalar:
    the same fp32 product and rounding as `_scale_bf16`, one cheap launch).

    'dequantized' with bf16 dY (bf16 models), results in bf16: the two GEMMs run in bf16 with fp32
    accumulation, on the unscaled operands (e2m1 * s_b: exact in bf16) with the global and row scales
    applied around them, as a bf16 model's own backward would; one extra bf16 rounding of dX's GEMM
    output before its scale, and of dY * S_dec_x[m] before dW's GEMM. The scale multiplies write bf16
    directly (no fp32 copies of dX or dY).
    Otherwise (fp32 dY, or the 'nvfp4' backward): fp32 GEMMs on the dequantized values, in fp32."""
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.mode == "dequantized" and dy.dtype == torch.bfloat16:
        xu, xs = saved
        dx = dw = None
        if need_dx:  # bf16 GEMM output times the fp32 scale, rounded once more to bf16
            dx = _bmm(dy, wu.to(dy.dtype))
            if host_ws is not None:
                dx.mul_(host_ws)
            else:
                _scale_bf16(dx, ws, inplace=True)  # ws [B, 1, 1] broadcasts over the rows
        if need_dw:
            dyx = _scale_bf16(dy, xs)  # fp32 product, rounded to bf16
            dw = _bmm(dyx.transpose(1, 2), xu.to(dy.dtype))  # [B, N, K]
        return dx, dw
    dyf = dy.float()
    w_dq = wu.float() * ws  # [B, N, K]
    if ctx.mode == "dequantized":
        xu, xs = saved
        dx = dyf @ w_dq if need_dx else None
        dw = dyf.transpose(1, 2) @ (xu.float() * xs) if need_dw else None
    else:
        (x,) = saved
        dyq = quantize_operand(dyf, DGRAD_DY_SPEC, backend=ctx.backend) if need_dx else None
        dx = dyq.dequantize() @ w_dq if need_dx else None
        dw = _wgrad_nvfp4(dyf, x, ctx.backend) if need_dw else None
    return dx, dw


def _wgrad_nvfp4(dy: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
    """dW [B, N, K] = Q_sr(RHT(dY^T)) @ Q_rne(RHT(X^T))^T, both along the token dimension."""
    pad = -x.shape[1] % 16
    dyt = F.pad(dy.transpose(1, 2), (0, pad))  # [B, N, Mp]
    xt = F.pad(x.float().transpose(1, 2), (0, pad))  # [B, K, Mp]
    a = quantize_operand(dyt, WGRAD_DY_SPEC, backend=backend).dequantize()
    b = quantize_operand(xt, WGRAD_X_SPEC, backend=backend).dequantize()
    return a @ b.transpose(1, 2)


def _scatter_experts(dw: torch.Tensor, experts: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    if experts is None:
        return dw.reshape(shape)
    return dw.new_zeros(shape).index_copy_(0, experts, dw)


def nvfp4_matmul(x: torch.Tensor, weight: torch.Tensor, qweight: QuantizedWeight, recipe: Recipe,
                 static_scale: torch.Tensor | None = None, experts: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [B, M, K], weight [N, K] or [E, N, K] (the parameter, for its gradient) -> [B, M, N] in x.dtype.
    On the kernels, `experts` must be ascending and distinct (as `moe.group_by_expert` gives them)."""
    if x.ndim != 3:
        raise ValueError(f"nvfp4_matmul expects x [B, M, K]; got shape {tuple(x.shape)}")
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"in_features mismatch: x has {x.shape[-1]}, weight has {weight.shape[-1]}")
    return NVFP4Matmul.apply(x, weight, qweight, recipe, static_scale, experts)


def grouped_nvfp4_matmul(xs: torch.Tensor, weight: torch.Tensor, qweight: QuantizedWeight, recipe: Recipe,
                         offsets: torch.Tensor, row_experts: torch.Tensor,
                         quantized: QuantizedActivation | None = None,
                         rows: torch.Tensor | None = None) -> torch.Tensor:
    """xs [R, K] sorted by expert (expert e owns rows offsets[e] .. offsets[e + 1]; row_experts [R] the
    expert of each row), weight [E, N, K] -> [R, N] in xs.dtype (`quantized`: xs's quantization where
    the op before made it), on the kernels only (`use_kernels`)
    and without any host synchronization in the forward. `rows` [R]: the sorted rows are xs[rows]
    (xs the tokens [T, K], quantized once per token; the decode kernel reads each where an expert
    takes it, the other paths gather; the same bits as xs[rows] passed in). With
    `execution.grouped_mm` on, the 'dequantized' backward of bf16 rows runs on `torch._grouped_mm`
    (where `grouped_mm_applies`) instead of the padded layout."""
    if xs.ndim != 2 or weight.ndim != 3 or xs.shape[-1] != weight.shape[-1]:
        raise ValueError(f"grouped_nvfp4_matmul expects xs [R, K] and weight [E, N, K]; got "
                         f"{tuple(xs.shape)} and {tuple(weight.shape)}")
    if rows is not None and (rows.ndim != 1 or rows.numel() != row_experts.numel()):
        raise ValueError(f"rows must be [R = {row_experts.numel()}], got {tuple(rows.shape)}")
    if not use_grouped_kernels(recipe, xs.device):
        raise ValueError(f"recipe {recipe.name!r} (backend {recipe.execution.backend!r}) on {xs.device} "
                         "does not run on the grouped Triton kernels; use nvfp4_matmul on the padded layout")
    keep = torch.is_grad_enabled() and (xs.requires_grad or weight.requires_grad)
    return GroupedNVFP4Matmul.apply(xs, weight, qweight, recipe, offsets, row_experts, quantized, rows, keep)
