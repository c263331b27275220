"""Triton MoE grouped W4A4 GEMM: one launch over all experts, tokens grouped (sorted) by expert.

    out[t] = (a[t] @ w[e]^T) * (S_dec_x[t] * S_dec_w[e])    for rows t in [offsets[e], offsets[e + 1])

with the same operands, fp32 accumulation and epilogues as `kernels.gemm` (whose docstring states the
numerics): `a` the unscaled activation values e2m1 * s_b, `w` each expert's unscaled weight copy or its
packed codes + E4M3 block scales. Each program finds its expert from the offsets in registers (a
cumulative sum of per-expert tile counts), so there is no host sync and no index tensor to build;
the grid is sized by the upper bound cdiv(T, BM) + E row tiles and surplus programs exit at once (the
large tile: one persistent program per SM walks the experts' tiles).
With the `aligned` config the tile shape and K order are those of `kernels.gemm`'s aligned path, so an
expert's rows get the bits a dense aligned GEMM with that expert's weight would give them.
"""

import torch
import triton
import triton.language as tl

from minite.kernels import gemm
from minite.kernels.epilogue import EPILOGUES, store_tile
from minite.kernels.gemm import tile_acc
from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel

CONFIGS = {
    # the dense aligned tiles' shapes and K order: an expert's rows get the bits of a dense aligned GEMM;
    # the large tile from ALIGNED_LARGE_ROWS_PER_EXPERT rows per expert on average (below that, nn
    # runs `grouped_decode` on the packed weights: this small tile serves K not a multiple of its chunk)
    "aligned": dict(BM=64, BN=128, BK=64, num_warps=8, num_stages=4),
    # the dense large tile, operands by TMA (`_grouped_tma_kernel`: the same K order), one persistent
    # program per SM, loop nest flattened: at 4096 / 16384 tokens 1.05-1.30x `torch._grouped_mm`,
    # against 0.79-1.08x with one program per tile (benchmarks/ops/bench_grouped_gemm.py --sweep, H200
    # at c239f20)
    "aligned_large": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, TMA=True, PERSIST=1,
                          FLATTEN=True),
    "prefill": dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=4, TMA=True, PERSIST=1, FLATTEN=True),
    "interpret": dict(BM=16, BN=32, BK=32, num_warps=4, num_stages=1),
}
ALIGNED_LARGE_ROWS_PER_EXPERT = 64  # H200 sweep: 32 rows/expert favour `aligned`, 256 `aligned_large`


@triton.jit
def expert_table(offsets_ptr, E, BM: tl.constexpr, E_P2: tl.constexpr):
    """The experts' row tiles, in registers: (experts, first rows, row ends, tiles of BM rows, their
    cumulative sum), E_P2 >= E entries."""
    experts = tl.arange(0, E_P2)
    start = tl.load(offsets_ptr + experts, mask=experts < E, other=0).to(tl.int32)
    end = tl.load(offsets_ptr + experts + 1, mask=experts < E, other=0).to(tl.int32)
    tiles = (end - start + BM - 1) // BM
    return experts, start, end, tiles, tl.cumsum(tiles, 0)


@triton.jit
def table_tile(experts, start, end, tiles, cum, pid_m, BM: tl.constexpr):
    """Row tile pid_m of an `expert_table` -> (expert, first row, end of the expert's rows); expert ==
    E past the last tile."""
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    here = experts == e
    first_tile = tl.sum(tl.where(here, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, start, 0), 0) + (pid_m - first_tile) * BM
    return e, row0, tl.sum(tl.where(here, end, 0), 0)


@triton.jit
def expert_tile(offsets_ptr, E, pid_m, BM: tl.constexpr, E_P2: tl.constexpr):
    """Row tile pid_m of the experts' tiles (each expert's rows cut into tiles of BM, experts in
    order) -> (expert, first row, end of the expert's rows); expert == E past the last tile."""
    experts, start, end, tiles, cum = expert_table(offsets_ptr, E, BM, E_P2)
    return table_tile(experts, start, end, tiles, cum, pid_m, BM)


@triton.jit
def _grouped_kernel(a_ptr, w_ptr, ws_ptr, sa_ptr, sw_ptr, offsets_ptr, out_ptr, N, E,
                    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_sa,
                    K: tl.constexpr, EPILOGUE: tl.constexpr, W_PACKED: tl.constexpr,
                    DOT_F16: tl.constexpr, E_P2: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BN)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    e, row0, row_end = expert_tile(offsets_ptr, E, pid_m, BM, E_P2)
    if e >= E:
        return
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_e = w_ptr + e.to(tl.int64) * stride_we
    ws_e = ws_ptr + e.to(tl.int64) * stride_wse
    acc = tile_acc(a_rows, w_e, ws_e, offs_n, mask_m, mask_n, stride_wn, stride_wsn, K, W_PACKED, DOT_F16,
                   BM, BN, BK)
    store_tile(acc, sa_ptr, tl.load(sw_ptr + e), out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
               stride_sa, EPILOGUE)


@triton.jit
def _grouped_tma_tile(a_desc, w_desc, sa_ptr, sw_ptr, out_ptr, e, row0, row_end, pid_n, N, stride_om,
                      stride_sa, K: tl.constexpr, EPILOGUE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
    """Output tile (row0, pid_n) of expert e: BK chunks in sequence (the dense K order), stored inside
    the expert's rows."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([row0, k0])
        w = w_desc.load([e * N + pid_n * BN, k0])
        acc = tl.dot(a, w.T, acc)
    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    store_tile(acc, sa_ptr, tl.load(sw_ptr + e), out_ptr, offs_m, offs_n, offs_m < row_end, offs_n < N,
               stride_om, stride_sa, EPILOGUE)


@triton.jit
def _grouped_tma_kernel(a_ptr, w_ptr, sa_ptr, sw_ptr, offsets_ptr, out_ptr, T, N, E, stride_am, stride_wn,
                        stride_om, stride_sa, programs, K: tl.constexpr, EPILOGUE: tl.constexpr,
                        E_P2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr):
    """`_grouped_kernel` on the bf16 weight copies [E * N, K] (rows of expert e at e * N) with the
    operands brought in by TMA: one output tile per program, or (PERSISTENT) the experts' tiles
    `programs` apart, the loop nest flattened (FLATTEN) so that the next tile's loads overlap this
    one's epilogue. A row tile may read rows of the next expert and an N tile rows of the next
    expert's weight (N % BN != 0): those outputs are masked, never stored; the K order is the dense
    one."""
    grid_n = tl.cdiv(N, BN)
    a_desc = tl.make_tensor_descriptor(a_ptr, [T, K], [stride_am, 1], [BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, [E * N, K], [stride_wn, 1], [BN, BK])
    if PERSISTENT:  # GPU only: the interpreter cannot take a run-time range() bound
        experts, start, end, tiles, cum = expert_table(offsets_ptr, E, BM, E_P2)
        for tile in tl.range(tl.program_id(0), tl.sum(tiles, 0) * grid_n, programs, flatten=FLATTEN):
            e, row0, row_end = table_tile(experts, start, end, tiles, cum, tile // grid_n, BM)
            _grouped_tma_tile(a_desc, w_desc, sa_ptr, sw_ptr, out_ptr, e, row0, row_end, tile % grid_n, N,
                              stride_om, stride_sa, K, EPILOGUE, BM, BN, BK)
    else:
        pid = tl.program_id(0)
        e, row0, row_end = expert_tile(offsets_ptr, E, pid // grid_n, BM, E_P2)
        if e < E:
            _grouped_tma_tile(a_desc, w_desc, sa_ptr, sw_ptr, out_ptr, e, row0, row_end, pid % grid_n, N,
                              stride_om, stride_sa, K, EPILOGUE, BM, BN, BK)


def grouped_w4a4_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      offsets: torch.Tensor, w_block_scales: torch.Tensor | None = None,
                      epilogue: str = "sdec", out_dtype=torch.bfloat16, config="prefill") -> torch.Tensor:
    """a [T, K] bf16/fp16 unscaled values, rows sorted by expert; a_scale fp32 [T] (or [T, 1], or one
    number); w [E, N, K] unscaled copies (a's dtype) or packed uint8 [E, N, K // 2] with
    w_block_scales float8_e4m3fn [E, N, K // 16]; w_scale fp32 [E]; offsets int [E + 1], offsets[0] = 0,
    offsets[E] = T, non-decreasing (expert e owns rows offsets[e] .. offsets[e + 1]). -> [T, N]."""
    from minite.kernels import interpreted

    packed = w.dtype == torch.uint8
    _check(a, a_scale, w, w_scale, offsets, w_block_scales, packed, epilogue)
    t, k = a.shape
    e, n = w.shape[0], w.shape[1]
    if isinstance(config, dict):
        cfg = config
    else:
        if config not in CONFIGS:
            raise ValueError(f"config={config!r} is not one of {list(CONFIGS)}")
        if config == "aligned" and t >= ALIGNED_LARGE_ROWS_PER_EXPERT * e:
            config = "aligned_large"
        cfg = CONFIGS["interpret" if interpreted() else config]
    if k % cfg["BK"]:
        raise ValueError(f"K={k} must be a multiple of the config's BK={cfg['BK']}")
    out = torch.empty(t, n, dtype=out_dtype, device=a.device)
    sa = a_scale.reshape(-1)
    ws = w_block_scales.view(torch.uint8) if packed else w
    grid = ((cdiv(t, cfg["BM"]) + e) * cdiv(n, cfg["BN"]),)
    if cfg.get("TMA") and not packed and w.stride(0) == n * w.stride(1) and gemm._tma_ok(a, w[0]):
        gemm._set_tma_allocator()
        programs = grid[0]
        if cfg.get("PERSIST") and not interpreted():
            programs = min(programs, cfg["PERSIST"] * gemm._sm_count(a.device.index))
        launch_kernel(_grouped_tma_kernel, (programs,), (
            a, w, sa, w_scale, offsets, out, t, n, e, a.stride(0), w.stride(1), out.stride(0),
            0 if sa.numel() == 1 else 1, programs), K=k, EPILOGUE=EPILOGUES[epilogue],
            E_P2=max(16, next_power_of_2(e)), BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
            PERSISTENT=programs < grid[0], FLATTEN=gemm.flatten(cfg, out), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        return out
    launch_kernel(_grouped_kernel, grid,
                  (a, w, ws, sa, w_scale, offsets, out, n, e, a.stride(0), w.stride(0), w.stride(1),
                   ws.stride(0), ws.stride(1), out.stride(0), 0 if sa.numel() == 1 else 1),
                  K=k, EPILOGUE=EPILOGUES[epilogue], W_PACKED=packed,
                  DOT_F16=a.dtype == torch.float16, E_P2=max(16, next_power_of_2(e)),
                  BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    return out


def _check(a, a_scale, w, w_scale, offsets, w_block_scales, packed, epilogue):
    from minite.kernels import interpreted

    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not supported; choose one of {list(EPILOGUES)}")
    if a.ndim != 2 or w.ndim != 3:
        raise ValueError(f"a must be [T, K] and w [E, N, K(/2)], got {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"a must hold bf16 or fp16 values e2m1 * s_b, got {a.dtype}")
    if a.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {a.device}")
    t, k = a.shape
    e = w.shape[0]
    if packed:
        if w.shape[2] * 2 != k:
            raise ValueError(f"packed w has {w.shape[2]} bytes per row; a has K={k} (needs K // 2)")
        if w_block_scales is None or w_block_scales.dtype != torch.float8_e4m3fn:
            raise TypeError("packed w needs w_block_scales as float8_e4m3fn [E, N, K // 16]")
        if tuple(w_block_scales.shape) != (e, w.shape[1], k // 16) or w_block_scales.stride(-1) != 1:
            raise ValueError(f"w_block_scales must be [E, N, K // 16] = {(e, w.shape[1], k // 16)}, got "
                             f"{tuple(w_block_scales.shape)}")
    elif w.dtype != a.dtype or w.shape[2] != k:
        raise ValueError(f"w must be [E, N, K={k}] in {a.dtype} (or packed uint8), got {tuple(w.shape)} "
                         f"{w.dtype}")
    if a.stride(1) != 1 or w.stride(2) != 1:
        raise ValueError("a and w need unit stride along K (call .contiguous())")
    if offsets.dtype not in (torch.int32, torch.int64) or tuple(offsets.shape) != (e + 1,):
        raise ValueError(f"offsets must be int32/int64 [E + 1] = [{e + 1}], got {offsets.dtype} "
                         f"{tuple(offsets.shape)}")
    if a_scale.dtype != torch.float32 or a_scale.numel() not in (1, t):
        raise ValueError(f"a_scale must be fp32 with 1 or T={t} elements, got {tuple(a_scale.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.numel() != e:
        raise ValueError(f"w_scale must be fp32 [E={e}], got {w_scale.dtype} {tuple(w_scale.shape)}")
