"""The attention layer's per-head q/k RMSNorm and RoPE as one op, optionally storing the rotated keys
and the values into the KV cache (a cached step; bf16, or quantized in the same launch).

Where the execution runs the element-wise kernels (on CUDA by default) and the shapes fit
(`minite.kernels.qk_norm_rope.applies`), one launch does all of it in the learner's forward and the
sampler's step alike, so both engines hold the same bits; its backward runs the RoPE and RMSNorm
kernels' backwards. Elsewhere the separate ops (`minite.nn.norm.rms_norm`, `minite.nn.rope.apply_rope`)
run and the cache write is an indexed store (quantized caches: `minite.nn.kv_quant.quantize_kv`, the
same bits as the kernel's store).
"""

from __future__ import annotations

import torch

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn.kv_quant import quantize_kv
from minite.nn.norm import rms_norm
from minite.nn.rope import apply_rope
from minite.ref.kv_quant import QuantizedKV


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, execution: Execution = DEFAULT, store=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[..., T, Hq, D]`, k `[..., T, Hkv, D]`, norm weights `[D]`, cos / sin `[..., T, D]` -> q and
    k normed per head and rotated. `store` (v `[..., T, Hkv, D]`, k_rows, v_rows `[S, Hkv, D]` tensors
    or `QuantizedKV`, slots `[n_tok]`): rotated k and v also written at the tokens' slots (no gradient
    flows there)."""
    if store is not None and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("qk_norm_rope: the cache store is a cached step's, without gradients")
    if execution.elementwise_kernels(q) and lazy.qk_norm_rope.applies(q, k, q_weight, k_weight, cos):
        if store is not None:
            return lazy.qk_norm_rope.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin, store)
        return _QKNormRoPE.apply(q, k, q_weight, k_weight, eps, cos, sin)
    q = apply_rope(rms_norm(q, q_weight, eps, execution), cos, sin, execution)
    k = apply_rope(rms_norm(k, k_weight, eps, execution), cos, sin, execution)
    if store is not None:
        v, k_rows, v_rows, slots = store
        for x, rows in ((k, k_rows), (v, v_rows)):
            x = x.reshape(-1, *x.shape[-2:])
            if isinstance(rows, QuantizedKV):
                quantize_kv(x, rows.format, execution, out=rows, slots=slots)
            else:
                rows[slots] = x
    return q, k


class _QKNormRoPE(torch.autograd.Function):
    """Forward: the one-launch kernel. Backward: each rotation's transpose (`kernels.rope`), then each
    norm's backward (`kernels.norm`) from the saved inputs."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps, cos, sin):
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = eps
        return lazy.qk_norm_rope.qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin)

    @staticmethod
    def backward(ctx, gq, gk):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        grads = []
        for x, w, g in ((q, q_weight, gq), (k, k_weight, gk)):
            if g is None:
                grads.append((None, None))
                continue
            gy = lazy.rope.apply_rope(g.contiguous(), cos, sin, backward=True)
            grads.append(lazy.norm.rms_norm_backward(x, w, gy, ctx.eps))
        (dq, dwq), (dk, dwk) = grads
        need = ctx.needs_input_grad
        return (dq if need[0] else None, dk if need[1] else None, dwq if need[2] else None,
                dwk if need[3] else None, None, None, None)
