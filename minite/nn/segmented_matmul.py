"""The segments of a `SegmentedLinear` (q|k|v, gate|up) as one NVFP4 GEMM launch.

Where the Triton kernels run the recipe's forward (`nvfp4_matmul.use_kernels`: the `aligned` recipe
on CUDA), with the 'dequantized' backward, more than `execution.decode_max_m` rows and
`execution.fused_projections` on (the default), `SegmentedLinear` runs its segments together:

- forward: the input is quantized once (or handed over by the norm before) and one
  `kernels.gemm.gemm_segments` launch multiplies it by the segments' unscaled copies concatenated
  along N (`SegmentedCopy`, made once per weight update), each segment with its own global scale in
  the epilogue and its own output. Each output is bitwise what the segment alone gives (the same K
  order and epilogue per element), so learner and sampler stay aligned whether a forward runs fused
  or not.
- backward (bf16): dX = sum_j S_dec_w,j * (dY_j @ Wu_j) as one mm and in-place addmm's (each
  segment's scale as the GEMM's alpha), dW_j = dY_j^T @ bf16(Xu * S_dec_x) written into the rows of
  the one weight gradient, with the dequantized input made once: the same formulas as a Linear's
  'dequantized' backward (see `minite.nn.linear`), the bf16 roundings at other places (within bf16
  rounding of each other). Before a refresh has brought S_dec to the host, the dX terms are scaled on
  the device and added. fp32 / fp16 models: fp32 GEMMs on the dequantized operands.

One launch and one autograd node instead of two or three take host time off every layer: the aligned
learner step is host-bound on the H200 (benchmarks/results/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minite.kernels import lazy
from minite.nn import nvfp4_matmul as nm
from minite.recipe import Recipe


@dataclass
class SegmentedCopy:
    """The segments' quantized weights, their unscaled copies concatenated along N for the kernels'
    operand dtype and K tile, and what the GEMM and its backward take from them."""

    qweights: tuple
    copy: torch.Tensor  # [N1 + N2 (+ N3), Kp]
    widths: tuple[int, ...]
    scales: torch.Tensor  # fp32 [3]: each segment's epilogue factor, the last repeated for two segments
    sdec: tuple[torch.Tensor, ...]  # each segment's S_dec, fp32 []
    rows: tuple[torch.Tensor, ...]  # segment j's unscaled copy [N_j, K] (views of `copy`)

    @property
    def host_sdec(self) -> tuple[float, ...] | None:
        """Each segment's S_dec on the host, where all are known (after a refresh's sync)."""
        host = [qw.host_global_scale() for qw in self.qweights]
        return None if any(h is None for h in host) else tuple(h[0] for h in host)


def operand_layout(device) -> tuple[torch.dtype, int]:
    """The kernels' operand dtype and the K multiple their aligned tiles take (one BK for every M)."""
    kg = lazy.gemm
    return kg.operand_dtype(device), kg.pick_config("aligned", 1, 1)["BK"]


def segmented_copy(qweights: tuple, recipe: Recipe, in_features: int, device) -> SegmentedCopy:
    """The `SegmentedCopy` of 2-3 segments' quantized weights. Where a segment's own copy is the
    operand (bf16 on the GPU), it becomes a view into the concatenated one (no second copy in
    memory): the returned `qweights` then hold those views; the caller keeps them instead."""
    dt, bk = operand_layout(device)
    parts = [qw.operand(dt, bk) for qw in qweights]
    copy = _adjacent(parts)
    if copy is None:
        copy = torch.cat(parts)
    widths = tuple(p.shape[0] for p in parts)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    rows = tuple(copy[a:a + n, :in_features] for a, n in zip(starts, widths))
    sw = [nm._weight_scale(qw, recipe).reshape(()) for qw in qweights]
    shared = tuple(qw.with_unscaled(view) if part is qw.unscaled else qw
                   for qw, part, view in zip(qweights, parts, rows))
    return SegmentedCopy(shared, copy, widths, torch.stack([*sw, sw[-1]][:3]),
                         tuple(qw.global_scale.reshape(()).float() for qw in qweights), rows)


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts [N_j, K] as one [sum N_j, K] view where they already lie back to back in one storage
    (same-shape segments such as gate and up quantized in one stacked launch), else None (the caller
    concatenates)."""
    p0 = parts[0]
    end = p0.data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != p0.dtype or p.shape[1:] != p0.shape[1:]
                or p.untyped_storage().data_ptr() != p0.untyped_storage().data_ptr() or p.data_ptr() != end):
            return None
        end += p.numel() * p.element_size()
    return p0.as_strided((sum(p.shape[0] for p in parts), p0.shape[1]), (p0.shape[1], 1))


class SegmentedMatmul(torch.autograd.Function):
    """x [..., K] and the segmented weight [sum N_j, K] -> the segments' outputs [..., N_j] (module
    docstring); `quantized`: x's `QuantizedActivation` where the op before made it."""

    @staticmethod
    def forward(ctx, x, seg: SegmentedCopy, recipe: Recipe, quantized, weight):
        kg = lazy.gemm
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        a, sdec, row_factor = quantized if quantized is not None else nm._quantize_rows(x2, recipe)
        m = a.shape[0]
        cfg = kg.pick_config("aligned", m, seg.copy.shape[0])
        outs = kg.gemm_segments(nm._pad_k(a, seg.copy.shape[-1]), row_factor.reshape(-1), seg.copy,
                                seg.scales, seg.widths, recipe.epilogue, x.dtype, cfg)
        ctx.seg, ctx.x_shape, ctx.x_dtype, ctx.w_meta = seg, x.shape, x.dtype, (weight.shape, weight.dtype)
        ctx.save_for_backward(a, sdec)
        lead = x.shape[:-1]
        return tuple(o.view(*lead, o.shape[-1]) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        a, sdec = ctx.saved_tensors  # [M, K] e2m1 * s_b, S_dec_x [M, 1]
        seg, m = ctx.seg, a.shape[0]
        dys = [None if g is None else g.reshape(m, g.shape[-1]) for g in grads]
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[4]
        if a.dtype == torch.bfloat16 and all(d is None or d.dtype == torch.bfloat16 for d in dys):
            dx, dw = _bf16_grads(seg, seg.host_sdec, a, sdec, dys, need_dx, need_dw, ctx.w_meta)
        else:
            dx, dw = _fp32_grads(seg, a, sdec, dys, need_dx, need_dw, ctx.w_meta)
        if dx is not None:
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        return dx, None, None, None, dw


def _segment_grads(seg: SegmentedCopy, dys, xdq: torch.Tensor, w_meta, dtype: torch.dtype) -> torch.Tensor:
    """dW [sum N_j, K] in `dtype`: dY_j^T @ xdq into segment j's rows (zeros where dY_j is None)."""
    dw = xdq.new_empty(w_meta[0], dtype=dtype)
    at = 0
    for dy, n in zip(dys, seg.widths):
        if dy is None:
            dw[at:at + n].zero_()
        else:
            torch.mm(dy.t().to(dtype), xdq, out=dw[at:at + n])
        at += n
    return dw


def _bf16_grads(seg: SegmentedCopy, host_sdec, a, sdec, dys, need_dx, need_dw, w_meta):
    """host_sdec: the segments' S_dec as host floats (after a refresh), or None: then each dX term is
    scaled on the device (`nvfp4_matmul._scale_bf16`, as a Linear's own backward does) and added."""
    dx = None
    if need_dx:
        for j, dy in enumerate(dys):
            if dy is None:
                continue
            if host_sdec is None:
                term = nm._scale_bf16(torch.mm(dy, seg.rows[j]), seg.sdec[j].reshape(1, 1), inplace=True)
                dx = term if dx is None else dx.add_(term)
            elif dx is None:
                dx = torch.mm(dy, seg.rows[j])
                if host_sdec[j] != 1.0:
                    dx.mul_(host_sdec[j])
            else:
                dx.addmm_(dy, seg.rows[j], alpha=host_sdec[j])
        if dx is None:
            dx = a.new_zeros(a.shape)
    dw = None
    if need_dw:
        xdq = nm._scale_bf16(a, sdec)  # the dequantized input, fp32 products rounded once to bf16
        dw = _segment_grads(seg, dys, xdq, w_meta, torch.bfloat16).to(w_meta[1])
    return dx, dw


def _fp32_grads(seg: SegmentedCopy, a, sdec, dys, need_dx, need_dw, w_meta):
    dx = None
    if need_dx:
        dx = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
        for j, dy in enumerate(dys):
            if dy is not None:
                dx += dy.float() @ (seg.rows[j].float() * seg.sdec[j])
    dw = None
    if need_dw:
        dw = _segment_grads(seg, dys, a.float() * sdec, w_meta, torch.float32).to(w_meta[1])
    return dx, dw
