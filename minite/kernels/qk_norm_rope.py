"""Qwen3's per-head q/k RMSNorm and RoPE in one launch, optionally storing the rotated keys and the
values into the KV cache's slots in the same launch (a cached step's cache write: bf16, or fp8 / nvfp4
quantized on the way).

Per (token, head) row x [D] of q or k, halves 1 = [:D/2], 2 = [D/2:], with r() rounding to x's dtype:
ms = (sum(x1^2) + sum(x2^2)) / D in fp32, inv = 1 / sqrt(ms + eps) (correctly rounded), y = r(w * r(x *
inv)) (the norm, `minite.ref.norm`'s cast order), then out1 = r(r(y1 * cos1) + r(-y2 * sin1)), out2 =
r(r(y2 * cos2) + r(y1 * sin2)) (the rotation, `minite.kernels.rope`'s bits given y). The sum of squares
runs in this kernel's own order: close to the reference (`minite.ref.qk_norm_rope`), not bitwise; a
row's result depends on that row alone (batch invariant), and the learner's forward and the sampler's
step both run this kernel, so the engines hold the same bits. They run the same machine code too: the
store (none, a copy into a cache of the model dtype, fp8 or nvfp4) is chosen by an argument at run
time, not compiled per kind, because the compiler's choice of layout for the norm's sum of squares
(hence its order, hence its bits) follows what else the kernel does: compiled with an fp8 store, q and
k came out in a last bit apart from the store-free kernel now and then. The store changes no
arithmetic: a bf16 cache gets the very values returned; a quantized cache gets what
`minite.kernels.kv_quant` stores for them (its helper, on whole rows read back from the keys just
stored), which is what the learner's forward quantizes from the returned k and v.

Why: the separate ops are six launches a layer in a decode step (two norms, two rotations, two
index_put writes), each a few microseconds on a few megabytes; a quantized cache adds two more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.kv_quant import _quantize_rows
from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.rounding import round_to
from minite.ref.kv_quant import QuantizedKV

# the store argument: which store, chosen at run time (module docstring)
NO_STORE, COPY, STORE_IDS = 0, 1, {"fp8": 2, "nvfp4": 3}
# arguments Triton would otherwise specialize on (a value of 1, divisibility by 16): with them, every
# launch of a head dim and dtype, store or not, any batch, runs one build
UNSPECIALIZED = ("store", "n_tok", "q_blocks")

ELEMS = 4096  # elements per program: ELEMS // D rows


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, n_rows, H, stride_x, stride_c, block, eps,
                    D: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows block*BLOCK_R... of x [n_tok, H, D] (row stride stride_x): normed and rotated into out
    [n_tok, H, D] contiguous."""
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
    tl.store(dst, o1.to(x1_in.dtype), mask=ok)
    tl.store(dst + HALF, o2.to(x1_in.dtype), mask=ok)


@triton.jit
def _store_rows(ko_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, kb_ptr, vb_ptr, slot_ptr, store, n_rows, H,
                stride_v, block, D: tl.constexpr, HW: tl.constexpr, BLOCK_R: tl.constexpr):
    """Rows block*BLOCK_R... of the rotated keys ko [n_tok, H, D] (just stored by this program) and of
    the values, whole rows, into the contiguous caches at each token's slot: store COPY copied (kc / vc
    bytes of caches of ko's dtype); fp8 / nvfp4 (STORE_IDS) quantized (`minite.kernels.kv_quant`'s bits) into
    payloads kc / vc, block scales kb / vb (nvfp4) and row scales ks / vs."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < n_rows
    tok = (rows // H).to(tl.int64)
    head = (rows % H).to(tl.int64)
    cols = tl.arange(0, D)[None, :]
    r = tl.load(slot_ptr + tok, mask=ok, other=0) * H + head  # the (slot, head) row of the cache
    k = tl.load(ko_ptr + (tok * H + head)[:, None] * D + cols, mask=ok[:, None], other=0.0)
    v = tl.load(v_ptr + tok[:, None] * stride_v + head[:, None] * D + cols, mask=ok[:, None], other=0.0)
    if store == 1:  # COPY
        dt = tl.pointer_type(ko_ptr.dtype.element_ty)
        tl.store(kc_ptr.to(dt) + r[:, None] * D + cols, k, mask=ok[:, None])
        tl.store(vc_ptr.to(dt) + r[:, None] * D + cols, v, mask=ok[:, None])
    elif store == 2:  # fp8
        _quantize_rows(k.to(tl.float32), kc_ptr, kb_ptr, ks_ptr, r * D, r, r, ok, D, False, HW, BLOCK_R)
        _quantize_rows(v.to(tl.float32), vc_ptr, vb_ptr, vs_ptr, r * D, r, r, ok, D, False, HW, BLOCK_R)
    else:
        pay_row, bs_row = r * (D // 2), r * (D // 16)
        _quantize_rows(k.to(tl.float32), kc_ptr, kb_ptr, ks_ptr, pay_row, bs_row, r, ok, D, True, HW, BLOCK_R)
        _quantize_rows(v.to(tl.float32), vc_ptr, vb_ptr, vs_ptr, pay_row, bs_row, r, ok, D, True, HW, BLOCK_R)


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr,
                         vc_ptr, ks_ptr, vs_ptr, kb_ptr, vb_ptr, slot_ptr, store, n_tok, HQ, HKV, q_blocks,
                         stride_q, stride_k, stride_v, stride_c, eps, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         HW: tl.constexpr):
    """Programs 0 .. q_blocks - 1 take q's rows, the rest k's and (store != NO_STORE) the cache write."""
    pid = tl.program_id(0)
    if pid < q_blocks:
        _norm_rope_rows(q_ptr, wq_ptr, cos_ptr, sin_ptr, qo_ptr, n_tok * HQ, HQ, stride_q, stride_c, pid, eps,
                        D, BLOCK_R)
    else:
        _norm_rope_rows(k_ptr, wk_ptr, cos_ptr, sin_ptr, ko_ptr, n_tok * HKV, HKV, stride_k, stride_c,
                        pid - q_blocks, eps, D, BLOCK_R)
        if store != 0:  # NO_STORE
            tl.debug_barrier()  # the program's rotated keys, stored above, are read back whole
            _store_rows(ko_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, kb_ptr, vb_ptr, slot_ptr, store,
                        n_tok * HKV, HKV, stride_v, pid - q_blocks, D, HW, BLOCK_R)


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
    normed and rotated q, k (contiguous). `store` (v `[..., Hkv, D]`, k_cache, v_cache, slots `[n_tok]`
    int64): the rotated k and v also written at each token's slot, the caches `[S, Hkv, D]` contiguous
    tensors of k's dtype or `QuantizedKV` of one format with contiguous fields (quantized on the way,
    `minite.kernels.kv_quant`'s bits)."""
    d = q.shape[-1]
    q3, sq = _rows(q)
    k3, sk = _rows(k)
    n, hq, hkv = q3.shape[0], q3.shape[1], k3.shape[1]
    c2, s2 = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    qo = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k3.shape, dtype=k.dtype, device=k.device)
    # no store: k's own rows and stride for v, ko's bytes for the caches' pointers (of the same types)
    kind, b, f = NO_STORE, ko.view(torch.uint8), ko.view(torch.float32)
    v3, sv, kc, vc, ks, vs, kb, vb, slots = ko, sk, b, b, f, f, b, b, ko.view(torch.int64)
    if store is not None:
        v, kc, vc, slots = store
        v3, sv = _rows(v)
        _check_store(v3, k3, kc, vc, slots, n, store)
        if isinstance(kc, QuantizedKV):
            kind = STORE_IDS[kc.format]
            (kc, ks, kb), (vc, vs, vb) = _fields(kc), _fields(vc)
        else:
            kind, kc, vc = COPY, kc.view(torch.uint8), vc.view(torch.uint8)
    block_r = max(1, ELEMS // d)
    q_blocks = cdiv(n * hq, block_r)
    if n:
        launch_kernel(_qk_norm_rope_kernel, (q_blocks + cdiv(n * hkv, block_r),), (
            q3, k3, v3, wq, wk, c2, s2, qo, ko, kc, vc, ks, vs, kb, vb, slots, kind, n, hq, hkv, q_blocks, sq,
            sk, sv, c2.stride(0), eps), D=d, BLOCK_R=block_r, HW=not interpreted(), num_warps=4)
    return qo.view(q.shape), ko.view(k.shape)


def _fields(c: QuantizedKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A quantized cache's payload, row scales and block scales (the payload again for fp8) as the kernel
    addresses them: bytes and fp32."""
    pay = c.payload.view(torch.uint8)
    return pay, c.scale, pay if c.block_scales is None else c.block_scales.view(torch.uint8)


def _check_store(v3, k3, kc, vc, slots, n, store) -> None:
    quantized = isinstance(kc, QuantizedKV)
    if quantized:
        fits = (isinstance(vc, QuantizedKV) and vc.format == kc.format and kc.shape[1:] == k3.shape[1:]
                and vc.shape == kc.shape and all(t.is_contiguous() for c in (kc, vc) for t in c.fields()))
    else:
        fits = (kc.shape[1:] == k3.shape[1:] and vc.shape == kc.shape and kc.is_contiguous()
                and vc.is_contiguous() and kc.dtype == k3.dtype and vc.dtype == k3.dtype)
    fits = fits and v3.shape == k3.shape and v3.stride(-1) == 1 and v3.stride(-2) == k3.shape[-1] \
        and slots.shape == (n,)
    if not fits:
        what = kc.format if quantized else kc.dtype
        raise ValueError(f"qk_norm_rope: store v {tuple(store[0].shape)}, caches {tuple(kc.shape)} / "
                         f"{tuple(vc.shape)} ({what}), slots {tuple(slots.shape)} do not fit k "
                         f"{tuple(k3.shape)} ({k3.dtype})")
