"""MoE grouped W4A4 GEMM in the decode regime: few rows per expert (a rollout's decode step), every
expert's weight read packed in the decode layout and dequantized in registers, one launch.

    out[t] = (a[t] @ w[e]^T) * (S_dec_x[t] * S_dec_w[e])    for rows t in [offsets[e], offsets[e + 1])

The main loop is the decode GEMM's (`decode_gemm.decode_acc`: C^T = W A^T, the weight the MMA's
register operand, rows padded to BM = 16, 32 or 64 (wgmma), one dot per K step) with no split-K. So
the columns come in plain order in k16 MMA steps, the aligned K order of `kernels.gemm`: rows get the
bits `grouped_gemm`'s aligned config gives them from the bf16 weight copy (GPU test, heavy-tailed
data), at 0.625 instead of 2 bytes per weight read.

Programs run over (N tile, row tile); row tiles cut each expert's rows into BM-row pieces
(`grouped_gemm.expert_tile`, no host sync), the grid sized by the upper bound cdiv(T, BM) + E, surplus
programs exit at once. With HALVES a row tile holding at most BM / 2 rows runs BM / 2-row MMAs: the
weight is dequantized once per BM rows of an expert, and short experts do not pay BM-row MMAs. The
tile is picked from the average rows per expert (`grouped_decode_config`); it partitions the
outputs only, never a row's sum. `decode_gemm_rows` runs one dense weight through the same kernel (one
expert owning all M rows, in BM-row tiles): a weight kept only packed, at any row count.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import interpreted
from minite.kernels.decode_gemm import KGROUP, TILE_N, W_SHIFT, DecodeWeight, decode_acc, layout_rows
from minite.kernels.epilogue import EPILOGUES, segment_bounds, segment_views, store_scaled, store_segments
from minite.kernels.grouped_gemm import expert_tile
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel

# (most average rows per expert, tile): benchmarks/ops/bench_grouped_decode.py's sweep on the H200 at
# Qwen3-30B-A3B expert shapes, 4 / 16 / 32 / 64 rows per expert (this layout, at c3a8c24): from 16 rows on, BN
# 128, BK 128 and 3 stages won at every count, by 16-40 % over BN 64 / BK 256 / 2 stages (gate|up at 32 rows:
# 124.1 vs 170.3 us); HALVES (a tile of BM rows whose rows fit in BM / 2 runs half-height MMAs:
# the weight dequantized once per BM rows, no BM-row MMAs for short experts). BK halves until it
# divides K. The BM 32 tile caps its registers at 128 a thread (162 uncapped: three programs an SM,
# ncu_grouped_decode_experts.txt), four programs an SM: at 16 rows per expert gate|up 91.2 vs 92.6 us
# and down 52.2 vs 54.9 (grouped_decode_regcap128.json, 02cb5eb); the kernel is not bound by
# occupancy (ncu: L2 78 % busy, DRAM 60 %, 0.56 instructions a cycle per scheduler).
GROUPED_DECODE_TILES = (
    (8, dict(BM=16, BN=64, BK=256, num_warps=4, num_stages=3)),
    (16, dict(BM=32, BN=128, BK=128, num_warps=4, num_stages=3, HALVES=True, maxnreg=128)),
    (None, dict(BM=64, BN=128, BK=128, num_warps=4, num_stages=3, HALVES=True)),
)
# Experts of K <= SHORT_K (the MoE down projection, K 768) skip the 16-row tile: its programs run 3 K
# steps each, the 32-row tile's hold twice the weight rows. H200, 4 / 8 rows per expert, two sweeps on
# two days (grouped_decode_regcap128.json at 02cb5eb, grouped_decode_persistent.json at fac99ba): down
# 46.9-47.0 / 48.4-48.7 us against 52.3 / 55.1-55.3; gate|up (K 2048) keeps the 16-row tile (78.6-79.0
# / 82.5-82.7 us against 80.0-80.3 / 83.4-83.7).
SHORT_K = 1024


# `decode_gemm_rows`' tile from 2048 rows, or from 512 on a weight of N >= 4096 rows: 128 rows, 8 warps
# (each row tile dequantizes the weight again; half as many tiles). benchmarks/ops/bench_decode_rows.py
# on the H200 (decode_rows.json, dfc674f): from 2048 rows 17-21 % faster than the 64-row tile on
# every shape; at 512 rows on q (N 4096) 19.7 vs 23.6 us and gate|up (N 12288) 56.0 vs 67.2 us, but
# slower on the narrow ones (o 33.3 vs 26.5 us).
WIDE_ROWS_TILE = dict(BM=128, BN=128, BK=128, num_warps=8, num_stages=3, HALVES=True)

# Below that, one weight's row tiles narrow while its grid holds few programs: BN 64 under NARROW_N
# programs, then BM 32 under NARROW_M. Each program runs the whole K chain (no split-K in the aligned
# order), so a grid of few programs is bound by the chain's latency, which more programs overlap.
# H200, benchmarks/ops/bench_decode_rows.py (decode_rows_regcap.json, e43d6cf), at 128-256 rows: the
# Qwen3-30B-A3B o projection 17.0 / 19.6 us against 25.9 / 26.0 on BM 64 / BN 128, k|v 9.8 against
# 14.7, the Qwen3-1.7B down 24.0 / 27.9 against 37.5 / 38.0; every other shape within 1 %.
NARROW_N, NARROW_M = 256, 128


def grouped_decode_config(rows: int, experts: int, k: int | None = None, n: int | None = None) -> dict:
    """The tile for `rows` sorted rows over `experts` experts (depends on the counts, never the data);
    one "expert" of N = `n` weight rows (`decode_gemm_rows`) takes `WIDE_ROWS_TILE` where it is faster,
    narrower tiles where its grid holds few programs (NARROW_N, NARROW_M)."""
    avg = rows / max(experts, 1)
    if experts == 1 and n is not None and (rows >= 2048 or rows >= 512 and n >= 4096):
        cfg = dict(WIDE_ROWS_TILE)
    else:
        short_k = experts > 1 and k is not None and k <= SHORT_K
        tiles = GROUPED_DECODE_TILES[1:] if short_k else GROUPED_DECODE_TILES
        cfg = dict(next(t for most, t in tiles if most is None or avg <= most))
        if experts == 1 and n is not None and cfg["BM"] == 64:
            if cdiv(n, cfg["BN"]) * cdiv(rows, cfg["BM"]) < NARROW_N:
                cfg["BN"] = 64
            if cdiv(n, cfg["BN"]) * cdiv(rows, cfg["BM"]) < NARROW_M:
                cfg["BM"] = 32
    if interpreted():
        cfg.update(BN=32, BK=64, num_stages=1)
    while k is not None and k % cfg["BK"]:
        cfg["BK"] //= 2
    return cfg


@triton.jit
def _row_tile(a_ptr, src_ptr, row0, row_end, w_rows, s_rows, offs_n, mask_n, sa_ptr, sw_ptr, e, out_ptr,
              stride_am, stride_om, stride_sa, N, N1, N2, K: tl.constexpr, TK: tl.constexpr,
              EPILOGUE: tl.constexpr, BF16: tl.constexpr, HW: tl.constexpr, W_SHIFT: tl.constexpr,
              ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_N: tl.constexpr,
              SEGMENTED: tl.constexpr, GATHER: tl.constexpr):
    """Rows row0 .. row0 + ROWS (those before row_end) of expert e times its N tile, stored
    (SEGMENTED: one expert whose rows are 2-3 weights, `epilogue.store_segments`; GATHER: output row
    r reads activation row src[r] and its scale)."""
    offs_m = row0 + tl.arange(0, ROWS)
    mask_m = offs_m < row_end
    if GATHER:
        src = tl.load(src_ptr + offs_m, mask=mask_m, other=0)
    else:
        src = offs_m
    # the columns in plain order (the aligned K order), no split-K
    a_rows = a_ptr + src.to(tl.int64) * stride_am
    acc_t = decode_acc(a_rows, mask_m, w_rows, s_rows, mask_n, 0, K, TK, BF16, HW, ROWS, BN, BK, EVEN_N)
    acc = tl.trans(acc_t) * W_SHIFT  # [ROWS, BN]
    if SEGMENTED:
        store_segments(acc, sa_ptr, tl.load(sw_ptr), tl.load(sw_ptr + 1), tl.load(sw_ptr + 2), out_ptr,
                       offs_m, offs_n, row_end, N, N1, N2, stride_sa, EPILOGUE)
    else:
        sa = tl.load(sa_ptr + src * stride_sa, mask=mask_m, other=1.0)
        store_scaled(acc, sa, tl.load(sw_ptr + e), out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                     EPILOGUE)


@triton.jit
def _grouped_decode_kernel(a_ptr, src_ptr, codes_ptr, ws_ptr, sa_ptr, sw_ptr, offsets_ptr, out_ptr, N, E,
                           stride_am, stride_ce, stride_se, stride_om, stride_sa, N1, N2,
                           K: tl.constexpr, TK: tl.constexpr, EPILOGUE: tl.constexpr, BF16: tl.constexpr,
                           HW: tl.constexpr, W_SHIFT: tl.constexpr, E_P2: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, EVEN_N: tl.constexpr, HALVES: tl.constexpr,
                           SEGMENTED: tl.constexpr, GATHER: tl.constexpr):
    pid_n = tl.program_id(0)
    e, row0, row_end = expert_tile(offsets_ptr, E, tl.program_id(1), BM, E_P2)
    if e >= E:
        return
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_n = offs_n < N
    w_rows, s_rows = layout_rows(codes_ptr + e.to(tl.int64) * stride_ce, ws_ptr + e.to(tl.int64) * stride_se,
                                 pid_n * BN, BN, K, TK)
    # HALVES: a tile whose rows fit in its first half runs the half-height MMAs (each expert's weight
    # is still dequantized once per BM rows)
    HM: tl.constexpr = BM // 2
    if HALVES and row_end - row0 <= HM:
        _row_tile(a_ptr, src_ptr, row0, row_end, w_rows, s_rows, offs_n, mask_n, sa_ptr, sw_ptr, e, out_ptr,
                  stride_am, stride_om, stride_sa, N, N1, N2, K, TK, EPILOGUE, BF16, HW, W_SHIFT, HM, BN, BK,
                  EVEN_N, SEGMENTED, GATHER)
    else:
        _row_tile(a_ptr, src_ptr, row0, row_end, w_rows, s_rows, offs_n, mask_n, sa_ptr, sw_ptr, e, out_ptr,
                  stride_am, stride_om, stride_sa, N, N1, N2, K, TK, EPILOGUE, BF16, HW, W_SHIFT, BM, BN, BK,
                  EVEN_N, SEGMENTED, GATHER)


def grouped_decode_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, w_scale: torch.Tensor,
                        offsets: torch.Tensor, epilogue: str = "sdec", out_dtype=torch.bfloat16,
                        config: dict | None = None, segments: tuple | None = None,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """a [T, K] e2m1 * s_b (the weight's operand dtype), rows sorted by expert; a_scale fp32 [T] (or
    one number); w the experts [E, N, K] in the decode layout (`decode_gemm.pack_weight`); w_scale
    fp32 [E]; offsets int [E + 1] from 0 to T, non-decreasing. -> [T, N]. config defaults to
    `grouped_decode_config(T, E, K, N)`; its BK must divide K and be a multiple of KGROUP. `segments`
    (N1, N2): one expert whose rows are 2-3 weights, w_scale their 3 factors, the flat outputs
    returned (`decode_rows_segments`). `rows` int [T]: sorted row r is a[rows[r]] (a and a_scale then
    hold the tokens, each read where an expert takes it: no gathered copy), T = rows.numel()."""
    if w.codes.ndim != 5:
        raise ValueError(f"w must hold experts [E, N, K] in the decode layout, got {tuple(w.shape)}")
    e, n, k = w.shape
    if a.ndim != 2 or a.shape[1] != k or a.dtype != w.scales.dtype or a.stride(1) != 1:
        raise ValueError(f"a must be [T, K={k}] in {w.scales.dtype} with unit stride along K, "
                         f"got {tuple(a.shape)} {a.dtype}")
    if a.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {a.device}")
    if rows is not None and (rows.ndim != 1 or rows.dtype not in (torch.int32, torch.int64) or segments):
        raise ValueError(f"rows must be int32/int64 [T] (and no segments), got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    t = a.shape[0] if rows is None else rows.numel()
    if a_scale.dtype != torch.float32 or a_scale.numel() not in (1, a.shape[0]):
        raise ValueError(f"a_scale must be fp32 with 1 or {a.shape[0]} elements (a's rows), got "
                         f"{tuple(a_scale.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.numel() != (3 if segments else e):
        raise ValueError(f"w_scale must be fp32 [{3 if segments else f'E={e}'}], got {w_scale.dtype} "
                         f"{tuple(w_scale.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64) or tuple(offsets.shape) != (e + 1,):
        raise ValueError(f"offsets must be int32/int64 [E + 1] = [{e + 1}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not supported; choose one of {list(EPILOGUES)}")
    cfg = config or grouped_decode_config(t, e, k, n)
    if k % cfg["BK"] or cfg["BK"] % KGROUP or cfg["BK"] > w.tk:
        raise ValueError(f"BK={cfg['BK']} must divide K={k}, be a multiple of {KGROUP} and at most the "
                         f"layout's tile width {w.tk}")
    out = torch.empty(t * n if segments else (t, n), dtype=out_dtype, device=a.device)
    sa = a_scale.reshape(-1)
    bm, bn = cfg["BM"], cfg["BN"]
    grid = (cdiv(n, bn), cdiv(t, bm) + e)
    launch_kernel(_grouped_decode_kernel, grid, (
        a, offsets if rows is None else rows, w.codes, w.scales, sa, w_scale.reshape(-1), offsets, out, n, e,
        a.stride(0), w.codes.stride(0), w.scales.stride(0), out.stride(0), 0 if sa.numel() == 1 else 1,
        *(segments or (0, 0))),
        K=k, TK=w.tk, EPILOGUE=EPILOGUES[epilogue], BF16=a.dtype == torch.bfloat16, HW=not interpreted(),
        W_SHIFT=W_SHIFT[a.dtype], E_P2=max(16, next_power_of_2(e)), BM=bm, BN=bn, BK=cfg["BK"],
        EVEN_N=w.n_pad % bn == 0, HALVES=cfg.get("HALVES", False), SEGMENTED=segments is not None,
        GATHER=rows is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **_register_cap(cfg))
    return out


def _register_cap(cfg: dict) -> dict:
    """The launch's `maxnreg` where the tile caps its registers per thread (more programs an SM)."""
    return {"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and not interpreted() else {}


_ROW_OFFSETS: dict = {}
CACHED_ROWS = 8192  # row counts up to this keep their offsets (decode batch widths); above, made per call


def _row_offsets(m: int, device) -> torch.Tensor:
    """int32 [0, m] on `device`. Up to CACHED_ROWS rows cached where made outside a CUDA graph capture
    (the sampler's warm-up makes them before capturing; never evicted, since a graph may hold them);
    otherwise made now (inside a capture: in the graph's own memory)."""
    key = (m, device)
    offsets = _ROW_OFFSETS.get(key)
    if offsets is None:
        offsets = torch.arange(2, dtype=torch.int32, device=device) * m
        capturing = offsets.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if m <= CACHED_ROWS and not capturing:
            _ROW_OFFSETS[key] = offsets
    return offsets


def decode_gemm_rows(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, w_scale: torch.Tensor,
                     epilogue: str = "sdec", out_dtype=torch.bfloat16,
                     config: dict | None = None) -> torch.Tensor:
    """a [M, K] (any M) times one weight [N, K] in the decode layout -> [M, N]: `grouped_decode_gemm`
    with a single expert (`config` its tile; default `grouped_decode_config(M, 1, K, N)`), so the
    rows run in BM-row tiles and get the aligned path's bits."""
    if w.codes.ndim != 4:
        raise ValueError(f"w must be one weight [N, K] in the decode layout, got {tuple(w.shape)}")
    experts = DecodeWeight(w.codes.unsqueeze(0), w.scales.unsqueeze(0), w.n)
    return grouped_decode_gemm(a, a_scale, experts, w_scale.reshape(1), _row_offsets(a.shape[0], a.device),
                               epilogue, out_dtype, config)


def decode_rows_segments(a: torch.Tensor, a_scale: torch.Tensor, w: DecodeWeight, w_scales: torch.Tensor,
                         widths: tuple[int, ...], epilogue: str = "sdec", out_dtype=torch.bfloat16,
                         config: dict | None = None) -> list[torch.Tensor]:
    """`decode_gemm_rows` of a against 2-3 weights concatenated along N in one decode layout (as
    `decode_gemm.decode_gemm_segments` takes them: widths multiples of TILE_N, w_scales fp32 [3]):
    each weight's output [M, width], contiguous views of one buffer, bitwise `decode_gemm_rows` of
    that weight alone."""
    if w.codes.ndim != 4:
        raise ValueError(f"w must be one weight [N, K] in the decode layout, got {tuple(w.shape)}")
    m = a.shape[0]
    bounds = segment_bounds(widths, w.shape[0], w_scales, m, TILE_N)
    experts = DecodeWeight(w.codes.unsqueeze(0), w.scales.unsqueeze(0), w.n)
    buf = grouped_decode_gemm(a, a_scale, experts, w_scales.reshape(-1), _row_offsets(m, a.device), epilogue,
                              out_dtype, config, bounds)
    return segment_views(buf, m, widths)
