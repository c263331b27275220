"""Projections that read the same input (q/k/v, gate/up) as one NVFP4 GEMM launch.

`project(x, linears, owner)` returns `[lin(x) for lin in linears]`. Where the Triton kernels run the
recipe's forward (`nvfp4_matmul.use_kernels`: the `aligned` recipe on CUDA), with the 'dequantized'
backward, more than `execution.decode_max_m` rows, no bias, no hooks and no calibration on the
linears, and `execution.fused_projections` on (the default), it computes them together:

- forward: the input is quantized once (as it already was, through the forward scope's memo) and one
  `kernels.gemm.gemm_segments` launch multiplies it by the weights' unscaled copies concatenated
  along N, each weight with its own global scale in the epilogue and its own output. Each output is
  bitwise what the linear alone gives (the same K order and epilogue per element), so learner and
  sampler stay aligned whether a forward runs fused or not.
- backward (bf16): dX = sum_j S_dec_w,j * (dY_j @ Wu_j) as one mm and in-place addmm's (each weight's
  scale as the GEMM's alpha), dW_j = dY_j^T @ bf16(Xu * S_dec_x) with the dequantized input made once
  for the group: 2 + (weights - 1) + 1 + weights launches instead of 4 per weight plus autograd's
  additions of the dX's. The same formulas as the separate linears' 'dequantized' backward (see
  `minite.nn.linear`), the bf16 roundings at other places (within bf16 rounding of each other).
  Before a refresh has brought S_dec to the host, the dX terms are scaled on the device and added.
  fp32 / fp16 models: fp32 GEMMs on the dequantized operands.

The concatenated copy is made once per weight update (when a member's `QuantizedWeight` changes),
cached on `owner`; the members' own copies then become views into it (no second copy in memory).
One launch and one autograd node instead of two or three take host time off every layer: the aligned
learner step is host-bound on the H200 (benchmarks/results/).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minite.kernels import lazy
from minite.nn import nvfp4_matmul as nm
from minite.recipe import Recipe


def project(x: torch.Tensor, linears, owner: torch.nn.Module) -> list[torch.Tensor]:
    """`[lin(x) for lin in linears]` for 2 or 3 `minite.nn.Linear` reading x, in one GEMM where it
    applies (module docstring); the concatenated weight copy is cached on `owner`."""
    if not _fusable(x, linears):
        return [lin(x) for lin in linears]
    recipe = linears[0].recipe
    group = _group(owner, linears, recipe, x.device)
    outs = FusedProjections.apply(x, group, recipe, *(lin.weight for lin in linears))
    return list(outs)


def _fusable(x: torch.Tensor, linears) -> bool:
    if len(linears) not in (2, 3):
        return False
    k = x.shape[-1]
    if k % 16 or x.numel() // max(k, 1) <= linears[0].recipe.execution.decode_max_m or \
            not _members_fit(linears, x.device):
        return False
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return False
    rows = x.numel() // k
    return all(lin.in_features == k and lin.weight.dtype == x.dtype and rows * lin.out_features < 2**31
               and not lin._forward_hooks and not lin._forward_pre_hooks for lin in linears)


def _members_fit(linears, device) -> bool:
    """The linears' settings allow the fused GEMM (whatever the input): one recipe on the kernels with
    the 'dequantized' backward, fusion on, no fast mode, no bias, no calibration, weights on `device`."""
    recipe = linears[0].recipe
    # a calibrated static scale belongs to each linear, so a shared quantization would need them equal
    if not (recipe.fp4 and recipe.backward == "dequantized" and recipe.execution.fused_projections
            and not recipe.execution.fast and nm.use_kernels(recipe, device)
            and recipe.activation.scaling != "static"):
        return False
    return all(lin.recipe is recipe and lin.bias is None and lin._calib_amax is None
               and lin.weight.device == device for lin in linears)


def fused_members(model: torch.nn.Module) -> set[int]:
    """ids of the linears that modules of `model` may run fused (`fused_projection_groups()`)."""
    return {id(lin) for owner in model.modules() if hasattr(owner, "fused_projection_groups")
            for linears in owner.fused_projection_groups() if linears[0].recipe.execution.fused_projections
            for lin in linears}


def prepare_model(model: torch.nn.Module) -> None:
    """Make the concatenated copies of every module with `fused_projection_groups()` now (after a
    weight update: `refresh_quantized_weights` calls it, so the copies are queued with the quantizer's
    launches rather than in the next forward)."""
    for owner in model.modules():
        groups = getattr(owner, "fused_projection_groups", None)
        for linears in groups() if groups is not None else ():
            device = linears[0].weight.device
            if 2 <= len(linears) <= 3 and _members_fit(linears, device):
                _group(owner, linears, linears[0].recipe, device)


@dataclass
class _Group:
    """The members' quantized weights (the objects the linears hold), their unscaled copies
    concatenated along N for the kernels' operand dtype and K tile, and what the GEMM and its
    backward take from them."""

    qweights: tuple
    copy: torch.Tensor  # [N1 + N2 (+ N3), Kp]
    widths: tuple[int, ...]
    scales: torch.Tensor  # fp32 [3]: each weight's epilogue factor, the last repeated for two weights
    sdec: tuple[torch.Tensor, ...]  # each weight's S_dec, fp32 []
    rows: tuple[torch.Tensor, ...]  # weight j's unscaled copy [N_j, K] (views of `copy`)

    @property
    def host_sdec(self) -> tuple[float, ...] | None:
        """Each weight's S_dec on the host, where all are known (after a refresh's sync)."""
        host = [qw.host_global_scale() for qw in self.qweights]
        return None if any(h is None for h in host) else tuple(h[0] for h in host)


def _operand_layout(device) -> tuple[torch.dtype, int]:
    """The kernels' operand dtype and the K multiple their aligned tiles take (one BK for every M)."""
    kg = lazy.gemm
    return kg.operand_dtype(device), kg.pick_config("aligned", 1, 1)["BK"]


def _group(owner: torch.nn.Module, linears, recipe: Recipe, device) -> _Group:
    dt, bk = _operand_layout(device)
    qws = tuple(lin.quantized_weight() for lin in linears)
    cache = owner.__dict__.setdefault("_fused_projection_copies", {})
    key = (tuple(id(lin) for lin in linears), dt, bk)
    hit = cache.get(key)
    if hit is not None and all(a is b for a, b in zip(hit.qweights, qws)) and hit.copy.device == device:
        return hit
    parts = [qw.operand(dt, bk) for qw in qws]
    copy = _adjacent(parts)
    if copy is None:
        copy = torch.cat(parts)
    widths = tuple(p.shape[0] for p in parts)
    starts = [sum(widths[:j]) for j in range(len(widths))]
    k = linears[0].in_features
    rows = tuple(copy[a:a + n, :k] for a, n in zip(starts, widths))
    sw = [nm._weight_scale(qw, recipe).reshape(()) for qw in qws]
    # the members' own copies become views into the concatenated one (where that is their operand)
    shared = []
    for lin, qw, part, view in zip(linears, qws, parts, rows):
        if part is qw.unscaled:
            qw = qw.with_unscaled(view)
            lin._qweight = qw
        shared.append(qw)
    group = _Group(tuple(shared), copy, widths, torch.stack([*sw, sw[-1]][:3]),
                   tuple(qw.global_scale.reshape(()).float() for qw in qws), rows)
    cache[key] = group
    return group


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts [N_j, K] as one [sum N_j, K] view where they already lie back to back in one storage
    (gate and up quantized in one stacked launch: `refresh_quantized_weights` stacks a model's
    same-shape members in module order), else None (the caller concatenates)."""
    p0 = parts[0]
    end = p0.data_ptr()
    for p in parts:
        if (not p.is_contiguous() or p.dtype != p0.dtype or p.shape[1:] != p0.shape[1:]
                or p.untyped_storage().data_ptr() != p0.untyped_storage().data_ptr() or p.data_ptr() != end):
            return None
        end += p.numel() * p.element_size()
    return p0.as_strided((sum(p.shape[0] for p in parts), p0.shape[1]), (p0.shape[1], 1))


class FusedProjections(torch.autograd.Function):
    """x [..., K] and 2-3 weights -> their outputs [..., N_j] (module docstring)."""

    @staticmethod
    def forward(ctx, x, group: _Group, recipe: Recipe, *weights):
        kg = lazy.gemm
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        a, sdec, row_factor = nm._kernel_rows(x2, recipe)
        m = a.shape[0]
        cfg = kg.pick_config("aligned", m, group.copy.shape[0])
        outs = kg.gemm_segments(nm._pad_k(a, group.copy.shape[-1]), row_factor.reshape(-1), group.copy,
                                group.scales, group.widths, recipe.epilogue, x.dtype, cfg)
        ctx.group, ctx.x_shape, ctx.x_dtype = group, x.shape, x.dtype
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.save_for_backward(a, sdec)
        lead = x.shape[:-1]
        return tuple(o.view(*lead, o.shape[-1]) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        a, sdec = ctx.saved_tensors  # [M, K] e2m1 * s_b, S_dec_x [M, 1]
        group, m = ctx.group, a.shape[0]
        dys = [None if g is None else g.reshape(m, g.shape[-1]) for g in grads]
        need_dx = ctx.needs_input_grad[0]
        need_dw = [ctx.needs_input_grad[3 + j] and dys[j] is not None for j in range(len(dys))]
        if a.dtype == torch.bfloat16 and all(d is None or d.dtype == torch.bfloat16 for d in dys):
            dx, dws = _bf16_grads(group, group.host_sdec, a, sdec, dys, need_dx, need_dw)
        else:
            dx, dws = _fp32_grads(group, a, sdec, dys, need_dx, need_dw)
        if dx is not None:
            dx = dx.to(ctx.x_dtype).reshape(ctx.x_shape)
        dws = [None if d is None else d.to(t) for d, t in zip(dws, ctx.w_dtypes)]
        return (dx, None, None, *dws)


def _bf16_grads(group: _Group, host_sdec, a, sdec, dys, need_dx, need_dw):
    """host_sdec: the weights' S_dec as host floats (after a refresh), or None: then each dX term is
    scaled on the device (`nvfp4_matmul._scale_bf16`, as a Linear's own backward does) and added."""
    dx = None
    if need_dx:
        for j, dy in enumerate(dys):
            if dy is None:
                continue
            if host_sdec is None:
                term = nm._scale_bf16(torch.mm(dy, group.rows[j]), group.sdec[j].reshape(1, 1), inplace=True)
                dx = term if dx is None else dx.add_(term)
            elif dx is None:
                dx = torch.mm(dy, group.rows[j])
                if host_sdec[j] != 1.0:
                    dx.mul_(host_sdec[j])
            else:
                dx.addmm_(dy, group.rows[j], alpha=host_sdec[j])
        if dx is None:
            dx = a.new_zeros(a.shape)
    dws = [None] * len(dys)
    if any(need_dw):
        xdq = nm._scale_bf16(a, sdec)  # the dequantized input, fp32 products rounded once to bf16
        dws = [torch.mm(dy.t(), xdq) if need else None for dy, need in zip(dys, need_dw)]
    return dx, dws


def _fp32_grads(group: _Group, a, sdec, dys, need_dx, need_dw):
    dx = None
    if need_dx:
        dx = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
        for j, dy in enumerate(dys):
            if dy is not None:
                dx += dy.float() @ (group.rows[j].float() * group.sdec[j])
    xdq = a.float() * sdec if any(need_dw) else None
    dws = [dy.float().t() @ xdq if need else None for dy, need in zip(dys, need_dw)]
    return dx, dws

