"""The 16-point random Hadamard transform (RHT) of Transformer Engine's NVFP4 recipe, bit for bit.

R = diag(signs) @ H16 / 4, with H16 the Sylvester Hadamard matrix (entries +-1, H16 H16^T = 16 I)
and TE's sign vector: each 16-chunk c (a row vector) along the reduction dimension K becomes c @ R,
i.e. the signs flip the chunk's elements first and the Hadamard mixes them after
(y_j = sum_i s_i x_i H_ij / 4). Every entry of R is +-0.25, exact in every float dtype, so the only
rounding is the sum of 16 terms, done in fp32 (exact for all but extreme exponent spreads) and then
rounded once to the input dtype: TE builds R in the input dtype and multiplies in it, so bf16 input
gives bf16 rotated values, which the quantizer then reads. R is orthonormal (R R^T = I), so applying
it to both GEMM operands along K leaves the product unchanged: (A R)(B R)^T = A B^T; TE applies it to
the wgrad operands to spread outliers across a block before 4-bit quantization.

Source of the definition: TransformerEngine `transformer_engine/pytorch/custom_recipes/
quantization_nvfp4.py` (`_build_hadamard_matrix`: the sign matrix times H, cast to the input dtype;
`_apply_rht`: `x.view(-1, 16) @ (H * 1/sqrt(16))`) and `tensor/nvfp4_tensor.py` (`get_rht_matrix`,
the sign vector).
"""

import torch

TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def sylvester_hadamard(n: int = 16) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix (entries +-1), float32; n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n={n} must be a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rht_matrix(device=None) -> torch.Tensor:
    """R = diag(TE_SIGNS) @ H16 / 4: float32 [16, 16], orthonormal; entries are +-0.25 (exact)."""
    signs = torch.tensor(TE_SIGNS, dtype=torch.float32)
    return (signs[:, None] * sylvester_hadamard(16) * 0.25).to(device)


def apply_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., K] (K % 16 == 0) -> every 16-chunk along K times R (or R^T = R^-1), summed in fp32 and
    rounded to x's dtype (fp32 in, fp32 out; bf16 in, bf16 out, as TE's)."""
    if x.shape[-1] % 16:
        raise ValueError(f"the RHT needs the last dimension divisible by 16, got {x.shape[-1]}")
    r = rht_matrix(x.device)
    if inverse:
        r = r.T
    chunks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    return (chunks @ r).reshape(x.shape).to(x.dtype)
