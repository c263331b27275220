"""Decode-regime W4A4 GEMM (small M, packed weights), the `decode` config of `kernels.gemm.w4a4_gemm`.

The weight is read packed (4-bit codes + block scales) and dequantized in registers, where it is the
MMA's register operand: C^T = W A^T, so N fills the MMA rows and M pads to 16, 32 or 64 (wgmma).

Decode layout (`pack_weight`, made once per weight update), in MMA register order: column
32 g + 16 b + 8 h + 2 t + e of a row is code 2 b + h of int16 word 8 g + 2 t + e (bits placed as
WORD_BITS says). So a thread's 32-bit pair of words (t, e = 0 / 1) holds the eight columns it owns in
the MMA's register operand for two k16 blocks ({2t, 2t+1, 2t+8, 2t+9} of each); the four code
tensors join into one [BN, BK] operand in plain column order with no data movement (SASS: no
shared-memory round trip), and the loop has one dot per K step, which Triton pipelines (the wgmma of
step i runs while step i+1 is dequantized). The activation tile is a plain [BK, BM] slice, async-copied
to shared memory untouched. The block scales keep their order, stored in the operand dtype (0.125
instead of 0.0625 bytes per weight; no conversion in the loop).

Dequantization (bf16 activations, the GPU's case): inline PTX turns a pair of words into one bf16x2
register per code slot, e2m1 * 2^-126 (the code's magnitude bits on the exponent's low bits and the
mantissa's top bit, its sign on the sign; WORD_BITS makes that one AND for slot 2, a shift and an AND
for slots 0 and 1); a bf16x2 multiply by s_b * 2^62 (SCALE_SHIFT) follows. Both are exact: the
products have at most 6 significant bits, on the grid, subnormal ones included (+-0.5 codes). fp16
activations (the CPU interpreter) take e2m1 * 2^-14 times s_b through plain integer ops. The epilogue
multiplies the fp32 accumulator back (W_SHIFT).

K order: the columns in plain order, k16 MMA steps into one accumulator, which is the aligned path's
order (`kernels.gemm`): with SPLIT_K = 1 (`aligned_decode_config`) rows get the aligned bits whatever
BK is. Split-K where N alone does not fill the GPU: the last program of an N tile to arrive sums the
fp32 partials in split order (deterministic); the split depends on (M padded, N, K), never on the
data, so rows keep their bits for every M of one padded size, and equal the aligned path's wherever
the fp32 accumulation is exact (nearly all outputs, docs/facts.md).

Tiles in memory: the words and scales of each TILE_N-row block and TILE_K-column step lie together (8 KB of
words and 2 KB of scales), the blocks' steps in K order, so a program's K step reads one contiguous piece
instead of 64 rows 2 KB apart. H200, Qwen3-8B shapes, against row-major rows (probes at 31acfab and aff58e0):
1.06x at M <= 8 and 1.04x at M = 32 on gate+up, 1.08x at M = 64 (its K step, 128, reads half of each row's
piece: 4 % slower than on 128-wide tiles, but those, read as two pieces per 256-column step, ran 3-12 % slower
than row-major rows); q|o and k|v within 4 %.
Rows are zero-padded to TILE_N; `DecodeWeight.rows()` gives the row-major view back.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.epilogue import EPILOGUES, epilogue, segment_bounds, segment_views, store_segments
from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel

# by M padded to 16 / 32 / 64; SPLIT_K doubles (`decode_config`) until the grid has MIN_PROGRAMS (at
# most MAX_SPLIT_K); from SPLIT["FROM"] splits on, the tile takes SPLIT's K step and stages. H200,
# Qwen3-8B shapes, CUDA graphs over rotating weights (benchmarks/tools/sweep_decode_tiles.py at 736de97
# and 03323ac): more CTAs per SM (few stages)
# beat deeper pipelines; at M = 32, tiles split 8 ways ran faster on BK 128 (q|o 9.8 vs 12.8 us,
# down 18.3 vs 22.1), unsplit ones on BK 256 (gate+up 27.5 vs 32.5); at M = 64 the partials cost
# (SPLIT * BM * N * 8 bytes) capped the split at 4 (down 26.8 us vs 30.3 at 8), whose tiles ran
# best on BK 256 / 2 stages, unsplit ones on BK 128 / 3 stages (gate+up 36.8 vs 38.5)
DECODE_TILES = {
    16: dict(BM=16, BN=64, BK=256, MIN_PROGRAMS=264, num_warps=4, num_stages=3),
    32: dict(BM=32, BN=64, BK=256, MIN_PROGRAMS=264, num_warps=4, num_stages=3, SPLIT=dict(FROM=4, BK=128)),
    64: dict(BM=64, BN=64, BK=128, MIN_PROGRAMS=264, MAX_SPLIT_K=4, num_warps=4, num_stages=3,
             SPLIT=dict(FROM=4, BK=256, num_stages=2)),
}
MAX_SPLIT_K = 16
KGROUP = 32  # the layout's column group (two k16 MMA blocks): K must be a multiple of it
TILE_N = 64  # rows of a memory tile (a wgmma's weight rows)
TILE_K = 256  # columns of a memory tile (the widest K step), halved until it divides K (`tile_k`)
_TILE_N = tl.constexpr(TILE_N)
# the weight operand holds e2m1 * s_b / W_SHIFT; the epilogue multiplies it back
W_SHIFT = {torch.float16: 2.0**14, torch.bfloat16: 2.0**64}
SCALE_SHIFT = {torch.float16: 1.0, torch.bfloat16: 2.0**62}  # stored scales are s_b * SCALE_SHIFT
# where slot o's magnitude bits (low to high) and sign bit sit in a decode-layout word: slots 0-2 have
# their sign 9 above the magnitude, as bf16 has (magnitude on bits 6..8, sign on 15)
WORD_BITS = (((0, 1, 2), 9), ((3, 4, 5), 12), ((6, 7, 8), 15), ((10, 11, 13), 14))


def tile_k(k: int) -> int:
    """The memory tile's width for rows of K columns (a power of 2 from KGROUP to TILE_K dividing K)."""
    tk = TILE_K
    while k % tk:
        tk //= 2
    return tk


@dataclasses.dataclass(frozen=True)
class DecodeWeight:
    """A packed weight of N rows in the decode layout, in memory tiles: codes as int16 words
    [..., N_pad / TILE_N, K / TK, TILE_N, TK / 4] (4 codes each, in MMA register order, WORD_BITS) and
    block scales [..., N_pad / TILE_N, K / TK, TILE_N, TK / 16] in the operand dtype (s_b * SCALE_SHIFT),
    TK = `tile_k(K)`, rows zero-padded to N_pad; the leading dimension, if any, runs over MoE experts."""

    codes: torch.Tensor
    scales: torch.Tensor
    n: int

    @property
    def shape(self) -> tuple[int, ...]:
        c = self.codes.shape
        return (*c[:-4], self.n, 4 * c[-3] * c[-1])

    @property
    def n_pad(self) -> int:
        return TILE_N * self.codes.shape[-4]

    @property
    def tk(self) -> int:
        return 4 * self.codes.shape[-1]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(words [..., N, K // 4], scales [..., N, K // 16]) in row-major order (for inspection)."""
        return _from_tiles(self.codes, self.n), _from_tiles(self.scales, self.n)


def _to_tiles(t: torch.Tensor, tk_cols: int) -> torch.Tensor:
    """[..., N, C] -> [..., N_pad / TILE_N, C / tk_cols, TILE_N, tk_cols] contiguous, rows zero-padded."""
    *lead, n, c = t.shape
    pad = -n % TILE_N
    if pad:
        t = torch.cat([t, t.new_zeros(*lead, pad, c)], -2)
    t = t.reshape(*lead, (n + pad) // TILE_N, TILE_N, c // tk_cols, tk_cols)
    return t.transpose(-3, -2).contiguous()


def _from_tiles(t: torch.Tensor, n: int) -> torch.Tensor:
    *lead, nb, kt, rows, c = t.shape
    return t.transpose(-3, -2).reshape(*lead, nb * rows, kt * c)[..., :n, :]


def pack_weight(codes: torch.Tensor, block_scales: torch.Tensor, dtype=torch.bfloat16) -> DecodeWeight:
    """Codes uint8 [..., N, K // 2] (the even column in the low nibble) and E4M3 block scales
    [..., N, K // 16] -> the decode layout for `dtype` activations (bf16 or fp16); K % KGROUP == 0."""
    kh = codes.shape[-1]
    if (2 * kh) % KGROUP:
        raise ValueError(f"K={2 * kh} must be a multiple of the decode layout's column group {KGROUP}")
    if dtype not in SCALE_SHIFT:
        raise TypeError(f"the decode operand dtype is bf16 or fp16, not {dtype}")
    want = (*codes.shape[:-1], kh // 8)
    if tuple(block_scales.shape) != want or block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_scales must be float8_e4m3fn [..., N, K // 16] = {want}, got "
                         f"{block_scales.dtype} {tuple(block_scales.shape)}")
    flat = codes.reshape(-1, kh)
    words = torch.empty(flat.shape[0], kh // 2, dtype=torch.int16, device=codes.device)
    step = max(1, PACK_CODES // kh)  # rows at a time: the int32 temporaries stay ~12 bytes per code
    for r in range(0, flat.shape[0], step):
        words[r:r + step] = _pack_rows(flat[r:r + step])
    scales = (block_scales.float() * SCALE_SHIFT[dtype]).to(dtype)  # exact
    tk = tile_k(2 * kh)
    words = _to_tiles(words.reshape(*codes.shape[:-1], kh // 2), tk // 4)
    return DecodeWeight(words, _to_tiles(scales, tk // 16), codes.shape[-2])


PACK_CODES = 1 << 24  # code bytes `pack_weight` converts at a time (an MoE weight holds ~10^8-10^9)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """Codes uint8 [R, K // 2] -> int16 words [R, K // 4]: column 32 g + 16 b + 8 h + 2 t + e is slot
    2 b + h of word 8 g + 2 t + e."""
    r, kh = codes.shape
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(r, kh // 16, 2, 2, 4, 2).to(torch.int32)
    nib = nib.permute(0, 1, 4, 5, 2, 3).reshape(r, kh // 16, 4, 2, 4)  # [R, g, t, e, slot 2b + h]
    mag, sign = nib & 7, nib >> 3
    word = torch.zeros_like(mag[..., 0])
    for o, (mag_at, sign_at) in enumerate(WORD_BITS):
        for bit, at in enumerate(mag_at):
            word |= ((mag[..., o] >> bit) & 1) << at
        word |= sign[..., o] << sign_at
    return word.reshape(r, kh // 2).to(torch.int16)  # wraps bit 15 onto the sign: the same 16 bits


# PTX, two int16 words (one 32-bit register, pack=2) -> code o of each as bf16 e2m1 * 2^-126 (magnitude
# to bits 6..8, sign to bit 15, both halves at once; left shifts only, so no bit crosses halves)
_BF16_ASM = (
    "{\n.reg .b32 u;\nshl.b32 u, $1, 6;\nand.b32 $0, u, 0x81C081C0;\n}",
    "{\n.reg .b32 u;\nshl.b32 u, $1, 3;\nand.b32 $0, u, 0x81C081C0;\n}",
    "and.b32 $0, $1, 0x81C081C0;",
    "{\n.reg .b32 u, v;\nshr.b32 u, $1, 4;\nand.b32 u, u, 0x00C000C0;\nshr.b32 v, $1, 5;\n"
    "and.b32 v, v, 0x01000100;\nor.b32 u, u, v;\nshl.b32 v, $1, 1;\nand.b32 v, v, 0x80008000;\n"
    "or.b32 $0, u, v;\n}",
)
_B0, _B1, _B2, _B3 = (tl.constexpr(a) for a in _BF16_ASM)


@triton.jit
def _code(q, o: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr):
    """Decode-layout int16 words -> code o as bf16 e2m1 * 2^-126 or fp16 e2m1 * 2^-14."""
    if HW and BF16:
        asm: tl.constexpr = _B0 if o == 0 else (_B1 if o == 1 else (_B2 if o == 2 else _B3))
        w = tl.inline_asm_elementwise(asm, "=r,r", [q], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:  # WORD_BITS with integer ops (the interpreter, and fp16 activations)
        u = q.to(tl.uint16, bitcast=True)
        if o == 0:
            mag, sign = u & 7, (u >> 9) & 1
        elif o == 1:
            mag, sign = (u >> 3) & 7, (u >> 12) & 1
        elif o == 2:
            mag, sign = (u >> 6) & 7, u >> 15
        else:
            mag, sign = ((u >> 10) & 3) | ((u >> 11) & 4), (u >> 14) & 1
        if BF16:
            w = ((mag << 6) | (sign << 15)).to(tl.bfloat16, bitcast=True)
        else:
            w = ((mag << 9) | (sign << 15)).to(tl.float16, bitcast=True)
    return w


@triton.jit
def _load_rows(ptrs, mask_n, EVEN_N: tl.constexpr):
    """Weight rows (zeros past the padded rows; unmasked when they fill the tile, EVEN_N)."""
    if EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask_n[:, None], other=0)


@triton.jit
def layout_rows(codes_ptr, ws_ptr, n0, BN: tl.constexpr, K: tl.constexpr, TK: tl.constexpr):
    """Pointers to rows n0 .. n0 + BN of one weight in the tiled decode layout, at column 0: (words,
    scales); n0 a multiple of BN, and BN a divisor or a multiple of TILE_N."""
    if BN <= _TILE_N:
        blk = (n0 // _TILE_N).to(tl.int64)
        r = n0 % _TILE_N + tl.arange(0, BN)
    else:
        blk = (n0 // _TILE_N).to(tl.int64) + tl.arange(0, BN) // _TILE_N
        r = tl.arange(0, BN) % _TILE_N
    return (codes_ptr + blk * (_TILE_N * K // 4) + r * (TK // 4),
            ws_ptr + blk * (_TILE_N * K // 16) + r * (TK // 16))


@triton.jit
def dequant_step(words, scales, BF16: tl.constexpr, HW: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One K step of the decode layout: words [BN, BK / 4], block scales [BN, BK / 16] -> the weight
    operand [BN, BK] (e2m1 * s_b / W_SHIFT) in plain column order."""
    G: tl.constexpr = BK // 32  # column groups per K step
    q = tl.reshape(words, [BN, G, 4, 2])  # [n, g, t, e]
    s0, s1 = tl.split(tl.reshape(scales, [BN, G, 2]))
    s0 = s0[:, :, None, None]  # block b = 0 of each group
    s1 = s1[:, :, None, None]
    w = tl.join(tl.join(_code(q, 0, BF16, HW) * s0, _code(q, 1, BF16, HW) * s0),
                tl.join(_code(q, 2, BF16, HW) * s1, _code(q, 3, BF16, HW) * s1))  # [n, g, t, e, h, b]
    return tl.reshape(tl.permute(w, (0, 1, 5, 4, 2, 3)), [BN, BK])  # column 32 g + 16 b + 8 h + 2 t + e


@triton.jit
def decode_acc(a_rows, mask_m, w_rows, s_rows, mask_n, k_begin, KS: tl.constexpr, TK: tl.constexpr,
               BF16: tl.constexpr, HW: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               EVEN_N: tl.constexpr):
    """acc^T [BN, BM] fp32 over columns k_begin .. k_begin + KS in plain order, one dot per K step.
    a_rows [BM] points at the activation rows, w_rows / s_rows [BN] at the weight's word / scale rows
    (`layout_rows`, memory tiles TK >= BK columns wide: a K step lies in one tile)."""
    TW: tl.constexpr = TK // 4  # words of a row in one memory tile
    TS: tl.constexpr = TK // 16  # scales of a row in one memory tile
    w_cols = w_rows[:, None] + tl.arange(0, BK // 4)[None, :]  # [BN, BK / 4] words
    s_cols = s_rows[:, None] + tl.arange(0, BK // 16)[None, :]  # [BN, BK / 16] block scales
    a_cols = a_rows[None, :] + tl.arange(0, BK)[:, None]  # [BK, BM]
    acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kb = k_begin + k0
        # the step's offset with no remainder, which would hide its alignment from Triton (the loads
        # would not vectorize)
        if BK == TK:  # whole tiles: linear in kb
            w_off = kb * (_TILE_N // 4)
            s_off = kb * (_TILE_N // 16)
        else:  # kb / 4 plus (TILE_N - 1) rows for each whole tile before it
            w_off = kb // 4 + (kb // TK) * ((_TILE_N - 1) * TW)
            s_off = kb // 16 + (kb // TK) * ((_TILE_N - 1) * TS)
        w = dequant_step(_load_rows(w_cols + w_off, mask_n, EVEN_N),
                         _load_rows(s_cols + s_off, mask_n, EVEN_N), BF16, HW, BN, BK)
        x = tl.load(a_cols + kb, mask=mask_m[None, :], other=0.0)  # [BK, BM]
        acc_t = tl.dot(w, x, acc_t)
    return acc_t


@triton.jit
def _w4a4_decode_kernel(a_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N,
                        stride_am, stride_om, stride_sa, N1, N2, K: tl.constexpr, TK: tl.constexpr,
                        EPILOGUE: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr, W_SHIFT: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        SPLIT_K: tl.constexpr, EVEN_N: tl.constexpr, SEGMENTED: tl.constexpr):
    """out[:M, tile] for a weight in the decode layout (`DecodeWeight`); `decode_acc` is the loop.
    SEGMENTED (no split-K): the weight is 2-3 weights concatenated along N, sw_ptr their 3 scales, out
    their flat outputs (`epilogue.store_segments`)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    KS: tl.constexpr = K // SPLIT_K
    w_rows, s_rows = layout_rows(codes_ptr, ws_ptr, pid_n * BN, BN, K, TK)
    acc_t = decode_acc(a_ptr + offs_m.to(tl.int64) * stride_am, mask_m, w_rows, s_rows, mask_n, pid_k * KS,
                       KS, TK, BF16, HW, BM, BN, BK, EVEN_N)
    acc = tl.trans(acc_t) * W_SHIFT  # [BM, BN]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=1.0)
    sw = tl.load(sw_ptr)
    if SEGMENTED:
        store_segments(acc, sa_ptr, sw, tl.load(sw_ptr + 1), tl.load(sw_ptr + 2), out_ptr, offs_m, offs_n, M,
                       N, N1, N2, stride_sa, EPILOGUE)
    elif SPLIT_K == 1:
        tl.store(out_ptrs, epilogue(acc, sa, sw, EPILOGUE).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # part [SPLIT_K, BM, N] fp32; the last program of this N tile to arrive sums the partials in
        # split order and resets the tile's counter for the next launch
        parts = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(parts + pid_k * BM * N, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BM, BN], dtype=tl.float32)
            for i in tl.static_range(SPLIT_K):
                total += tl.load(parts + i * BM * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            tl.store(out_ptrs, epilogue(total, sa, sw, EPILOGUE).to(out_ptr.dtype.element_ty),
                     mask=out_mask)


def _tile(m: int, k: int) -> dict:
    """DECODE_TILES' entry for M padded (16, 32, 64), K steps fitted to K (BK halves until it divides K)."""
    if m > 64:
        raise ValueError(f"the decode config serves M <= 64, got M={m}; use 'aligned' or 'prefill'")
    if k % KGROUP:
        raise ValueError(f"K={k} must be a multiple of the decode layout's column group {KGROUP}")
    cfg = dict(DECODE_TILES[16 if m <= 16 else (32 if m <= 32 else 64)], kernel="decode")
    if interpreted():
        cfg.update(BN=32, BK=64, num_stages=1)
        cfg.pop("SPLIT", None)
    return _fit_bk(cfg, k)


def _fit_bk(cfg: dict, k: int) -> dict:
    while k % cfg["BK"]:
        cfg["BK"] //= 2
    return cfg


def _split(n: int, k: int, cfg: dict, min_programs: int, most: int) -> int:
    """SPLIT_K: doubles while the grid is below min_programs and K still splits into whole K steps."""
    split = 1
    while (cdiv(n, cfg["BN"]) * split < min_programs and split < most
           and k % (2 * split * cfg["BK"]) == 0):
        split *= 2
    return split


def decode_config(m: int, n: int, k: int) -> dict:
    """The tile for this (M, N, K): by M padded (16, 32, 64), then SPLIT_K (a power of 2 dividing
    K // BK) until the grid reaches the tile's MIN_PROGRAMS, split tiles on the entry's SPLIT K step.
    Depends on M only through the padding: rows of one padded size share the tile and the sums."""
    cfg = _tile(m, k)
    min_programs = cfg.pop("MIN_PROGRAMS")
    most = cfg.pop("MAX_SPLIT_K", MAX_SPLIT_K)
    split_tile = cfg.pop("SPLIT", None)
    split = _split(n, k, cfg, min_programs, most)
    if split_tile and split >= split_tile["FROM"]:
        cfg = _fit_bk(dict(cfg, **{key: v for key, v in split_tile.items() if key != "FROM"}), k)
        split = _split(n, k, cfg, min_programs, most)
    cfg["SPLIT_K"] = split
    return cfg


def aligned_decode_config(m: int, k: int) -> dict:
    """The decode tile in the aligned K order (`kernels.gemm`'s): no split-K, so rows get the aligned
    path's bits (GPU test) while the weight is read packed. M <= 64 (padded as in `decode_config`)."""
    cfg = _tile(m, k)
    for key in ("MIN_PROGRAMS", "MAX_SPLIT_K", "SPLIT"):
        cfg.pop(key, None)
    cfg["SPLIT_K"] = 1
    return cfg


_COUNTERS: dict = {}


def _split_counters(n_tiles: int, device) -> torch.Tensor:
    """One int32 arrival counter per N tile, zero between launches (the kernel resets what it uses).
    Cached per device; the first call allocates (do it before a CUDA graph capture)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n_tiles:
        buf = torch.zeros(max(n_tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _check(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, epilogue: str) -> None:
    """The arguments `decode_gemm` and `decode_gemm_segments` share: a 2D weight, a [M, K] in its
    operand dtype, a_scale fp32 [M] or [], a known epilogue."""
    if w.codes.ndim != 4:
        raise ValueError(f"decode_gemm takes a 2D weight, got {tuple(w.shape)} (experts: grouped_decode)")
    if a.ndim != 2 or a.shape[1] != w.shape[1] or a.dtype != w.scales.dtype or a.stride(1) != 1:
        raise ValueError(f"a must be [M, K={w.shape[1]}] in {w.scales.dtype} with unit stride along K, "
                         f"got {tuple(a.shape)} {a.dtype}")
    if a_scale.dtype != torch.float32 or a_scale.numel() not in (1, a.shape[0]):
        raise ValueError(f"a_scale must be fp32 with 1 or M={a.shape[0]} elements, got {a_scale.dtype} "
                         f"{tuple(a_scale.shape)}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not supported; choose one of {list(EPILOGUES)}")


def decode_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, w_scale: torch.Tensor,
                epilogue: str = "sdec", out_dtype=torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """`gemm.w4a4_gemm`'s decode config for a weight in the decode layout (`pack_weight`): a [M, K]
    e2m1 * s_b (the weight's operand dtype), a_scale fp32 [M] or [], w_scale fp32 [] -> [M, N].
    config defaults to `decode_config(M, N, K)`."""
    _check(a, a_scale, w, epilogue)
    m, k = a.shape
    n = w.shape[0]
    if w_scale.numel() != 1:
        raise ValueError(f"w_scale must be one number, got {tuple(w_scale.shape)}")
    cfg = config or decode_config(m, n, k)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    launch(a, a_scale.reshape(-1), w, w_scale, out, EPILOGUES[epilogue], cfg)
    return out


def decode_gemm_segments(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, w_scales: torch.Tensor,
                         widths: tuple[int, ...], epilogue: str = "sdec", out_dtype=torch.bfloat16,
                         config: dict | None = None) -> list[torch.Tensor]:
    """`decode_gemm` of a against 2-3 weights concatenated along N in one decode layout (each
    `widths[j]` rows, a multiple of TILE_N, so every memory tile belongs to one weight), w_scales fp32
    [3] their epilogue factors (the last repeated for two): each weight's output [M, width], contiguous
    views of one buffer, bitwise what `decode_gemm` gives for that weight alone under the same config.
    config defaults to `aligned_decode_config(M, K)` (no split-K: the aligned bits)."""
    _check(a, a_scale, w, epilogue)
    m, k = a.shape
    bounds = segment_bounds(widths, w.shape[0], w_scales, m, TILE_N)
    cfg = config or aligned_decode_config(m, k)
    if cfg["SPLIT_K"] != 1:
        raise ValueError("decode_gemm_segments runs without split-K")
    buf = torch.empty(m * w.shape[0], dtype=out_dtype, device=a.device)
    launch(a, a_scale.reshape(-1), w, w_scales, buf, EPILOGUES[epilogue], cfg, bounds)
    return segment_views(buf, m, widths)


def launch(a, sa, w: DecodeWeight, w_scale, out, epilogue_id: int, cfg: dict, bounds=None) -> None:
    """out[:M] = the decode GEMM of a [M, K] and w (checked by the callers); `bounds` (N1, N2): w is
    weights concatenated along N, out their flat outputs (`decode_gemm_segments`)."""
    m, k = a.shape
    n = w.shape[0]
    bm, bn, bk, split = cfg["BM"], cfg["BN"], cfg["BK"], cfg["SPLIT_K"]
    if m > bm:
        raise ValueError(f"decode tile BM={bm} cannot hold M={m}")
    if k % (split * bk) or bk % KGROUP or bk > w.tk:
        raise ValueError(f"K={k} must be a multiple of SPLIT_K * BK = {split * bk}, BK of {KGROUP} and at "
                         f"most the layout's tile width {w.tk}")
    tiles = cdiv(n, bn)
    if split > 1:
        part = torch.empty(split, bm, n, dtype=torch.float32, device=a.device)
        counters = _split_counters(tiles, a.device)
    else:
        part = counters = out
    launch_kernel(_w4a4_decode_kernel, (tiles, split), (
        a, w.codes, w.scales, sa, w_scale, out, part, counters, m, n,
        a.stride(0), out.stride(0), 0 if sa.numel() == 1 else 1, *(bounds or (0, 0))),
        K=k, TK=w.tk, EPILOGUE=epilogue_id, BF16=a.dtype == torch.bfloat16, HW=not interpreted(),
        W_SHIFT=W_SHIFT[a.dtype], BM=bm, BN=bn, BK=bk, SPLIT_K=split, EVEN_N=w.n_pad % bn == 0,
        SEGMENTED=bounds is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
