"""Triton NVFP4 quantizer, bitwise equal to `minite.ref.nvfp4` for RNE (codes, block scales, S_dec).

Every fp32 step is the reference's, in its order, with IEEE division (`tl.div_rn`), and no step is a
multiply-add that fp-fusion could contract. E4M3 rounding is the GPU's cvt.rn.satfinite (HW=True; the
GPU tests check its bits) or, in the CPU interpreter, done on the fp32 bits (RNE to 3 mantissa bits
for normals; `(u + 2^23) - 2^23` for the subnormal range). E2M1 rounding is `_e2m1_rint` (fmas and
mins, equal to the reference's thresholds). bf16/fp16 inputs with 1x16 blocks and RNE take the pair
kernel (`pairs.py`), about twice as fast, same bits. Tensor and static scaling get their
global scales from the reference's own `global_scales` (torch, a handful of scalars); row scaling
computes them in the kernel (pass 1: row amax; pass 2: quantize). The RHT, when asked for, is the
reference's `apply_rht` (TE's transform, rounded to the input dtype) applied first, so RHT outputs
match too. Stochastic rounding uses Triton's Philox stream: matched in distribution, not bitwise.

`quantize_unscaled` is the fused activation form of the compute-bound GEMM: row amax -> codes ->
the exact values e2m1 * s_b (bf16 or fp16) and the fp32 row decode scales, in one pass.

Non-finite input: the kernels never raise (that would need a host sync); with row scaling a row
holding inf or NaN gets S_dec = amax = NaN, so whatever multiplies by its scale becomes NaN.
"""

import torch
import triton
import triton.language as tl

from minite.kernels.launch import cdiv, next_power_of_2
from minite.kernels.launch import launch as launch_kernel
from minite.kernels.nvfp4.blocks import (  # noqa: F401  (the building blocks are the package's names too)
    CHAIN_IDS,
    FLT_MAX,
    _block_scales,
    _e2m1_rint,
    _e2m1_rne,
    _e2m1_value,
    _emit_chunk,
    _given_scales,
    _global_scales,
    _max_nan,
    _quantize_chunk,
    _row_scales,
    _to_e4m3,
)
from minite.nvfp4_format import NVFP4Tensor, check_quantize_args, pad_to_blocks, require_finite
from minite.ref import nvfp4 as ref
from minite.ref.hadamard import apply_rht

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

CONFIGS = {
    # elements per program (rows x K chunk); K chunk a power of two; row scaling reads x once when
    # K <= MAX_K (the whole row in registers), else twice (amax pass, then quantize pass)
    # (measured on the H200: whole 4096-wide rows in registers, 8 warps, ran at 1.0 TB/s; 4 rows x
    # 1024-wide chunks, 4 warps, two passes, at 1.6 TB/s)
    "1x16": dict(ELEMS=4096, MAX_K=1024, CHUNK_K=1024, num_warps=4),
    "16x16": dict(BLOCK_R=16, BLOCK_K=256, num_warps=4),
    "amax": dict(BLOCK=8192, num_warps=8),
}


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, vals_ptr, sdec_out_ptr, amax_out_ptr, gs_ptr,
                     R, stride_xr, seed, rows_per_gs, K: tl.constexpr,
                     GS: tl.constexpr, CHAIN: tl.constexpr, TILE16: tl.constexpr,
                     STOCHASTIC: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr,
                     HW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """GS: 0 = row scaling (row amax here), 1 = tensor scaling (amax at gs_ptr), 2 = given
    (S_enc, S_dec) at gs_ptr (static); 3, 4: 1, 2 with per-row scale outputs (`_given_scales`). One
    pass over x when K <= BLOCK_K, else two for row scaling."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xr
    if GS == 0:
        if K <= BLOCK_K:
            cols = tl.arange(0, BLOCK_K)
            m = row_ok[:, None] & (cols < K)[None, :]
            x_all = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            amax = tl.reduce(tl.abs(x_all), 1, _max_nan)
        else:
            amax = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                m = row_ok[:, None] & (cols < K)[None, :]
                x = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
                amax = _max_nan(amax, tl.reduce(tl.abs(x), 1, _max_nan))
        s_enc, s_dec = _row_scales(amax, rows, row_ok, sdec_out_ptr, amax_out_ptr, CHAIN)
    else:
        s_enc, s_dec = _given_scales(gs_ptr, rows, row_ok, sdec_out_ptr, amax_out_ptr, rows_per_gs, GS, CHAIN,
                                     BLOCK_R)
    if GS == 0 and K <= BLOCK_K:
        _emit_chunk(x_all, s_enc, s_dec, rows, row_ok, 0, seed, codes_ptr, scales_ptr, vals_ptr, K, CHAIN,
                    TILE16, STOCHASTIC, WRITE_CODES, WRITE_VALUES, HW, BLOCK_R, BLOCK_K)
    else:
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            m = row_ok[:, None] & (cols < K)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=m, other=0.0).to(tl.float32)
            _emit_chunk(x, s_enc, s_dec, rows, row_ok, k0, seed, codes_ptr, scales_ptr, vals_ptr, K,
                        CHAIN, TILE16, STOCHASTIC, WRITE_CODES, WRITE_VALUES, HW, BLOCK_R, BLOCK_K)


@triton.jit
def _amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.reduce(tl.abs(x), 0, _max_nan))  # inf or NaN in x: amax inf or NaN


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the whole (contiguous) tensor: fp32 []."""
    _check_device(x)
    flat = x.contiguous().reshape(-1)
    cfg = CONFIGS["amax"]
    n_prog = cdiv(flat.numel(), cfg["BLOCK"])
    partial = torch.empty(n_prog, dtype=torch.float32, device=x.device)
    _amax_kernel[(n_prog,)](flat, partial, flat.numel(), BLOCK=cfg["BLOCK"], num_warps=cfg["num_warps"])
    return partial.amax()


def quantize_packed(x: torch.Tensor, scaling: str = "tensor", block=(1, 16), rounding: str = "rne",
                    chain: str = "te", static_scale=None, hadamard: bool = False, generator=None):
    """The kernel counterpart of `ref.quantize_ref` on validated, padded x [..., R, K] (K % 16 == 0;
    R % 16 == 0 for 16x16 blocks), returning *packed* codes: (codes uint8 [..., K // 2], block scales
    e4m3 [..., K // 16], S_dec, amax), S_dec and amax fp32 [] (tensor, static) or [..., R, 1] (row).
    With rounding="stochastic", the Philox seed is drawn from `generator` (torch's default if None)."""
    block = tuple(block)
    _check_device(x)
    _check_input(x, block)
    xf = apply_rht(x) if hadamard else x
    lead, k = xf.shape[:-1], xf.shape[-1]
    x2 = xf.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r = x2.shape[0]
    dev = x.device
    codes = torch.empty(r, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(r, k // 16, dtype=torch.uint8, device=dev)
    row = scaling == "row"
    sdec = torch.empty(r if row else 1, dtype=torch.float32, device=dev)
    amx = torch.empty_like(sdec)
    if scaling == "static":
        s = torch.as_tensor(static_scale, dtype=torch.float32, device=dev).reshape(())
        amx = s * torch.tensor(ref.TE_AMAX_TO_SCALE, dtype=torch.float32, device=dev)
        s_enc, sdec = ref.global_scales(s, chain, static=True)
    elif scaling == "tensor":
        amx = amax(x2)
    gs = torch.stack([s_enc, sdec]) if scaling == "static" else amx
    seed = _seed(generator, dev) if rounding == "stochastic" else 0
    gs_mode = {"row": 0, "tensor": 1, "static": 2}[scaling]
    _launch(x2, codes, scales, codes, sdec, amx, gs, seed, gs_mode, chain, block,
            rounding == "stochastic", write_codes=True, vals=None)
    sb = scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16)
    codes = codes.reshape(*lead, k // 2)
    if row:
        return codes, sb, sdec.reshape(*lead, 1), amx.reshape(*lead, 1)
    return codes, sb, sdec.reshape(()), amx.reshape(())


def quantize(x: torch.Tensor, scaling: str = "tensor", block=(1, 16), rounding: str = "rne",
             chain: str = "te", static_scale=None, hadamard: bool = False, generator=None,
             check_finite: bool = True, pad: bool = False):
    """`minite.nvfp4.quantize` run by the kernel: same arguments, same checks, an NVFP4Tensor."""
    block = tuple(block)
    check_quantize_args(x, scaling, block, rounding, chain, static_scale)
    if check_finite:
        require_finite(x)
    xp = pad_to_blocks(x, block, pad)
    codes, sb, s_dec, amx = quantize_packed(xp, scaling, block, rounding, chain, static_scale, hadamard,
                                            generator)
    return NVFP4Tensor(codes, sb, s_dec, amx, tuple(x.shape), block, scaling, chain, hadamard)


def check_fused_output(op: str, width: int, out_dtype, chain: str) -> None:
    """The arguments of an op that also quantizes its output row by row for the NVFP4 GEMMs (norm,
    SwiGLU): 1x16 blocks along a width of a multiple of 16, values written in bf16 or fp16."""
    if width % 16:
        raise ValueError(f"{op}: width {width} is not a multiple of 16")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op} writes bf16 or fp16 values, not {out_dtype}")
    if chain not in CHAIN_IDS:
        raise ValueError(f"unknown chain {chain!r}; expected one of {sorted(CHAIN_IDS)}")


def _fused_buffers(x: torch.Tensor, out_dtype, op: str):
    """The fused activation forms' checks and outputs: (lead shape, K, x as [R, K] with unit column
    stride, values [R, K] out_dtype, block scales uint8 [R, K // 16], S_dec and amax fp32 [R])."""
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{op} writes bf16 or fp16 values, not {out_dtype}")
    _check_device(x)
    _check_input(x, (1, 16))
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r, dev = x2.shape[0], x.device
    vals = torch.empty(r, k, dtype=out_dtype, device=dev)
    scales = torch.empty(r, k // 16, dtype=torch.uint8, device=dev)
    sdec = torch.empty(r, dtype=torch.float32, device=dev)
    return lead, k, x2, vals, scales, sdec, torch.empty_like(sdec)


def quantize_unscaled(x: torch.Tensor, out_dtype=torch.bfloat16, chain: str = "te",
                      return_codes: bool = False):
    """Fused activation quantizer (row scaling, 1x16 blocks, RNE): x [..., K] ->
    (values e2m1 * s_b in out_dtype [..., K] (exact), S_dec fp32 [..., 1]), and with return_codes=True
    also (packed codes uint8 [..., K // 2], block scales e4m3 [..., K // 16], amax fp32 [..., 1]).
    The values equal `quantize(x, scaling="row").unscaled()` bit for bit."""
    lead, k, x2, vals, scales, sdec, amx = _fused_buffers(x, out_dtype, "quantize_unscaled")
    codes = torch.empty(x2.shape[0], k // 2, dtype=torch.uint8, device=x.device) if return_codes else scales
    _launch(x2, codes, scales, vals, sdec, amx, sdec, 0, 0, chain, (1, 16), False,
            write_codes=return_codes, vals=vals)
    out = (vals.reshape(*lead, k), sdec.reshape(*lead, 1))
    if return_codes:
        sb = scales.view(torch.float8_e4m3fn).reshape(*lead, k // 16)
        return (*out, codes.reshape(*lead, k // 2), sb, amx.reshape(*lead, 1))
    return out


def quantize_unscaled_global(x: torch.Tensor, out_dtype=torch.bfloat16, chain: str = "te",
                             static: torch.Tensor | None = None):
    """The fused activation form with one global scale for all of x (1x16 blocks, RNE): the amax of
    x ('tensor' scaling, TE's dynamic per-tensor recipe), or a calibrated scale ('static'), given as
    `static` = fp32 [3] (S_enc, S_dec, amax) from `static_global_scales` -> (values e2m1 * s_b in
    out_dtype [..., K], S_dec fp32 [..., 1], amax fp32 [..., 1]: the one global value on every row,
    the GEMM epilogue's row factors). Bitwise `quantize(x, scaling=...)`'s `unscaled()`, global scale
    and amax. One quantizer launch after the amax reduction (tensor) or the finiteness check
    (static); no host synchronization and no host-to-device copy, so a CUDA graph can capture it. x
    holding inf or NaN gets S_dec = amax = NaN on every row."""
    lead, k, x2, vals, scales, sdec, amx = _fused_buffers(x, out_dtype, "quantize_unscaled_global")
    if static is None:
        gs, mode = amax(x2), 3
    else:
        gs, mode = static.masked_fill(~torch.isfinite(x2).all(), float("nan")), 4
    _launch(x2, scales, scales, vals, sdec, amx, gs, 0, mode, chain, (1, 16), False,
            write_codes=False, vals=vals)
    return vals.reshape(*lead, k), sdec.reshape(*lead, 1), amx.reshape(*lead, 1)


def static_global_scales(static_scale: torch.Tensor, chain: str) -> torch.Tensor:
    """A calibrated decode scale (fp32, one element) -> fp32 [3] (S_enc, S_dec, amax), the reference's
    `global_scales(static=True)` and amax: what `quantize_unscaled_global(static=)` takes. Made once
    per calibration, outside any CUDA graph (it copies constants to the device)."""
    s = static_scale.to(torch.float32).reshape(())
    s_enc, sdec = ref.global_scales(s, chain, static=True)
    return torch.stack([s_enc, sdec, s * torch.tensor(ref.TE_AMAX_TO_SCALE, dtype=torch.float32,
                                                      device=s.device)])


def quantize_tensors(x: torch.Tensor, block=(1, 16), chain: str = "te", out_dtype=torch.bfloat16):
    """E tensors at once, each with its own per-tensor scale (RNE, no RHT): x [E, N, K] ->
    (packed codes uint8 [E, N, K // 2], block scales e4m3 [E, N, K // 16], S_dec fp32 [E], amax fp32
    [E], values e2m1 * s_b in out_dtype [E, N, K]), in one launch (plus one amax reduction). Tensor e's
    outputs are bitwise those of `quantize_packed(x[e], "tensor", block, chain=chain)` and of its
    `unscaled()`: the weights of a model (E = 1) or of all its experts, once per update."""
    block = tuple(block)
    _check_device(x)
    _check_input(x, block)
    if x.ndim != 3:
        raise ValueError(f"quantize_tensors takes x [E, N, K], got shape {tuple(x.shape)}")
    e, n, k = x.shape
    if block == (16, 16) and n % 16:
        raise ValueError(f"16x16 blocks need N divisible by 16 per tensor, got {n}")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"quantize_tensors writes bf16 or fp16 values, not {out_dtype}")
    x2 = x.reshape(e * n, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dev = x.device
    amx = torch.linalg.vector_norm(x.reshape(e, -1), ord=float("inf"), dim=1, dtype=torch.float32)
    codes = torch.empty(e * n, k // 2, dtype=torch.uint8, device=dev)
    scales = torch.empty(e * n, k // 16, dtype=torch.uint8, device=dev)
    vals = torch.empty(e * n, k, dtype=out_dtype, device=dev)
    sdec = torch.empty(e, dtype=torch.float32, device=dev)
    _launch(x2, codes, scales, vals, sdec, amx, amx, 0, 1, chain, block, False, write_codes=True, vals=vals,
            rows_per_gs=n)
    return (codes.view(e, n, k // 2), scales.view(torch.float8_e4m3fn).view(e, n, k // 16), sdec, amx,
            vals.view(e, n, k))


def _launch(x2, codes, scales, vals_buf, sdec, amx, gs, seed, gs_mode, chain, block, stochastic,
            write_codes, vals, rows_per_gs=None):
    from minite.kernels import interpreted
    from minite.kernels.nvfp4 import pairs as nvfp4_pairs

    r, k = x2.shape
    if block == (1, 16) and not stochastic and nvfp4_pairs.launch(
            x2, codes, scales, vals, sdec, amx, gs, gs_mode, CHAIN_IDS[chain], write_codes,
            rows_per_gs or max(r, 1)):
        return
    k_p2 = max(16, next_power_of_2(k))
    if block == (16, 16):
        cfg = CONFIGS["16x16"]
        block_r, block_k = cfg["BLOCK_R"], min(cfg["BLOCK_K"], k_p2)
    else:
        cfg = CONFIGS["1x16"]
        single = gs_mode == 0 and k_p2 <= cfg["MAX_K"]
        block_k = k_p2 if single else min(cfg["CHUNK_K"], k_p2)
        block_r = max(1, cfg["ELEMS"] // block_k)
    grid = (cdiv(r, block_r),)
    launch_kernel(_quantize_kernel, grid,
                  (x2, codes, scales, vals if vals is not None else vals_buf, sdec, amx, gs, r, x2.stride(0),
                   seed, rows_per_gs or max(r, 1)),
                  K=k, GS=gs_mode, CHAIN=CHAIN_IDS[chain], TILE16=block == (16, 16),
                  STOCHASTIC=stochastic, WRITE_CODES=write_codes, WRITE_VALUES=vals is not None,
                  HW=not interpreted(), BLOCK_R=block_r, BLOCK_K=block_k, num_warps=cfg["num_warps"])


def _seed(generator, device) -> int:
    g = generator
    if g is None:
        return int(torch.randint(0, 2**31 - 1, (1,)).item())
    return int(torch.randint(0, 2**31 - 1, (1,), generator=g, device=g.device).item())


def _check_device(x: torch.Tensor) -> None:
    from minite.kernels import interpreted

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cuda" and not interpreted():
        raise ValueError(f"Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1); got {x.device}")


def _check_input(x: torch.Tensor, block) -> None:
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the NVFP4 quantize kernel reads float32, bfloat16 or float16, not {x.dtype}")
    if x.ndim == 0 or x.shape[-1] % 16:
        raise ValueError(f"the last dimension must be a positive multiple of 16, got shape {tuple(x.shape)}"
                         " (pad first: minite.nvfp4.quantize(pad=True))")
    if block == (16, 16) and (x.ndim < 2 or x.shape[-2] % 16):
        raise ValueError(f"16x16 blocks need a row count divisible by 16, got shape {tuple(x.shape)}")
