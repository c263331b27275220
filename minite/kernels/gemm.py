"""Triton W4A4 GEMM: out = (a @ w^T) * scale, the kernel counterpart of `minite.ref.gemm`.

Operands are the exact unscaled values e2m1 * s_b (bf16 on the GPU, fp16 in the CPU interpreter):
the activation from `kernels.nvfp4.quantize_unscaled`, the weight either as its dequantized copy
[N, K] (refreshed once per update; compute-bound regime) or packed (codes uint8 [N, K // 2] + E4M3
block scales [N, K // 16]) and dequantized in registers (decode regime). Products and 16-term sums
are exact, the tensor-core accumulation is fp32, and the global scales are applied in the fp32
epilogue exactly as the reference does (`sdec`: acc * (S_dec_x[m] * S_dec_w); `alpha`:
acc * ((amax_x[m] * amax_w) * fl32(1/7225344)); `bf16_scalar`: bf16(acc) * bf16(S_dec_x * S_dec_w)).

Configurations (CONFIGS, fixed; no autotuning):
- `aligned`: one K order for every M and both weight representations (BK = 64 chunks, each a sequence
  of k16 tensor-core steps, no split-K), so an output row never depends on M, on the other rows, or
  on whether the weight was packed: the batch-invariant path. The tile's M x N shape only partitions
  the outputs, so it is picked by M and the grid (`aligned` below ALIGNED_WAVE_M rows,
  `aligned_wave` / `aligned_waves` up to ALIGNED_LARGE_M, `aligned_large` from there); the GPU tests
  and the tile sweep (benchmarks/tools/sweep_gemm_tiles.py: 44 tiles, one set of bits) check that
  rows keep their bits across it. `aligned_large` brings the operands in by TMA in a
  persistent kernel (`_w4a4_tma_kernel`), the same K order (the TMA sweep checks the bits).
- `prefill`: the fastest tile for large M (dequantized weight copy); today the same as `aligned_large`.
- `decode`: small M (<= 64), packed weights, its own kernel (`kernels.decode_gemm`): the weight,
  repacked into a decode layout (once per update by the nn layers; on every call here), is
  dequantized by inline PTX into the MMA's register operand (C^T = W A^T, M padded to 8..64), with a
  deterministic split-K where N alone does not fill the GPU. Its K order depends on (N, K) and the
  tile, never on M within one padded size, but it is not the aligned order: its bits equal the
  aligned path's wherever the fp32 accumulation is exact (nearly all outputs, docs/facts.md).
"""

import functools

import torch
import triton
import triton.language as tl

from minite.kernels import decode_gemm, interpreted
from minite.kernels.epilogue import EPILOGUES, segment_bounds, segment_views, store_segments, store_tile
from minite.kernels.launch import cdiv
from minite.kernels.launch import launch as launch_kernel

CONFIGS = {
    # M < ALIGNED_LARGE_M (the rollout's decode steps): operands by TMA, one program per tile; at
    # M = 512 on the rollout shapes 5-35 % less time than on pointer loads (8 warps), the same bits
    # (benchmarks/tools/sweep_gemm_tma.py, CUDA graphs; benchmarks/results/h200/sweep_gemm_tma.json)
    "aligned": dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=4, TMA=True, PERSIST=0),
    # ALIGNED_WAVE_M <= M < ALIGNED_LARGE_M (a rollout's decode steps at 512 sequences): where the
    # `aligned` grid fits one wave (a program an SM), 6 stages; where it holds more, 128 x 128 tiles of
    # 8 warps, one persistent program an SM. Qwen3-1.7B at M = 512 on the H100, CUDA graphs: o 11.6 /
    # q|k|v 17.0 / gate|up 45.7 / down 26.9 us against 13.7 / 19.5 / 68.7 / 34.1 on `aligned` (cuBLAS
    # 10.7 / 14.0 / 37.1 / 26.9), the same bits (benchmarks/results/h100/gemm512_tiles_*.json)
    "aligned_wave": dict(BM=64, BN=128, BK=64, GROUP_M=8, num_warps=4, num_stages=6, TMA=True, PERSIST=0),
    "aligned_waves": dict(BM=128, BN=128, BK=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=True, PERSIST=1,
                          FLATTEN=True),
    # M >= ALIGNED_LARGE_M: operands by TMA, one persistent program per SM (`_w4a4_tma_kernel`):
    # 0.92-1.02x cuBLAS at Qwen3-8B shapes, M 4096-16384, where the same tile on pointer loads ran
    # 0.78-0.89x (benchmarks/results/h200/sweep_gemm_tma.json; the same bits at every shape)
    "aligned_large": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, PERSIST=1,
                          FLATTEN=True),
    "prefill": dict(BM=128, BN=256, BK=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, PERSIST=1,
                    FLATTEN=True),
    # packed weights, M <= 64: `decode_config(m, n, k)` picks the tile; this entry serves the
    # dequantized weight copy with config="decode" (BM: M padded to 16, 32 or 64)
    "decode": dict(BN=32, BK=256, GROUP_M=1, num_warps=4, num_stages=4),
    # the CPU interpreter: small tiles, any M
    "interpret": dict(BM=16, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=1),
}
ALIGNED_LARGE_M = 2048
ALIGNED_WAVE_M = 512


@triton.jit
def _e2m1_to_float(c, DOT_F16: tl.constexpr):
    """Unpacked E2M1 codes (integers 0..15) -> fp16 / bf16 values, built from their bits."""
    c = c.to(tl.uint16)
    mag = c & 7
    # one return: Triton types every return of a function alike, constexpr branches included
    if DOT_F16:
        bits = tl.where(mag >= 2, (mag << 9) + 0x3800, mag * 0x3800) | ((c & 8) << 12)
        out = bits.to(tl.float16, bitcast=True)
    else:
        bits = tl.where(mag >= 2, (mag << 6) + 0x3F00, mag * 0x3F00) | ((c & 8) << 12)
        out = bits.to(tl.bfloat16, bitcast=True)
    return out


@triton.jit
def _e4m3_to_float(b):
    """Unsigned E4M3 bytes -> fp32 values (exact)."""
    b = b.to(tl.int32)
    normal = ((b << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where(b < 8, (b & 7).to(tl.float32) * 0.001953125, normal)


@triton.jit
def packed_w_tile(codes_ptr, scales_ptr, offs_n, mask_n, k0, stride_cn, stride_sn,
                  BN: tl.constexpr, BK: tl.constexpr, DOT_F16: tl.constexpr):
    """Rows offs_n, columns k0 .. k0 + BK of a packed NVFP4 weight -> [BN, BK] e2m1 * s_b."""
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    p = tl.load(codes_ptr + offs_n.to(tl.int64)[:, None] * stride_cn + offs_b[None, :],
                mask=mask_n[:, None], other=0)  # [BN, BK // 2] uint8
    v = tl.reshape(tl.join(_e2m1_to_float(p & 15, DOT_F16), _e2m1_to_float(p >> 4, DOT_F16)), [BN, BK])
    offs_s = k0 // 16 + tl.arange(0, BK // 16)
    sb = tl.load(scales_ptr + offs_n.to(tl.int64)[:, None] * stride_sn + offs_s[None, :],
                 mask=mask_n[:, None], other=0)  # [BN, BK // 16] e4m3 bytes
    sb = _e4m3_to_float(sb).to(v.dtype)
    return tl.reshape(tl.reshape(v, [BN, BK // 16, 16]) * sb[:, :, None], [BN, BK])


@triton.jit
def tile_acc(a_rows, w_ptr, ws_ptr, offs_n, mask_m, mask_n, stride_wn, stride_wsn, K: tl.constexpr,
             W_PACKED: tl.constexpr, DOT_F16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr):
    """fp32 acc [BM, BN] = a rows (pointers `a_rows` [BM, 1]) x weight rows offs_n (unscaled copy, or
    packed codes + scales), over K in BK steps: the K order of every non-decode tile, dense and grouped."""
    offs_k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=mask_m[:, None], other=0.0)
        if W_PACKED:
            w = packed_w_tile(w_ptr, ws_ptr, offs_n, mask_n, k0, stride_wn, stride_wsn, BN, BK, DOT_F16)
        else:
            w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k0 + offs_k)[None, :],
                        mask=mask_n[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _tile_mn(tile, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile number -> (row tile, column tile), GROUP_M row tiles at a time (L2 reuse of w)."""
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * grid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _tma_tile(a_desc, w_desc, sa_ptr, sw, sw1, sw2, out_ptr, tile, M, N, stride_om, stride_sa, N1, N2,
              K: tl.constexpr, EPILOGUE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP_M: tl.constexpr, SEGMENTED: tl.constexpr):
    """One output tile of the TMA kernel, stored (SEGMENTED: sw, sw1, sw2 the three weights' scales)."""
    pid_m, pid_n = _tile_mn(tile, M, N, BM, BN, GROUP_M)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = a_desc.load([pid_m * BM, k0])
        w = w_desc.load([pid_n * BN, k0])
        acc = tl.dot(a, w.T, acc)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    _store(acc, sa_ptr, sw, sw1, sw2, out_ptr, offs_m, offs_n, M, N, N1, N2, stride_om, stride_sa, EPILOGUE,
           SEGMENTED)


@triton.jit
def _store(acc, sa_ptr, sw, sw1, sw2, out_ptr, offs_m, offs_n, M, N, N1, N2, stride_om, stride_sa,
           EPILOGUE: tl.constexpr, SEGMENTED: tl.constexpr):
    if SEGMENTED:
        store_segments(acc, sa_ptr, sw, sw1, sw2, out_ptr, offs_m, offs_n, M, N, N1, N2, stride_sa, EPILOGUE)
    else:
        store_tile(acc, sa_ptr, sw, out_ptr, offs_m, offs_n, offs_m < M, offs_n < N, stride_om, stride_sa,
                   EPILOGUE)


@triton.jit
def _w4a4_tma_kernel(a_ptr, w_ptr, sa_ptr, sw_ptr, out_ptr, M, N, stride_am, stride_wn, stride_om, stride_sa,
                     programs, N1, N2, K: tl.constexpr, EPILOGUE: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
                     FLATTEN: tl.constexpr, SEGMENTED: tl.constexpr):
    """`_w4a4_kernel` on the bf16 weight copy with the operands brought in by TMA: one output tile per
    program, or (PERSISTENT) tiles `programs` apart. The same K order: BK chunks in sequence, each a
    chain of k16 MMAs. The tensor descriptors are made here on the device (host-made ones cost 30-50 us
    more host time a launch than pointer loads, H200 at 4cf215c). SEGMENTED: w is several weights concatenated
    along N (`gemm_segments`), with their own scales and outputs (`epilogue.store_segments`)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BN, BK])
    sw = tl.load(sw_ptr)
    sw1, sw2 = sw, sw
    if SEGMENTED:  # the three weights' scales
        sw1 = tl.load(sw_ptr + 1)
        sw2 = tl.load(sw_ptr + 2)
    if PERSISTENT:  # GPU only: the interpreter cannot take a run-time range() bound
        tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
        for tile in tl.range(tl.program_id(0), tiles, programs, flatten=FLATTEN):
            _tma_tile(a_desc, w_desc, sa_ptr, sw, sw1, sw2, out_ptr, tile, M, N, stride_om, stride_sa, N1, N2,
                      K, EPILOGUE, BM, BN, BK, GROUP_M, SEGMENTED)
    else:
        _tma_tile(a_desc, w_desc, sa_ptr, sw, sw1, sw2, out_ptr, tl.program_id(0), M, N, stride_om, stride_sa,
                  N1, N2, K, EPILOGUE, BM, BN, BK, GROUP_M, SEGMENTED)


@triton.jit
def _w4a4_kernel(a_ptr, w_ptr, ws_ptr, sa_ptr, sw_ptr, out_ptr, M, N,
                 stride_am, stride_wn, stride_wsn, stride_om, stride_sa, N1, N2,
                 K: tl.constexpr, EPILOGUE: tl.constexpr, W_PACKED: tl.constexpr, DOT_F16: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 SEGMENTED: tl.constexpr):
    pid_m, pid_n = _tile_mn(tl.program_id(0), M, N, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    acc = tile_acc(a_rows, w_ptr, ws_ptr, offs_n, mask_m, mask_n, stride_wn, stride_wsn, K, W_PACKED, DOT_F16,
                   BM, BN, BK)
    sw = tl.load(sw_ptr)
    sw1, sw2 = sw, sw
    if SEGMENTED:
        sw1 = tl.load(sw_ptr + 1)
        sw2 = tl.load(sw_ptr + 2)
    _store(acc, sa_ptr, sw, sw1, sw2, out_ptr, offs_m, offs_n, M, N, N1, N2, stride_om, stride_sa, EPILOGUE,
           SEGMENTED)


def pick_config(config, m: int, n: int, k: int | None = None, packed: bool = False) -> dict:
    """A CONFIGS name (or a dict) -> the tile dict used for this (M, N); `decode` and `aligned` look at
    M. With packed weights (and K given), `decode` selects the decode kernel's tile (`decode_config`)."""
    if isinstance(config, dict):
        return config
    if config not in CONFIGS:
        raise ValueError(f"config={config!r} is not one of {list(CONFIGS)}")
    if config == "decode" and m > 64:
        raise ValueError(f"the decode config serves M <= 64, got M={m}; use 'aligned' or 'prefill'")
    if config == "decode" and packed and k is not None:
        return decode_gemm.decode_config(m, n, k)
    if interpreted():
        return CONFIGS["interpret"]
    if config == "aligned" and m >= ALIGNED_LARGE_M:
        config = "aligned_large"
    elif config == "aligned" and m >= ALIGNED_WAVE_M:
        one_wave = cdiv(m, CONFIGS["aligned"]["BM"]) * cdiv(n, CONFIGS["aligned"]["BN"]) <= _sm_count(
            torch.cuda.current_device() if torch.cuda.is_available() else None)
        config = "aligned_wave" if one_wave else "aligned_waves"
    cfg = dict(CONFIGS[config])
    if config == "decode":
        cfg["BM"] = 16 if m <= 16 else (32 if m <= 32 else 64)
    return cfg


def w4a4_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              w_block_scales: torch.Tensor | None = None, epilogue: str = "sdec",
              out_dtype=torch.bfloat16, config="aligned") -> torch.Tensor:
    """a [M, K] bf16/fp16 (e2m1 * s_b, unscaled), a_scale fp32 [M], [M, 1] or [] (S_dec_x, or amax_x
    for epilogue="alpha"); w either the unscaled copy [N, K] (same dtype as a) or packed codes uint8
    [N, K // 2] with w_block_scales float8_e4m3fn [N, K // 16]; w_scale fp32 [] (S_dec_w or amax_w).
    Returns out [M, N] in out_dtype."""
    packed = w.dtype == torch.uint8
    _check(a, a_scale, w, w_scale, w_block_scales, packed, epilogue)
    m, k = a.shape
    n = w.shape[0]
    cfg = pick_config(config, m, n, k, packed)
    if cfg.get("kernel") == "decode":
        if not packed:
            raise ValueError("the decode kernel reads packed weights (uint8 codes + w_block_scales)")
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
        # packed into the decode layout on every call here (the nn layers keep it with the weight)
        dw = decode_gemm.pack_weight(w, w_block_scales, a.dtype)
        decode_gemm.launch(a, a_scale.reshape(-1), dw, w_scale, out, EPILOGUES[epilogue], cfg)
        return out
    if k % cfg["BK"]:
        raise ValueError(f"K={k} must be a multiple of the config's BK={cfg['BK']}")
    if not packed:
        return gemm_on_copy(a, a_scale.reshape(-1), w, w_scale, epilogue, out_dtype, cfg)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    _launch_pointer(a, w, w_block_scales.view(torch.uint8), a_scale.reshape(-1), w_scale, out, epilogue, cfg)
    return out


def gemm_on_copy(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, epilogue: str,
                 out_dtype, cfg: dict) -> torch.Tensor:
    """`w4a4_gemm` on the weight's unscaled copy w [N, K] without its checks (callers that built the
    operands: `minite.nn`): sa fp32 [M] or [1], cfg from `pick_config`."""
    m, k = a.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if cfg.get("TMA") and _tma_ok(a, w):
        _launch_tma(a, sa, w, w_scale, out, epilogue, cfg, cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"]))
    else:
        _launch_pointer(a, w, w, sa, w_scale, out, epilogue, cfg)
    return out


def gemm_segments(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor,
                  widths: tuple[int, ...], epilogue: str, out_dtype, cfg: dict) -> list[torch.Tensor]:
    """`gemm_on_copy` of a against 2 or 3 weights at once: w [N, K] their unscaled copies concatenated
    along N (`widths` rows each), w_scales fp32 [3] their scales (the last repeated for 2 weights).
    Returns each weight's output [M, width], contiguous (views of one buffer), bitwise what
    `gemm_on_copy` gives for that weight alone (the same K order per element, the same epilogue
    operations): one launch instead of one per weight, for the projections that read the same input."""
    m = a.shape[0]
    n = w.shape[0]
    bounds = segment_bounds(widths, n, w_scales, m)
    buf = torch.empty(m * n, dtype=out_dtype, device=a.device)
    if cfg.get("TMA") and _tma_ok(a, w):
        _launch_tma(a, sa, w, w_scales, buf, epilogue, cfg, cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"]), bounds)
    else:
        _launch_pointer(a, w, w, sa, w_scales, buf, epilogue, cfg, bounds)
    return segment_views(buf, m, widths)


def _launch_pointer(a, w, ws, sa, w_scale, out, epilogue, cfg, bounds=None) -> None:
    """The pointer-load kernel: w the unscaled copy (ws = w) or packed codes with block scales ws;
    `bounds` (N1, N2): w is weights concatenated along N (`gemm_segments`), out their flat outputs."""
    m, k = a.shape
    n = w.shape[0]
    packed = w.dtype == torch.uint8
    n1, n2 = bounds or (0, 0)
    launch_kernel(_w4a4_kernel, (cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"]),),
                  (a, w, ws, sa, w_scale, out, m, n, a.stride(0), w.stride(0), ws.stride(0), out.stride(0),
                   0 if sa.numel() == 1 else 1, n1, n2),
                  K=k, EPILOGUE=EPILOGUES[epilogue], W_PACKED=packed,
                  DOT_F16=a.dtype == torch.float16, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                  GROUP_M=cfg["GROUP_M"], SEGMENTED=bounds is not None, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])


def _tma_ok(a, w) -> bool:
    """TMA descriptors need 16-byte aligned bases and row strides (else the pointer kernel runs)."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (a, w))


def _launch_tma(a, sa, w, w_scale, out, epilogue, cfg, tiles, bounds=None):
    """The TMA kernel: PERSIST programs per SM (0: one program per tile); `bounds` as for
    `_launch_pointer`."""
    _set_tma_allocator()
    m, k = a.shape
    programs = tiles
    if cfg.get("PERSIST"):
        programs = min(tiles, cfg["PERSIST"] * _sm_count(a.device.index if a.is_cuda else None))
    n1, n2 = bounds or (0, 0)
    launch_kernel(_w4a4_tma_kernel, (programs,),
                  (a, w, sa, w_scale, out, m, w.shape[0], a.stride(0), w.stride(0), out.stride(0),
                   0 if sa.numel() == 1 else 1, programs, n1, n2),
                  K=k, EPILOGUE=EPILOGUES[epilogue], BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                  GROUP_M=cfg["GROUP_M"], PERSISTENT=programs < tiles, FLATTEN=flatten(cfg, out),
                  SEGMENTED=bounds is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def flatten(cfg: dict, out: torch.Tensor) -> bool:
    """The config's FLATTEN, off for 4-byte outputs: flattened, the epilogue's layout conversion takes
    shared memory of its own beside the stages (278 KB at 128 x 256 with 3 stages, fp32 out: more than
    the H200's 227 KB; 180 KB for bf16)."""
    return bool(cfg.get("FLATTEN")) and out.element_size() <= 2


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if index is not None else 4


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def _set_tma_allocator() -> None:
    """Device-made tensor descriptors live in a per-launch scratch buffer that Triton asks for through
    its allocator (a torch allocation here, so CUDA-graph capture works). Triton keeps the allocator in
    a ContextVar (per thread): ours is set where none is, a caller's own is left alone."""
    from triton.runtime import _allocation

    null = getattr(_allocation, "NullAllocator", None)
    current = getattr(_allocation, "_allocator", None)
    if null is None or current is None or isinstance(current.get(), null):
        triton.set_allocator(_torch_scratch)


def operand_dtype(device) -> torch.dtype:
    """bf16 on the GPU; fp16 in the CPU interpreter (bf16 tl.dot is broken there, docs/facts.md)."""
    return torch.float16 if torch.device(device).type == "cpu" else torch.bfloat16


def nvfp4_gemm(xq, wq, epilogue: str = "sdec", out_dtype=torch.float32, config="aligned") -> torch.Tensor:
    """`ref.gemm.nvfp4_gemm` run by the kernel: x_q [..., M, K] (any scaling), w_q [N, K] (tensor or
    static scaling, read packed) -> [..., M, N]."""
    if wq.global_scale.numel() != 1:
        raise ValueError("the weight operand needs one global scale (scaling='tensor' or 'static')")
    if xq.padded_shape[-1] != wq.padded_shape[-1]:
        raise ValueError(f"K mismatch: x has {xq.shape[-1]}, w has {wq.shape[-1]}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not supported; choose one of {list(EPILOGUES)}")
    a = xq.unscaled()
    if xq.block == (16, 16):
        a = a[..., : xq.shape[-2], :]
    lead = a.shape[:-1]
    a = a.reshape(-1, a.shape[-1]).to(operand_dtype(a.device))
    use_amax = epilogue == "alpha"
    sa = (xq.amax if use_amax else xq.global_scale).float()
    sa = sa.expand(*lead, 1).reshape(-1) if sa.numel() > 1 else sa.reshape(())
    sw = (wq.amax if use_amax else wq.global_scale).float().reshape(())
    n = wq.shape[0]
    out = w4a4_gemm(a, sa, wq.codes[:n], sw, wq.block_scales[:n], epilogue, out_dtype, config)
    return out.reshape(*lead, n)


def unscaled_copy(wq, dtype=None) -> torch.Tensor:
    """The dequantized weight copy e2m1 * s_b [N, K] (exact in bf16 / fp16) for the compute-bound GEMM."""
    dtype = dtype or operand_dtype(wq.codes.device)
    return wq.unscaled()[: wq.shape[0]].to(dtype)


def _check(a, a_scale, w, w_scale, w_block_scales, packed, epilogue):
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not supported; choose one of {list(EPILOGUES)}")
    if a.ndim != 2 or w.ndim != 2:
        raise ValueError(f"a and w must be 2-D, got shapes {tuple(a.shape)} and {tuple(w.shape)}")
    if a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"a must hold bf16 or fp16 values e2m1 * s_b, got {a.dtype}")
    if a.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1); got {a.device}")
    k = a.shape[1]
    if packed:
        if w.shape[1] * 2 != k:
            raise ValueError(f"packed w has {w.shape[1]} bytes per row; a has K={k} (needs K // 2)")
        if w_block_scales is None or w_block_scales.dtype != torch.float8_e4m3fn:
            raise TypeError("packed w needs w_block_scales as float8_e4m3fn [N, K // 16]")
        if tuple(w_block_scales.shape) != (w.shape[0], k // 16) or w_block_scales.stride(-1) != 1:
            raise ValueError(f"w_block_scales must be [N, K // 16] = {(w.shape[0], k // 16)} with unit "
                             f"stride along K, got {tuple(w_block_scales.shape)}")
    elif w.dtype != a.dtype or w.shape[1] != k:
        raise ValueError(f"w must be [N, K={k}] in {a.dtype} (or packed uint8), got {tuple(w.shape)} "
                         f"{w.dtype}")
    if a.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("a and w need unit stride along K (call .contiguous())")
    if a_scale.dtype != torch.float32 or a_scale.numel() not in (1, a.shape[0]):
        raise ValueError(f"a_scale must be fp32 with 1 or M={a.shape[0]} elements, got "
                         f"{a_scale.dtype} {tuple(a_scale.shape)}")
    if a_scale.numel() > 1 and a_scale.reshape(-1).stride(0) != 1:
        raise ValueError("a_scale must be contiguous")
    if w_scale.dtype != torch.float32 or w_scale.numel() != 1:
        raise ValueError(f"w_scale must be one fp32 number, got {w_scale.dtype} {tuple(w_scale.shape)}")
