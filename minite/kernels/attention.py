"""Triton paged causal GQA attention, the kernel counterpart of `minite.ref.attention`; used by the
sampler (prefill and decode, keys read from the paged KV cache in place) and the learner (packed
sequences, keys read from the contiguous k/v of the forward).

One program = one query tile of one sequence x one kv head. The tile's M rows are (query, head)
pairs: BLOCK_M // G consecutive queries of the sequence times the G = Hq // Hkv query heads that
share the kv head, so a decode step (one query per sequence) still fills an MMA tile (padding rows
are masked). The program walks its sequence's keys in position order, in chunks of BLOCK_N
(`kv_block(kv_format)`, the reference's `kv_block`) starting at position 0, up to its last query's position:
s = (q @ k^T) * scale * log2(e) in an fp32-accumulating MMA, fp32 online softmax (exp2), p cast to
the value dtype, acc += p @ v (fp32 accumulation), out = acc / l.

Quantized keys and values (`minite.ref.kv_quant.QuantizedKV`, the `kv_cache` formats; constexpr KV:
0 the model dtype, 1 fp8, 2 nvfp4): the payload is turned into the exact unscaled values in
registers (fp8: loaded as 32-bit words, four E4M3 at a time by the GPU's packed cvt; nvfp4: E2M1
codes and E4M3 block scales from their bits), the MMAs run on those in the value dtype, and each
key's / value's fp32 row scale multiplies its column of s before the softmax scale and of p before
its cast; no other pass. bf16 keys take the
unchanged loads and arithmetic above, so their bits are those of the unquantized kernel.

Batch invariance: one fixed launch configuration per operand dtype and KV format (CONFIGS; `config`)
for every call, decode or prefill, paged or contiguous; no split over keys; a row's arithmetic
never depends on the other rows of its tile (MMA rows are independent, row reductions run along N
only) nor on chunks past its position (they multiply by exactly 1 and add exact zeros). Hence
bitwise-equal outputs for a query whatever batch it is computed in. Against the reference: close,
not bitwise (MMA and reduction order).

Operand dtypes: bf16/fp16/fp32 storage; tl.dot on the storage dtype on the GPU (fp32 with
input_precision="ieee"). The CPU interpreter cannot do bf16 tl.dot (docs/facts.md, "Triton on the CPU"): there
bf16 operands are widened to fp32 (exact) before the dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.gemm import _e2m1_to_float, _e4m3_to_float
from minite.kernels.launch import launch as launch_kernel
from minite.ref.attention import KV_BLOCK, LOG2E
from minite.ref.kv_quant import QuantizedKV

KV_IDS = {"bf16": 0, "fp8": 1, "nvfp4": 2}

CONFIGS = {
    # The one configuration of every GPU call (decode, prefill, learner) per KV format: never switch per
    # batch. bf16 / fp16 keys and values: two warps on 64-key chunks (two beat four in decode, H200,
    # benchmarks/results/h200/attention_kv_formats.json). One warp on 32-key chunks ran the learner's
    # packed 16 x 1024 tokens in 565 against 692 us and decode 512 x 512 in the same 361 us (H100,
    # attention_configs_round2_0eaa9f5.json); not taken until the engines' agreement is checked on it.
    "gpu": dict(BLOCK_M=16, BLOCK_N=KV_BLOCK, num_warps=2, num_stages=2),
    # fp8 / nvfp4: one warp a program on 32-key chunks, eight programs an SM where the 64-key, 2-warp
    # tile fit four (registers and shared memory); the kernel is bound by the latency of each program's
    # chain of chunks, not by its instructions. H100, Qwen3-1.7B heads, paired CUDA graphs
    # (attention_decode_configs_fe1d645.json, attention_configs_round2_0eaa9f5.json), against 64 keys on
    # 2 warps: decode 512 x 512 fp8 206-213 against 245 us, nvfp4 535-540 against 622-624; 128 x 384
    # fp8 45 / 54; packed 16 x 1024 fp8 783 / 853. 16-key and 128-key chunks and more stages do not
    # pay. The bitwise GPU tests run on these configurations.
    "gpu_fp8": dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=2),
    "gpu_nvfp4": dict(BLOCK_M=16, BLOCK_N=32, num_warps=1, num_stages=2),
    # fp32 operands (fp32 models, tests): the same tiles, fewer stages (fp32 tiles are twice the size)
    "gpu_fp32": dict(BLOCK_M=64, BLOCK_N=KV_BLOCK, num_warps=8, num_stages=1),
    # The CPU interpreter: small tiles so that tiny tests walk several chunks.
    "interpret": dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1),
}


@triton.jit
def _e4m3_signed(b):
    """Signed E4M3 bytes (uint8) -> exact fp32 values built from the bits (the interpreter's path)."""
    i = b.to(tl.int32)
    mag = i & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    u = tl.where(mag < 8, (mag & 7).to(tl.float32) * 0.001953125, normal)
    return tl.where((i & 0x80) != 0, -u, u)


@triton.jit
def _e4m3_words(ptr, rows, in_seq, D: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """E4M3 rows [BLOCK_N, D] loaded as 32-bit words -> exact values [BLOCK_N, D] in DT (bf16 / fp16 /
    fp32).
    Converting whole words in registers, before the layout change to the dot operand, keeps the
    value tile's shared-memory reads vectorized (loaded as bytes in the operand layout, the keys-major
    value tile is read a byte at a time)."""
    w = tl.load((ptr + rows).to(tl.pointer_type(tl.int32)) + tl.arange(0, D // 4)[None, :],
                mask=in_seq[:, None], other=0)
    # one word -> its four bytes' values, byte 0 first: two packed E4M3 -> fp16 conversions (exact;
    # fp32 operands widen those)
    if DT != tl.bfloat16:
        b0, b1, b2, b3 = tl.inline_asm_elementwise("""{
    .reg .b16 lo, hi;
    .reg .b32 h0, h1;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 h0, lo;
    cvt.rn.f16x2.e4m3x2 h1, hi;
    mov.b32 {$0, $1}, h0;
    mov.b32 {$2, $3}, h1;
}""", "=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:  # bf16: then fp16 -> fp32 -> bf16, each exact
        b0, b1, b2, b3 = tl.inline_asm_elementwise("""{
    .reg .b16 lo, hi, a0, a1, a2, a3;
    .reg .b32 h0, h1, r0, r1;
    .reg .f32 f0, f1, f2, f3;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 h0, lo;
    cvt.rn.f16x2.e4m3x2 h1, hi;
    mov.b32 {a0, a1}, h0;
    mov.b32 {a2, a3}, h1;
    cvt.f32.f16 f0, a0;
    cvt.f32.f16 f1, a1;
    cvt.f32.f16 f2, a2;
    cvt.f32.f16 f3, a3;
    cvt.rn.bf16x2.f32 r0, f1, f0;
    cvt.rn.bf16x2.f32 r1, f3, f2;
    mov.b32 {$0, $1}, r0;
    mov.b32 {$2, $3}, r1;
}""", "=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=1)
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [BLOCK_N, D]).to(DT)


@triton.jit
def _kv_tile(ptr, bs_ptr, slots, in_seq, kvh, stride_s, stride_h, stride_bs, stride_bh, D: tl.constexpr,
             KV: tl.constexpr, HW: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """Keys or values of slots [BLOCK_N], kv head kvh, from their quantized payload -> the exact
    unscaled values [BLOCK_N, D] in DT (KV 1: E4M3 bytes; 2: packed E2M1 codes times E4M3 block scales)."""
    rows = slots[:, None] * stride_s + kvh * stride_h
    f16: tl.constexpr = DT != tl.bfloat16
    # one return (Triton types every return alike, constexpr branches included)
    if KV == 1 and HW:
        out = _e4m3_words(ptr, rows, in_seq, D, BLOCK_N, DT)
    elif KV == 1:
        b = tl.load(ptr + rows + tl.arange(0, D)[None, :], mask=in_seq[:, None], other=0)  # uint8
        out = _e4m3_signed(b).to(DT)
    else:
        p = tl.load(ptr + rows + tl.arange(0, D // 2)[None, :], mask=in_seq[:, None], other=0)  # [N, D/2]
        v = tl.reshape(tl.join(_e2m1_to_float(p & 15, f16), _e2m1_to_float(p >> 4, f16)), [BLOCK_N, D])
        sb = tl.load(bs_ptr + slots[:, None] * stride_bs + kvh * stride_bh + tl.arange(0, D // 16)[None, :],
                     mask=in_seq[:, None], other=0)
        sb = _e4m3_to_float(sb).to(DT)
        out = tl.reshape(tl.reshape(v.to(DT), [BLOCK_N, D // 16, 16]) * sb[:, :, None], [BLOCK_N, D])
    return out


@triton.jit
def _chunk(q, qpos, m_i, l_i, acc, j0, kv_end, seq, kv_base, kvh, k_ptr, v_ptr, ks_ptr, vs_ptr, kb_ptr,
           vb_ptr, table_ptr, qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, stride_ss, stride_sh,
           stride_bs, stride_bh, stride_bt, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
           PAGED: tl.constexpr, KV: tl.constexpr, HW: tl.constexpr, DT: tl.constexpr,
           DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys j0 .. j0 + BLOCK_N of the sequence: one online-softmax step -> (m_i, l_i, acc). KV 0: k, v
    in DT; 1 (fp8) / 2 (nvfp4): quantized, each key's and value's row scale folded into s and p."""
    offs_d = tl.arange(0, D)
    offs_n = j0 + tl.arange(0, BLOCK_N)
    in_seq = offs_n < kv_end
    if PAGED:
        blk = tl.load(table_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=in_seq, other=0)
        slots = blk.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
    else:
        slots = kv_base + offs_n
    if KV == 0:
        kt = tl.load(k_ptr + slots[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None],
                     mask=in_seq[None, :], other=0.0)  # [D, BLOCK_N]
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                    mask=in_seq[:, None], other=0.0)  # [BLOCK_N, D]
    else:
        kt = tl.trans(_kv_tile(k_ptr, kb_ptr, slots, in_seq, kvh, stride_ks, stride_kh, stride_bs, stride_bh,
                               D, KV, HW, BLOCK_N, DT))
        v = _kv_tile(v_ptr, vb_ptr, slots, in_seq, kvh, stride_vs, stride_vh, stride_bs, stride_bh, D, KV, HW,
                     BLOCK_N, DT)
        srow = slots * stride_ss + kvh * stride_sh
        k_scale = tl.load(ks_ptr + srow, mask=in_seq, other=0.0)  # [BLOCK_N] fp32
        v_scale = tl.load(vs_ptr + srow, mask=in_seq, other=0.0)
    if DOT_F32:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if KV != 0:
        s = s * k_scale[None, :]
    s = s * qk_scale
    visible = (offs_n[None, :] <= qpos[:, None]) & in_seq[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    u = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - u)
    p = tl.exp2(s - u[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if KV != 0:
        p = p * v_scale[None, :]
    p = p.to(DT)
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, kb_ptr, vb_ptr, out_ptr, lse_ptr, tiles_ptr,
                      pos_ptr, table_ptr, start_ptr, ctx_ptr, qk_scale, stride_qn, stride_qh, stride_ks,
                      stride_kh, stride_vs, stride_vh, stride_ss, stride_sh, stride_bs, stride_bh,
                      stride_on, stride_oh, stride_bt, stride_ln,
                      G: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      PAGED: tl.constexpr,
                      STORE_LSE: tl.constexpr, KV: tl.constexpr, HW: tl.constexpr,
                      DOT_F32: tl.constexpr, PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # a tile's kv heads are neighbouring programs, so they run at once: a slot's row scales of all its
    # heads share 32-byte sectors, which one head alone would read 4-8 times over from HBM
    tile = tl.program_id(0) // HKV
    kvh = tl.program_id(0) % HKV
    seq = tl.load(tiles_ptr + tile * 3)
    row0 = tl.load(tiles_ptr + tile * 3 + 1)
    nrows = tl.load(tiles_ptr + tile * 3 + 2)
    if nrows > 0:
        r = tl.arange(0, BLOCK_M)
        qi = r // G
        valid = qi < nrows
        rows = (row0 + tl.where(valid, qi, 0)).to(tl.int64)  # [BLOCK_M] query row
        heads = kvh * G + r % G
        offs_d = tl.arange(0, D)
        q = tl.load(q_ptr + rows[:, None] * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)  # [BLOCK_M, D]
        qpos = tl.load(pos_ptr + rows, mask=valid, other=-1)
        ctx = tl.load(ctx_ptr + seq)
        # a reduction, not a scalar load, so that the loop bound is 0-d in the interpreter too
        kv_end = tl.max(tl.minimum(qpos + 1, ctx), axis=0).to(tl.int32)
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        kv_base = 0
        if not PAGED:
            kv_base = tl.load(start_ptr + seq).to(tl.int64)
        if WHILE_LOOP:
            # the CPU interpreter cannot take a loaded value as a range() bound (it is not 0-d there)
            j0 = 0
            while j0 < kv_end:
                m_i, l_i, acc = _chunk(q, qpos, m_i, l_i, acc, j0, kv_end, seq, kv_base, kvh, k_ptr, v_ptr,
                                       ks_ptr, vs_ptr, kb_ptr, vb_ptr, table_ptr, qk_scale, stride_ks,
                                       stride_kh, stride_vs, stride_vh, stride_ss, stride_sh, stride_bs,
                                       stride_bh, stride_bt, D, BLOCK_SIZE, PAGED, KV, HW,
                                       out_ptr.dtype.element_ty, DOT_F32, PRECISION, BLOCK_N)
                j0 += BLOCK_N
        else:
            for j0 in range(0, kv_end, BLOCK_N):
                m_i, l_i, acc = _chunk(q, qpos, m_i, l_i, acc, j0, kv_end, seq, kv_base, kvh, k_ptr, v_ptr,
                                       ks_ptr, vs_ptr, kb_ptr, vb_ptr, table_ptr, qk_scale, stride_ks,
                                       stride_kh, stride_vs, stride_vh, stride_ss, stride_sh, stride_bs,
                                       stride_bh, stride_bt, D, BLOCK_SIZE, PAGED, KV, HW,
                                       out_ptr.dtype.element_ty, DOT_F32, PRECISION, BLOCK_N)
        out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        tl.store(out_ptr + rows[:, None] * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        if STORE_LSE:  # the backward's base-2 log-sum-exp of the scaled scores
            lse = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))
            tl.store(lse_ptr + rows * stride_ln + heads, lse, mask=valid)


def config(dtype: torch.dtype = torch.bfloat16, kv_format: str = "bf16") -> dict:
    """The launch configuration in force for operands of `dtype` and keys / values in `kv_format`
    ("bf16": the model dtype; "fp8", "nvfp4": `QuantizedKV`), the interpreter's on the CPU. Every
    configuration holds BLOCK_M = 16 query rows, so that one `plan_tiles` serves every layer."""
    if interpreted():
        return CONFIGS["interpret"]
    if dtype == torch.float32:
        return CONFIGS["gpu_fp32"]
    return CONFIGS["gpu"] if kv_format == "bf16" else CONFIGS[f"gpu_{kv_format}"]


def kv_block(dtype: torch.dtype = torch.bfloat16, kv_format: str = "bf16") -> int:
    """Keys per online-softmax chunk of the configuration in force (the reference's `kv_block`)."""
    return config(dtype, kv_format)["BLOCK_N"]


def plan_tiles(query_seq: torch.Tensor, num_seqs: int, group: int,
               block_m: int | None = None) -> torch.Tensor:
    """Query tiles for a launch: int32 [T, 3] rows (sequence, first query row, number of rows), at
    most `block_m // group` queries of one sequence each; trailing tiles have 0 rows. Device ops
    only (no host sync, static shape): usable inside a CUDA graph. A sequence's rows must be
    consecutive in `query_seq`."""
    block_m = config()["BLOCK_M"] if block_m is None else block_m
    per_tile = block_m // group
    N = query_seq.numel()
    dev = query_seq.device
    seq = query_seq.long()
    counts = torch.zeros(num_seqs, dtype=torch.int64, device=dev).scatter_add_(0, seq, torch.ones_like(seq))
    first = torch.full((num_seqs,), N, dtype=torch.int64, device=dev).scatter_reduce_(
        0, seq, torch.arange(N, device=dev), "amin")
    ntiles = (counts + per_tile - 1) // per_tile
    ends = torch.cumsum(ntiles, 0)  # [S] inclusive
    t = torch.arange(max(min(N, N // per_tile + num_seqs), 1), device=dev)
    s = torch.searchsorted(ends, t, right=True).clamp(max=num_seqs - 1)
    local = t - (ends[s] - ntiles[s])
    nrows = (counts[s] - local * per_tile).clamp(0, per_tile)
    return torch.stack([s, first[s] + local * per_tile, nrows], 1).to(torch.int32).contiguous()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_seq: torch.Tensor,
                    query_pos: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    scale: float | None = None, tiles: torch.Tensor | None = None,
                    cfg: dict | None = None) -> torch.Tensor:
    """q [N, Hq, D], k_cache / v_cache [num_blocks, block_size, Hkv, D] (unit stride along D, slots of
    a block adjacent; tensors of q's dtype, or both `QuantizedKV` of one format), query_seq /
    query_pos [N] (a sequence's rows consecutive), block_tables [S, W] int32/int64, context_lens [S]
    -> [N, Hq, D] in q's dtype. `tiles`: `plan_tiles(...)` computed once and reused across layers;
    `cfg`: a launch configuration (benchmarks only; `maxnreg` caps the registers a thread)."""
    _check_common(q, k_cache, v_cache, query_seq, query_pos, context_lens, "k_cache", 4)
    S, block_size = context_lens.shape[0], k_cache.shape[1]
    if block_tables.ndim != 2 or block_tables.shape[0] != S or block_tables.dtype not in (torch.int32,
                                                                                          torch.int64):
        raise ValueError(f"block_tables must be int32/int64 [S={S}, W], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables needs unit stride along W")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        c = c.payload if isinstance(c, QuantizedKV) else c
        if c.stride(0) != block_size * c.stride(1):
            raise ValueError(f"{name}: the slots of a block must be adjacent (stride(0) == block_size * "
                             f"stride(1)), got strides {c.stride()}")
    return _launch(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), query_seq, query_pos, block_tables,
                   context_lens, context_lens, block_size, True, scale, tiles, cfg)


def contiguous_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_seq: torch.Tensor,
                         query_pos: torch.Tensor, kv_start: torch.Tensor, context_lens: torch.Tensor,
                         scale: float | None = None, tiles: torch.Tensor | None = None,
                         cfg: dict | None = None, lse: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D], k / v [M, Hkv, D] (tensors or `QuantizedKV`, as for `paged_attention`; sequence
    s's keys at rows kv_start[s] + 0, 1, ...),
    query_seq / query_pos [N], kv_start / context_lens [S] -> [N, Hq, D]: the same arithmetic as
    `paged_attention`, for packed sequences whose keys were not written to a cache. `lse`: a
    contiguous fp32 [N, Hq] the kernel fills with each row's base-2 log-sum-exp of its scaled scores
    (for `attention_backward`; the output's bits do not change)."""
    _check_common(q, k, v, query_seq, query_pos, context_lens, "k", 3)
    if kv_start.shape != context_lens.shape:
        raise ValueError(f"kv_start {tuple(kv_start.shape)} must match context_lens "
                         f"{tuple(context_lens.shape)}")
    if lse is not None and (lse.shape != q.shape[:2] or lse.dtype != torch.float32
                            or not lse.is_contiguous()):
        raise ValueError(f"lse must be contiguous fp32 [N, Hq] = {tuple(q.shape[:2])}, got {lse.dtype} "
                         f"{tuple(lse.shape)}")
    return _launch(q, k, v, query_seq, query_pos, kv_start, kv_start, context_lens, 1, False, scale, tiles,
                   cfg, lse)


def _launch(q, k, v, query_seq, query_pos, table, start, context_lens, block_size, paged, scale, tiles, cfg,
            lse=None):
    N, Hq, D = q.shape
    Hkv = k.shape[-2]
    G = Hq // Hkv
    kv_format = k.format if isinstance(k, QuantizedKV) else "bf16"
    cfg = config(q.dtype, kv_format) if cfg is None else cfg
    if G > cfg["BLOCK_M"]:
        raise ValueError(f"{G} query heads per kv head exceed the tile's BLOCK_M={cfg['BLOCK_M']}")
    out = torch.empty_like(q)
    if N == 0:
        return out
    if tiles is None:
        tiles = plan_tiles(query_seq, context_lens.shape[0], G, cfg["BLOCK_M"])
    scale = D ** -0.5 if scale is None else scale
    dot_f32 = q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreted())
    grid = (tiles.shape[0] * Hkv,)
    kv = KV_IDS[kv_format]
    if kv:  # payload and block scales as bytes; k's and v's scale tensors are laid out alike
        ks, vs = k.scale, v.scale
        kb, vb = (k.block_scales, v.block_scales) if kv == 2 else (ks, vs)
        k, v = k.payload.view(torch.uint8), v.payload.view(torch.uint8)
        kb, vb = kb.view(torch.uint8), vb.view(torch.uint8)
        scale_strides = (ks.stride(0), ks.stride(1), kb.stride(0), kb.stride(1))
    else:
        ks = vs = kb = vb = k
        scale_strides = (0, 0, 0, 0)
    launch_kernel(_attention_kernel, grid, (
        q, k, v, ks, vs, kb, vb, out, out if lse is None else lse, tiles, query_pos, table, start,
        context_lens, scale * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *scale_strides, out.stride(0), out.stride(1), table.stride(0) if paged else 0,
        0 if lse is None else lse.stride(0)),
        G=G, HKV=Hkv, D=D, BLOCK_SIZE=block_size, PAGED=paged, STORE_LSE=lse is not None, KV=kv,
        HW=not interpreted(), DOT_F32=dot_f32,
        PRECISION="ieee" if dot_f32 else "tf32", WHILE_LOOP=interpreted(),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **_register_cap(cfg))
    return out


def _register_cap(cfg: dict) -> dict:
    """The launch's `maxnreg` where the configuration caps the registers a thread (more programs an SM)."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interpreted() else {}


def _check_kv(k, v, q, kname):
    """Quantized k / v: one format, scale tensors laid out alike (the kernel takes one set of strides)."""
    if not isinstance(v, QuantizedKV) or v.format != k.format:
        raise TypeError(f"{kname} is a {k.format} QuantizedKV: v must be one too, got "
                        f"{getattr(v, 'format', type(v).__name__)}")
    if k.payload.stride() != v.payload.stride() or k.scale.stride() != v.scale.stride() or (
            k.block_scales is not None and k.block_scales.stride() != v.block_scales.stride()):
        raise ValueError(f"quantized {kname} and v must share their layout (strides)")
    if any(t.stride(-1) != 1 for t in (*k.fields(), *v.fields()) if t.ndim == k.payload.ndim):
        raise ValueError(f"quantized {kname} and v need unit stride along D")
    if k.format == "fp8" and any(t.data_ptr() % 4 or any(st % 4 for st in t.stride()[:-1])
                                 for t in (k.payload, v.payload)):
        raise ValueError(f"fp8 {kname} and v are read as 32-bit words: their rows must start 4-byte aligned")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"q must be bf16/fp16/fp32, got {q.dtype}")


def _check_common(q, k, v, query_seq, query_pos, context_lens, kname, kdim):
    if isinstance(k, QuantizedKV) or isinstance(v, QuantizedKV):
        if not isinstance(k, QuantizedKV):
            k, v = v, k
        _check_kv(k, v, q, kname)
    elif q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or {k.dtype, v.dtype} != {q.dtype}:
        raise TypeError(f"q, {kname}, v must share one dtype of bf16/fp16/fp32, got {q.dtype}, {k.dtype}, "
                        f"{v.dtype}")
    elif k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need unit stride along D")
    if q.ndim != 3 or len(k.shape) != kdim or v.shape != k.shape:
        raise ValueError(f"q must be [N, Hq, D] and {kname} / v {kdim}-D of the same shape; got q "
                         f"{tuple(q.shape)}, {kname} {tuple(k.shape)}, v {tuple(v.shape)}")
    N, Hq, D = q.shape
    Hkv = k.shape[-2]
    if k.shape[-1] != D or Hq % Hkv:
        raise ValueError(f"head dims differ or Hq={Hq} is not a multiple of Hkv={Hkv}: q {tuple(q.shape)}, "
                         f"{kname} {tuple(k.shape)}")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim={D} must be a power of two >= 16")
    if q.stride(-1) != 1:
        raise ValueError("q, k and v need unit stride along D")
    if query_seq.shape != (N,) or query_pos.shape != (N,):
        raise ValueError(f"query_seq {tuple(query_seq.shape)} and query_pos {tuple(query_pos.shape)} must be "
                         f"[N={N}]")
    if query_pos.stride(0) != 1 or context_lens.ndim != 1 or context_lens.stride(0) != 1:
        raise ValueError("query_pos and context_lens must be contiguous 1-D tensors")
    for name, t in (("query_seq", query_seq), ("query_pos", query_pos), ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64, got {t.dtype}")
    if q.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {q.device}")
    if any(t.device != q.device for t in (k, v, query_seq, query_pos, context_lens)):
        raise ValueError("all tensors must be on q's device")
