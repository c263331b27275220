"""Qwen3's per-head q/k RMSNorm and RoPE in one launch, optionally storing the rotated keys and the
values into the KV cache's slots in the same launch (a cached step's bf16 cache write).

Per (token, head) row x [D] of q or k, halves 1 = [:D/2], 2 = [D/2:], with r() rounding to x's dtype:
ms = (sum(x1^2) + sum(x2^2)) / D in fp32, inv = 1 / sqrt(ms + eps) (correctly rounded), y = r(w * r(x *
inv)) (the norm, `minite.ref.norm`'s cast order), then out1 = r(r(y1 * cos1) + r(-y2 * sin1)), out2 =
r(r(y2 * cos2) + r(y1 * sin2)) (the rotation, `minite.kernels.rope`'s bits given y). The sum of squares
runs in this kernel's own order: close to the reference (`minite.ref.qk_norm_rope`), not bitwise; a
row's result depends on that row alone (batch invariant), and the learner's forward and the sampler's
step both run this kernel, so the engines hold the same bits. The store changes no arithmetic: the
cache gets the very values returned.

Why: the separate ops are six launches a layer in a decode step (two norms, two rotations, two
index_put writes), each a few microseconds on a few megabytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.rounding import round_to

ELEMS = 4096  # elements per program: ELEMS // D rows


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, kc_ptr, vsrc_ptr, vc_ptr, slot_ptr, n_rows, H,
                    stride_x, stride_v, stride_c, block, eps, D: tl.constexpr, BLOCK_R: tl.constexpr,
                    STORE: tl.constexpr):
    """Rows block*BLOCK_R... of x [n_tok, H, D] (row stride stride_x): normed and rotated into out
    [n_tok, H, D] contiguous; with STORE also into the cache rows kc [slots, H, D] at each token's slot,
    and the values vsrc's rows copied to vc the same way."""
    HALF: tl.constexpr = D // 2
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (rows < n_rows)[:, None]
    tok = (rows // H).to(tl.int64)[:, None]
    head = (rows % H).to(tl.int64)[:, None]
    c = tl.arange(0, HALF)[None, :]
    src = x_ptr + tok * stride_x + head * D + c
    x1_in = tl.load(src, mask=ok, other=0.0)
    x2_in = tl.load(src + HALF, mask=ok, other=0.0)
    x1, x2 = x1_in.to(tl.float32), x2_in.to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    ms = tl.div_rn(ss, tl.zeros([BLOCK_R], tl.float32) + D)
    inv = tl.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.sqrt_rn(ms + eps))[:, None]
    w1 = tl.load(w_ptr + c).to(tl.float32)
    w2 = tl.load(w_ptr + HALF + c).to(tl.float32)
    # w and r(x * inv) exact in fp32: one rounding
    y1 = round_to(w1 * round_to(x1 * inv, x1_in.dtype), x1_in.dtype)
    y2 = round_to(w2 * round_to(x2 * inv, x1_in.dtype), x1_in.dtype)
    cs = cos_ptr + tok * stride_c + c
    sn = sin_ptr + tok * stride_c + c
    cos1 = tl.load(cs, mask=ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cs + HALF, mask=ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sn, mask=ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sn + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = round_to(round_to(y1 * cos1, x1_in.dtype) + round_to(-y2 * sin1, x1_in.dtype), x1_in.dtype)
    o2 = round_to(round_to(y2 * cos2, x1_in.dtype) + round_to(y1 * sin2, x1_in.dtype), x1_in.dtype)
    dst = out_ptr + (tok * H + head) * D + c
    o1, o2 = o1.to(x1_in.dtype), o2.to(x1_in.dtype)
    tl.store(dst, o1, mask=ok)
    tl.store(dst + HALF, o2, mask=ok)
    if STORE:
        slot = tl.load(slot_ptr + tok, mask=ok, other=0)
        cache = (slot * H + head) * D + c
        tl.store(kc_ptr + cache, o1, mask=ok)
        tl.store(kc_ptr + cache + HALF, o2, mask=ok)
        vs = vsrc_ptr + tok * stride_v + head * D + c
        tl.store(vc_ptr + cache, tl.load(vs, mask=ok, other=0.0), mask=ok)
        tl.store(vc_ptr + cache + HALF, tl.load(vs + HALF, mask=ok, other=0.0), mask=ok)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr,
                         vc_ptr, slot_ptr, n_tok, HQ, HKV, q_blocks, stride_q, stride_k, stride_v, stride_c,
                         eps,
                         D: tl.constexpr, BLOCK_R: tl.constexpr, STORE: tl.constexpr):
    """Programs 0 .. q_blocks - 1 take q's rows, the rest k's (and, with STORE, the cache write)."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _norm_rope_rows(q_ptr, wq_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, v_ptr, vc_ptr, slot_ptr,
                        n_tok * HQ, HQ, stride_q, stride_v, stride_c, pid, eps, D, BLOCK_R, False)
    else:
        _norm_rope_rows(k_ptr, wk_ptr, cos_ptr, sin_ptr, ko_ptr, kc_ptr, v_ptr, vc_ptr, slot_ptr,
                        n_tok * HKV, HKV, stride_k, stride_v, stride_c, pid - q_blocks, eps, D, BLOCK_R,
                        STORE)


def applies(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether the kernel takes q `[..., Hq, D]`, k `[..., Hkv, D]`: 16- or 32-bit, norm weights and
    tables of q's dtype, a power-of-two D of at least 16, each token's heads contiguous."""
    d = q.shape[-1]
    lead = q.shape[:-2]
    return (q.dtype in (torch.bfloat16, torch.float16, torch.float32) and k.dtype == q.dtype
            and wq.dtype == q.dtype and wk.dtype == q.dtype and cos.dtype == q.dtype
            and d >= 16 and d & (d - 1) == 0 and k.shape[-1] == d and k.shape[:-2] == lead
            and tuple(cos.shape) == (*lead, d) and wq.shape == (d,) and wk.shape == (d,)
            and all(t.stride(-1) == 1 and t.stride(-2) == d for t in (q, k)))


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., H, D] as [n_tok, H, D] (a view where the leading dims allow) and its token stride."""
    x3 = x.reshape(-1, *x.shape[-2:])
    return x3, x3.stride(0)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, store=None) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[..., Hq, D]`, k `[..., Hkv, D]`, norm weights `[D]`, cos / sin `[..., D]` (`applies`) ->
    normed and rotated q, k (contiguous). `store` (v `[..., Hkv, D]`, k_cache, v_cache `[S, Hkv, D]`
    contiguous, slots `[n_tok]` int64): the rotated k and v also written at each token's slot."""
    d = q.shape[-1]
    q3, sq = _rows(q)
    k3, sk = _rows(k)
    n, hq, hkv = q3.shape[0], q3.shape[1], k3.shape[1]
    c2, s2 = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    qo = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k3.shape, dtype=k.dtype, device=k.device)
    if store is not None:
        v, kc, vc, slots = store
        v3, sv = _rows(v)
        fits = (v3.shape == k3.shape and v3.stride(-1) == 1 and v3.stride(-2) == d and slots.shape == (n,)
                and kc.shape[1:] == k3.shape[1:] and vc.shape == kc.shape and kc.is_contiguous()
                and vc.is_contiguous() and kc.dtype == k.dtype and vc.dtype == k.dtype)
        if not fits:
            raise ValueError(f"qk_norm_rope: store v {tuple(v.shape)}, caches {tuple(kc.shape)} / "
                             f"{tuple(vc.shape)} ({kc.dtype}), slots {tuple(slots.shape)} do not fit k "
                             f"{tuple(k.shape)} ({k.dtype})")
    else:
        v3, sv, kc, vc, slots = ko, 0, ko, ko, ko
    block_r = max(1, ELEMS // d)
    q_blocks = cdiv(n * hq, block_r)
    if n:
        launch_kernel(_qk_norm_rope_kernel, (q_blocks + cdiv(n * hkv, block_r),), (
            q3, k3, v3, wq, wk, c2, s2, qo, ko, kc, vc, slots, n, hq, hkv, q_blocks, sq, sk, sv, c2.stride(0),
            eps), D=d, BLOCK_R=block_r, STORE=store is not None, num_warps=4)
    return qo.view(q.shape), ko.view(k.shape)
