"""Decode-regime W4A4 GEMM (small M, packed weights), the `decode` config of `kernels.gemm.w4a4_gemm`.

The weight is read as it is stored (codes uint8 [N, K // 2] viewed as int32 words of 8 codes, E4M3
block scales [N, K // 16]) and dequantized in registers, where it is the MMA's register operand:
C^T = W A^T, so N fills the MMA rows and M pads to 16, 32 or 64.

K order (word-interleaved): nibble o of the words of a K step forms the weight operand of dot o, whose
activation operand is the columns k = kb + 8c + o (c: the word). A word's nibbles never have to move
between lanes, so no shared-memory shuffle of the dequantized weight. One inline-PTX block turns two
words into eight fp16x2 registers (byte permute, shifts and masks: the code's magnitude bits land on
the fp16 exponent's low bits and the mantissa's top bit, so a code is e2m1 * 2^-14), an fp16x2
multiply applies the block scale (exact, the product lies on the fp16 grid), and the epilogue undoes
the 2^-14. The CPU interpreter runs the same K order with plain integer ops instead of the PTX.

Split-K where N alone does not fill the GPU: the last program of an N tile to arrive sums the fp32
partials in split order (deterministic). The K order depends on (N, K) and the tile, never on M, so
rows keep their bits for every M of one padded size; it is not the aligned order, so bits equal the
aligned path's wherever the fp32 accumulation is exact (nearly all outputs, FACTS.md 1.1).
"""

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
W_SHIFT = 16384.0  # the weight operand holds e2m1 * s_b * 2^-14; the epilogue multiplies it back

def _nibble_asm(o: int) -> str:
    """PTX: two int16 code pairs (one 32-bit register, pack=2) -> nibble o of each as fp16x2
    e2m1 * 2^-14: the code's magnitude bits go to bits 9..11 (the fp16 exponent's low bits and the
    mantissa's top bit), its sign to bit 15, in both halves at once."""
    at = 4 * o  # the nibble's lowest bit
    if o == 3:  # sign already on bit 15
        return "{\n.reg .b32 u;\nshr.b32 u, $1, 3;\nand.b32 u, u, 0x0E000E00;\n" \
               "and.b32 $0, $1, 0x80008000;\nor.b32 $0, $0, u;\n}"
    mag = f"shl.b32 u, $1, {9 - at};" if at < 9 else f"shr.b32 u, $1, {at - 9};"
    return ("{\n.reg .b32 u, v;\n" + mag + f"\nshl.b32 v, $1, {12 - at};\nand.b32 u, u, 0x0E000E00;\n"
            "and.b32 v, v, 0x80008000;\nor.b32 $0, u, v;\n}")


_NIBBLE_ASM = [tl.constexpr(_nibble_asm(o)) for o in range(4)]
_ASM0, _ASM1, _ASM2, _ASM3 = _NIBBLE_ASM


@triton.jit
def _nibble_f16(q, o: tl.constexpr, HW: tl.constexpr):
    """int16 code pairs (4 codes each, code o at bits 4o .. 4o + 3) -> fp16 e2m1 * 2^-14 of code o."""
    if HW:
        if o == 0:
            asm: tl.constexpr = _ASM0
        elif o == 1:
            asm: tl.constexpr = _ASM1
        elif o == 2:
            asm: tl.constexpr = _ASM2
        else:
            asm: tl.constexpr = _ASM3
        return tl.inline_asm_elementwise(asm, "=r,r", [q], dtype=tl.float16, is_pure=True, pack=2)
    c = (q.to(tl.uint16, bitcast=True) >> (4 * o)) & 15
    return (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)


@triton.jit
def _scale_f16(sb, HW: tl.constexpr):
    """E4M3 bytes -> fp16 s_b (exact)."""
    if HW:
        return sb.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b = sb.to(tl.int32)
    normal = ((b << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where(b < 8, (b & 7).to(tl.float32) * 0.001953125, normal).to(tl.float16)


@triton.jit
def _act_f16(x, A_BF16: tl.constexpr):
    """int32 words of two activation values -> (low, high) fp16 (exact for e2m1 * s_b)."""
    lo = x.to(tl.int16)
    hi = (x >> 16).to(tl.int16)
    if A_BF16:
        return (lo.to(tl.bfloat16, bitcast=True).to(tl.float16),
                hi.to(tl.bfloat16, bitcast=True).to(tl.float16))
    return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)


@triton.jit
def _load_rows(ptrs, mask_n, EVEN_N: tl.constexpr):
    """Weight rows (zeros past N; unmasked when N % BN == 0)."""
    if EVEN_N:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask_n[:, None], other=0)


@triton.jit
def _w4a4_decode_kernel(a_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, part_ptr, count_ptr, M, N,
                        stride_am, stride_cn, stride_sn, stride_om, stride_sa,
                        K: tl.constexpr, EPILOGUE: tl.constexpr, A_BF16: tl.constexpr, HW: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                        EVEN_N: tl.constexpr):
    """out[:M, tile] for packed weights; a_ptr is the activation viewed as int32 pairs [M, K // 2].
    acc^T [BN, BM] += W_lo A_even + W_hi A_odd (low / high nibbles: even / odd columns)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_m = tl.arange(0, BM)
    mask_m = offs_m < M
    offs_c = tl.arange(0, BK // 4)
    offs_b = tl.arange(0, BK // 16)
    a_cols = a_ptr + offs_m.to(tl.int64)[None, :] * stride_am
    KS: tl.constexpr = K // SPLIT_K
    acc_t = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, KS, BK):
        kb = pid_k * KS + k0
        q = _load_rows(codes_ptr + rows[:, None] * stride_cn + (kb // 4 + offs_c)[None, :], mask_n,
                       EVEN_N)  # [BN, BK // 4] int16: codes kb + 4c .. kb + 4c + 3
        sb = _load_rows(ws_ptr + rows[:, None] * stride_sn + (kb // 16 + offs_b)[None, :], mask_n,
                        EVEN_N)  # [BN, BK // 16] scale bytes
        # each block scale onto its 4 code pairs (a broadcast in registers: no shuffle)
        s = tl.reshape(tl.broadcast_to(_scale_f16(sb, HW)[:, :, None], [BN, BK // 16, 4]), [BN, BK // 4])
        # activation words 2c and 2c + 1 hold the columns 4c, 4c + 1 and 4c + 2, 4c + 3
        x01 = tl.load(a_cols + (kb // 2 + 2 * offs_c)[:, None], mask=mask_m[None, :], other=0)
        x23 = tl.load(a_cols + (kb // 2 + 2 * offs_c + 1)[:, None], mask=mask_m[None, :], other=0)
        a0, a1 = _act_f16(x01, A_BF16)  # [BK // 4, BM]
        a2, a3 = _act_f16(x23, A_BF16)
        acc_t = tl.dot(_nibble_f16(q, 0, HW) * s, a0, acc_t)
        acc_t = tl.dot(_nibble_f16(q, 1, HW) * s, a1, acc_t)
        acc_t = tl.dot(_nibble_f16(q, 2, HW) * s, a2, acc_t)
        acc_t = tl.dot(_nibble_f16(q, 3, HW) * s, a3, acc_t)
    acc = tl.trans(acc_t) * 16384.0  # [BM, BN]; undoes W_SHIFT
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
        cfg.update(BN=32, BK=32, num_stages=1)
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


def launch(a, sa, codes, w_scale, block_scales, out, epilogue_id: int, cfg: dict) -> None:
    """out[:M] = the decode GEMM of a [M, K] (bf16 / fp16 values) and the packed weight."""
    m, k = a.shape
    n = codes.shape[0]
    bm, bn, bk, split = cfg["BM"], cfg["BN"], cfg["BK"], cfg["SPLIT_K"]
    if m > bm:
        raise ValueError(f"decode tile BM={bm} cannot hold M={m}")
    if k % (split * bk):
        raise ValueError(f"K={k} must be a multiple of SPLIT_K * BK = {split * bk}")
    a32 = a.view(torch.int32)  # [M, K // 2]: (even, odd) value pairs
    q16 = codes.view(torch.int16)  # [N, K // 4]: 4 codes each
    sb = block_scales.view(torch.uint8)
    tiles = triton.cdiv(n, bn)
    if split > 1:
        part = torch.empty(split, bm, n, dtype=torch.float32, device=a.device)
        counters = _split_counters(tiles, a.device)
    else:
        part = counters = out
    _w4a4_decode_kernel[(tiles, split)](
        a32, q16, sb, sa, w_scale, out, part, counters, m, n,
        a32.stride(0), q16.stride(0), sb.stride(0), out.stride(0), 0 if sa.numel() == 1 else 1,
        K=k, EPILOGUE=epilogue_id, A_BF16=a.dtype == torch.bfloat16, HW=not interpreted(), BM=bm, BN=bn,
        BK=bk, SPLIT_K=split, EVEN_N=n % bn == 0, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
