"""The W4A4 GEMM epilogue shared by the dense, decode and grouped kernels: the fp32 accumulator times
the global scales, exactly as `minite.ref.gemm` applies them."""

import triton
import triton.language as tl

from minite.kernels.rounding import round_bf16

EPILOGUES = {"sdec": 0, "alpha": 1, "bf16_scalar": 2}


@triton.jit
def epilogue(acc, sa, sw, EPILOGUE: tl.constexpr):
    """fp32 accumulator [BM, BN], per-row sa [BM], scalar sw -> the scaled fp32 (or bf16) output."""
    if EPILOGUE == 1:
        scale = (sa * sw) * 1.3840171485260771e-07  # fl32(1 / 7225344)
    else:
        scale = sa * sw
    if EPILOGUE == 2:
        # bf16 * bf16 is exact in fp32, so rounding the fp32 product once is the bf16 multiply. The
        # result stays fp32 (bf16-exact): one return type for every epilogue (Triton needs that).
        out = round_bf16(round_bf16(acc) * round_bf16(scale)[:, None])
    else:
        out = acc * scale[:, None]
    return out
