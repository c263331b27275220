"""Decode-regime W4A4 GEMM (small M, packed weights), the `decode` config of `kernels.gemm.w4a4_gemm`.

The weight is read packed (4-bit codes + E4M3 block scales) and dequantized in registers, where it
is the MMA's register operand: C^T = W A^T, so N fills the MMA rows and M pads to 16, 32 or 64.

Decode layout (`pack_weight`, made once per weight update): within each BK-wide chunk of a row, the
codes are reordered so that int16 word c holds, at nibble o (bits 4o .. 4o + 3), the code of column
o * BK / 4 + c. Nibble o of the chunk's words is then the weight operand of dot o, whose activation
operand is the contiguous column range o * BK / 4 + c: the activation goes from global to shared
memory by async copy, untouched (no register pass, no fence before each MMA), and a word's nibbles
never move between lanes. The block scales keep their order and are stored in the operand dtype
(0.125 instead of 0.0625 bytes per weight: converting E4M3 in the kernel cost ~1.5 instructions per
weight, a quarter of the loop, because each scale is needed by four lanes).

Dequantization: inline PTX turns a pair of words into one 2 x 16-bit register per nibble position
(shifts and masks put the code's magnitude bits on the exponent's low bits and the mantissa's top
bit, its sign on the sign), multiplied by the block scale in the same precision (exact: the product
has at most 6 significant bits and lies on the grid). The operand dtype is the activation's: fp16
codes are e2m1 * 2^-14 times fp16 s_b; bf16 codes are e2m1 * 2^-126 (subnormal for +-0.5) times
bf16 s_b * 2^62 (SCALE_SHIFT). The epilogue multiplies the fp32 accumulator back (W_SHIFT). The CPU
interpreter runs the same K order with plain integer ops instead of the PTX.

Split-K where N alone does not fill the GPU: the last program of an N tile to arrive sums the fp32
partials in split order (deterministic). The K order depends on (N, K) and the tile, never on M, so
rows keep their bits for every M of one padded size; it is not the aligned order, so bits equal the
aligned path's wherever the fp32 accumulation is exact (nearly all outputs, FACTS.md 1.1).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.epilogue import epilogue

# by M padded to 16 / 32 / 64; SPLIT_K doubles (`decode_config`) until the grid has MIN_PROGRAMS
DECODE_TILES = {
    16: dict(BM=16, BN=64, BK=256, MIN_PROGRAMS=264, num_warps=4, num_stages=4),
    32: dict(BM=32, BN=64, BK=256, MIN_PROGRAMS=264, num_warps=4, num_stages=4),
    64: dict(BM=64, BN=64, BK=256, MIN_PROGRAMS=264, num_warps=4, num_stages=4),
}
MAX_SPLIT_K = 16
# the weight operand holds e2m1 * s_b / W_SHIFT; the epilogue multiplies it back
W_SHIFT = {torch.float16: 2.0**14, torch.bfloat16: 2.0**64}


SCALE_SHIFT = {torch.float16: 1.0, torch.bfloat16: 2.0**62}  # stored scales are s_b * SCALE_SHIFT


@dataclasses.dataclass(frozen=True)
class DecodeWeight:
    """A packed weight in the decode layout for chunks of bk columns: codes uint8 [N, K // 2] (two
    per byte, reordered) and block scales [N, K // 16] in the operand dtype (s_b * SCALE_SHIFT)."""

    codes: torch.Tensor
    scales: torch.Tensor
    bk: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], 2 * self.codes.shape[1]


def pack_weight(codes: torch.Tensor, block_scales: torch.Tensor, bk: int = 256,
                dtype=torch.bfloat16) -> DecodeWeight:
    """Codes uint8 [N, K // 2] (the even column in the low nibble) and E4M3 block scales [N, K // 16]
    -> the decode layout for chunks of bk columns and activations of `dtype` (bf16 or fp16)."""
    n, kh = codes.shape
    if (2 * kh) % bk or bk % 64:
        raise ValueError(f"K={2 * kh} must be a multiple of the decode chunk BK={bk}, itself of 64")
    if dtype not in SCALE_SHIFT:
        raise TypeError(f"the decode operand dtype is bf16 or fp16, not {dtype}")
    if tuple(block_scales.shape) != (n, kh // 8) or block_scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"block_scales must be float8_e4m3fn [N, K // 16] = {(n, kh // 8)}, got "
                         f"{block_scales.dtype} {tuple(block_scales.shape)}")
    nib = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, 2 * kh // bk, 4, bk // 4)
    nib = nib.transpose(-1, -2).reshape(n, kh, 2)  # word c, nibble o <- column o * bk / 4 + c
    scales = (block_scales.float() * SCALE_SHIFT[dtype]).to(dtype)  # exact
    return DecodeWeight((nib[..., 0] | (nib[..., 1] << 4)).contiguous(), scales.contiguous(), bk)


def _nibble_asm(o: int, bf16: bool) -> str:
    """PTX: two int16 words (one 32-bit register, pack=2) -> nibble o of each as a 16-bit float pair:
    magnitude bits to bits 9..11 (fp16) or 6..8 (bf16), sign to bit 15, both halves at once."""
    at, dst = 4 * o, (6 if bf16 else 9)
    mask = "0x01C001C0" if bf16 else "0x0E000E00"
    mag = f"shl.b32 u, $1, {dst - at};" if at < dst else f"shr.b32 u, $1, {at - dst};"
    sign = "mov.b32 v, $1;" if o == 3 else f"shl.b32 v, $1, {12 - at};"
    return ("{\n.reg .b32 u, v;\n" + mag + "\n" + sign + f"\nand.b32 u, u, {mask};\n"
            "and.b32 v, v, 0x80008000;\nor.b32 $0, u, v;\n}")


_F16_ASM = [tl.constexpr(_nibble_asm(o, False)) for o in range(4)]
_BF16_ASM = [tl.constexpr(_nibble_asm(o, True)) for o in range(4)]
_H0, _H1, _H2, _H3 = _F16_ASM
_B0, _B1, _B2, _B3 = _BF16_ASM


@triton.jit
def _nibble(q, o: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr):
    """int16 words (code o at bits 4o .. 4o + 3) -> code o as fp16 e2m1 * 2^-14 or bf16
    e2m1 * 2^-126."""
    if HW:
        if BF16:
            asm: tl.constexpr = _B0 if o == 0 else (_B1 if o == 1 else (_B2 if o == 2 else _B3))
            w = tl.inline_asm_elementwise(asm, "=r,r", [q], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            asm: tl.constexpr = _H0 if o == 0 else (_H1 if o == 1 else (_H2 if o == 2 else _H3))
            w = tl.inline_asm_elementwise(asm, "=r,r", [q], dtype=tl.float16, is_pure=True, pack=2)
    else:
        c = (q.to(tl.uint16, bitcast=True) >> (4 * o)) & 15
        if BF16:
            w = (((c & 7) << 6) | ((c & 8) << 12)).to(tl.bfloat16, bitcast=True)
        else:
            w = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)
    return w


@triton.jit
def _load_rows(ptrs, mask_n, EVEN_N: tl.constexpr):
    """Weight rows (zeros past N; unmasked when N % BN == 0)."""
    if EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask_n[:, None], other=0)


@triton.jit
def _w4a4_decode_kernel(a_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N,
                        stride_am, stride_cn, stride_sn, stride_om, stride_sa,
                        K: tl.constexpr, EPILOGUE: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr,
                        W_SHIFT: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                        EVEN_N: tl.constexpr):
    """out[:M, tile] for decode-layout codes (int16 words [N, K // 4]). acc^T [BN, BM] += sum over o
    of W_o A_o, A_o the activation columns kb + o * BK / 4 + c."""
    QK: tl.constexpr = BK // 4  # each dot's K
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    offs_c = tl.arange(0, QK)
    offs_b = tl.arange(0, BK // 64)
    a_cols = a_ptr + offs_m.to(tl.int64)[None, :] * stride_am + offs_c[:, None]  # [QK, BM]
    w_rows = codes_ptr + rows[:, None] * stride_cn + offs_c[None, :]  # [BN, QK]
    s_rows = ws_ptr + rows[:, None] * stride_sn + offs_b[None, :]  # [BN, BK // 64]
    KS: tl.constexpr = K // SPLIT_K
    acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kb = pid_k * KS + k0
        q = _load_rows(w_rows + kb // 4, mask_n, EVEN_N)  # [BN, QK] int16 words
        for o in tl.static_range(4):
            sb = _load_rows(s_rows + (kb + o * QK) // 16, mask_n, EVEN_N)  # [BN, BK // 64]
            # each block scale onto its 16 columns (a broadcast in registers: no shuffle)
            s = tl.reshape(tl.broadcast_to(sb[:, :, None], [BN, BK // 64, 16]), [BN, QK])
            x = tl.load(a_cols + kb + o * QK, mask=mask_m[None, :], other=0.0)  # [QK, BM]
            acc_t = tl.dot(_nibble(q, o, BF16, HW) * s, x, acc_t)
    acc = tl.trans(acc_t) * W_SHIFT  # [BM, BN]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=1.0)
    sw = tl.load(sw_ptr)
    if SPLIT_K == 1:
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


def decode_config(m: int, n: int, k: int) -> dict:
    """The tile for this (M, N, K): by M padded (16, 32, 64), then SPLIT_K (a power of 2 dividing
    K // BK) until the grid reaches the tile's MIN_PROGRAMS. Depends on M only through the padding:
    rows of one padded size share the tile and the K order."""
    if m > 64:
        raise ValueError(f"the decode config serves M <= 64, got M={m}; use 'aligned' or 'prefill'")
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    cfg = dict(DECODE_TILES[bm], kernel="decode")
    min_programs = cfg.pop("MIN_PROGRAMS")
    if interpreted():
        cfg.update(BN=32, BK=64, num_stages=1)
    split = 1
    while (triton.cdiv(n, cfg["BN"]) * split < min_programs and split < MAX_SPLIT_K
           and k % (2 * split * cfg["BK"]) == 0):
        split *= 2
    cfg["SPLIT_K"] = split
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


def decode_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, w_scale: torch.Tensor,
                epilogue: str = "sdec", out_dtype=torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """`gemm.w4a4_gemm`'s decode config for a weight in the decode layout (`pack_weight`): a [M, K]
    e2m1 * s_b (the weight's operand dtype), a_scale fp32 [M] or [], w_scale fp32 [] -> [M, N].
    config defaults to `decode_config(M, N, K)`; its BK must be the weight's."""
    from minite.kernels.epilogue import EPILOGUES

    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k or a.dtype != w.scales.dtype or a.stride(1) != 1:
        raise ValueError(f"a must be [M, K={w.shape[1]}] in {w.scales.dtype} with unit stride along K, "
                         f"got {tuple(a.shape)} {a.dtype}")
    cfg = config or decode_config(m, n, k)
    if cfg["BK"] != w.bk:
        raise ValueError(f"the weight was packed for BK={w.bk}, the config has BK={cfg['BK']}")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    launch(a, a_scale.reshape(-1), w, w_scale, out, EPILOGUES[epilogue], cfg)
    return out


def launch(a, sa, w: DecodeWeight, w_scale, out, epilogue_id: int, cfg: dict) -> None:
    """out[:M] = the decode GEMM of a [M, K] and w (checked by the callers)."""
    m, k = a.shape
    n = w.shape[0]
    bm, bn, bk, split = cfg["BM"], cfg["BN"], cfg["BK"], cfg["SPLIT_K"]
    if m > bm:
        raise ValueError(f"decode tile BM={bm} cannot hold M={m}")
    if k % (split * bk):
        raise ValueError(f"K={k} must be a multiple of SPLIT_K * BK = {split * bk}")
    q16 = w.codes.view(torch.int16)  # [N, K // 4]: 4 codes each
    tiles = triton.cdiv(n, bn)
    if split > 1:
        part = torch.empty(split, bm, n, dtype=torch.float32, device=a.device)
        counters = _split_counters(tiles, a.device)
    else:
        part = counters = out
    _w4a4_decode_kernel[(tiles, split)](
        a, q16, w.scales, sa, w_scale, out, part, counters, m, n,
        a.stride(0), q16.stride(0), w.scales.stride(0), out.stride(0), 0 if sa.numel() == 1 else 1,
        K=k, EPILOGUE=epilogue_id, BF16=a.dtype == torch.bfloat16, HW=not interpreted(),
        W_SHIFT=W_SHIFT[a.dtype], BM=bm, BN=bn, BK=bk, SPLIT_K=split, EVEN_N=n % bn == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
