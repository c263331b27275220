"""The W4A4 GEMM epilogue shared by the dense, decode and grouped kernels: the fp32 accumulator times
the global scales, exactly as `minite.ref.gemm` applies them; `store_tile` applies it to an output tile
and stores the rows and columns inside the masks."""

import torch
import triton
import triton.language as tl

from minite.kernels.rounding import round_bf16

EPILOGUES = {"sdec": 0, "alpha": 1, "bf16_scalar": 2}


@triton.jit
def epilogue(acc, sa, sw, EPILOGUE: tl.constexpr):
    """fp32 accumulator [BM, BN], per-row sa [BM], scalar sw -> the scaled fp32 (or bf16) output."""
    return scaled(acc, (sa * sw)[:, None], EPILOGUE)


@triton.jit
def scaled(acc, factor, EPILOGUE: tl.constexpr):
    """acc times the global-scale product `factor` (S_dec_x * S_dec_w, or amax_x * amax_w for 'alpha'),
    broadcastable to acc: [BM, 1] (one weight) or [BM, BN] (`store_segments`)."""
    if EPILOGUE == 1:
        scale = factor * 1.3840171485260771e-07  # fl32(1 / 7225344)
    else:
        scale = factor
    if EPILOGUE == 2:
        # bf16 * bf16 is exact in fp32, so rounding the fp32 product once is the bf16 multiply. The
        # result stays fp32 (bf16-exact): one return type for every epilogue (Triton needs that).
        out = round_bf16(round_bf16(acc) * round_bf16(scale))
    else:
        out = acc * scale
    return out


@triton.jit
def store_tile(acc, sa_ptr, sw, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, stride_sa,
               EPILOGUE: tl.constexpr):
    """acc [BM, BN] for rows offs_m, columns offs_n: scaled by the rows' sa and the scalar sw, stored."""
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=1.0)
    store_scaled(acc, sa, sw, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, EPILOGUE)


@triton.jit
def store_scaled(acc, sa, sw, out_ptr, offs_m, offs_n, mask_m, mask_n, stride_om, EPILOGUE: tl.constexpr):
    """`store_tile` with the rows' sa [BM] already loaded."""
    out = epilogue(acc, sa, sw, EPILOGUE)
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def store_segments(acc, sa_ptr, sw0, sw1, sw2, out_ptr, offs_m, offs_n, M, N, N1, N2, stride_sa,
                   EPILOGUE: tl.constexpr):
    """`store_tile` for the GEMM of several weights concatenated along N (`gemm.gemm_segments`):
    columns [0, N1), [N1, N2), [N2, N) belong to weights 0, 1, 2, each with its own scalar scale, and
    each stored to its own contiguous [M, width] block of out (one after the other). Every element
    gets the fp32 operations `epilogue` gives it in its own weight's GEMM: the same bits."""
    mask_m = offs_m < M
    sa = tl.load(sa_ptr + offs_m * stride_sa, mask=mask_m, other=1.0)
    sw = tl.where(offs_n < N1, sw0, tl.where(offs_n < N2, sw1, sw2))  # [BN]
    out = scaled(acc, sa[:, None] * sw[None, :], EPILOGUE)
    # per column: its weight's row stride (width) and where its output starts; the offset inside a
    # weight's output in 32 bits (the host keeps M * width below 2^31), its start in 64
    width = tl.where(offs_n < N1, N1, tl.where(offs_n < N2, N2 - N1, N - N2))  # [BN]
    start = tl.where(offs_n < N1, 0, tl.where(offs_n < N2, N1, N2))  # [BN]
    local = offs_m[:, None] * width[None, :] + (offs_n - start)[None, :]
    off = (start.to(tl.int64) * M)[None, :] + local
    tl.store(out_ptr + off, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < N)[None, :])


def segment_bounds(widths: tuple[int, ...], n: int, w_scales: torch.Tensor, m: int,
                   tile: int = 1) -> tuple[int, int]:
    """(N1, N2) of `store_segments` for 2-3 weights of `widths` rows concatenated into N rows, checked:
    positive widths summing to N (multiples of `tile`: a decode layout's memory tiles each belong to
    one weight), 3 scales, M * width below 2^31 (32-bit offsets inside an output)."""
    if len(widths) not in (2, 3) or sum(widths) != n or min(widths) <= 0 or w_scales.numel() != 3:
        raise ValueError(f"segments: 2 or 3 positive widths summing to N={n} and 3 scales; got "
                         f"{tuple(widths)} and {w_scales.numel()} scales")
    if any(w % tile for w in widths):
        raise ValueError(f"segment widths {tuple(widths)} must be multiples of {tile} (the layout's tiles)")
    if m * max(widths) >= 2**31:
        raise ValueError(f"segments: M * width = {m} * {max(widths)} must stay below 2^31 (32-bit offsets "
                         "inside each output)")
    return widths[0], n if len(widths) == 2 else widths[0] + widths[1]


def segment_views(buf: torch.Tensor, m: int, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """The outputs `store_segments` wrote into the flat `buf`: [M, width] each, contiguous views."""
    outs, start = [], 0
    for width in widths:
        outs.append(buf[m * start:m * (start + width)].view(m, width))
        start += width
    return outs
