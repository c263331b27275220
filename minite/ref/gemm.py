"""Reference W4A4 GEMM: out = x_q @ w_q^T with NVFP4 operands, fp32 accumulation, scales in the epilogue.

    acc[m, n] = sum_k (e2m1_x * s_b_x)[m, k] * (e2m1_w * s_b_w)[n, k]            (fp32 accumulation)
    epilogue "sdec"        : out = acc * (S_dec_x[m] * S_dec_w)                   (fp32, then out_dtype)
    epilogue "alpha"       : out = acc * (amax_x[m] * amax_w * fl32(1/7225344))  (TE; 7225344 = 2688^2)
    epilogue "bf16_scalar" : out = bf16(acc) * bf16(S_dec_x[m] * S_dec_w)        (torchao)

The unscaled operands e2m1 * s_b are exact in bf16 and fp16, and every product inside one
16-block, and its 16-term sum, is exact in fp32; only the accumulation across blocks can round. So a
kernel must match this reference bit for bit wherever that accumulation is exact (nearly all outputs
on Gaussian data) and within one fp32 rounding per block otherwise; with the same accumulation order
(the aligned kernels) it is bitwise equal to itself at every M.
"""

import torch

from minite.nvfp4_format import NVFP4Tensor

TE_ALPHA_DIVISOR = 7225344.0  # 2688 ** 2


def epilogue_scale(xq: NVFP4Tensor, wq: NVFP4Tensor, epilogue: str) -> torch.Tensor:
    """The fp32 factor applied to the accumulator: [] or [..., M, 1]."""
    if epilogue in ("sdec", "bf16_scalar"):
        return xq.global_scale * wq.global_scale
    if epilogue == "alpha":
        r = torch.tensor(1.0 / TE_ALPHA_DIVISOR, dtype=torch.float32, device=xq.amax.device)
        return (xq.amax * wq.amax) * r
    raise ValueError(f"epilogue={epilogue!r} is not supported; choose 'sdec', 'alpha' or 'bf16_scalar'")


def apply_epilogue(acc: torch.Tensor, scale: torch.Tensor, epilogue: str, out_dtype) -> torch.Tensor:
    if epilogue == "bf16_scalar":
        return (acc.to(torch.bfloat16) * scale.to(torch.bfloat16)).to(out_dtype)
    return (acc * scale).to(out_dtype)


def nvfp4_gemm(xq: NVFP4Tensor, wq: NVFP4Tensor, epilogue: str = "sdec",
               out_dtype=torch.float32) -> torch.Tensor:
    """x_q [..., M, K] (any scaling), w_q [N, K] (tensor or static scaling) -> [..., M, N]."""
    if wq.global_scale.numel() != 1:
        raise ValueError("the weight operand needs one global scale (scaling='tensor' or 'static')")
    if xq.padded_shape[-1] != wq.padded_shape[-1]:
        raise ValueError(f"K mismatch: x has {xq.shape[-1]}, w has {wq.shape[-1]}")
    acc = xq.unscaled() @ wq.unscaled().T  # [..., Mp, Np] fp32
    acc = acc[..., : wq.shape[0]]  # drop rows of W padded to a 16x16 tile
    if xq.block == (16, 16):
        acc = acc[..., : xq.shape[-2], :]
    return apply_epilogue(acc, epilogue_scale(xq, wq, epilogue), epilogue, out_dtype)
