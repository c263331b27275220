"""The 16-point random Hadamard transform (RHT) of Transformer Engine's NVFP4 recipe.

R = 0.25 * H16 @ diag(signs), with H16 the Sylvester Hadamard matrix (entries +-1, H16 H16^T = 16 I)
and TE's sign vector. R is orthonormal (R R^T = I), so applying it per 16-chunk along the reduction
dimension K of *both* GEMM operands leaves the product unchanged: (A R)(B R)^T = A B^T. TE applies it
to the wgrad operands to spread outliers across a block before 4-bit quantization.
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
    """R = 0.25 * H16 @ diag(TE_SIGNS): float32 [16, 16], orthonormal; entries are +-0.25 (exact)."""
    signs = torch.tensor(TE_SIGNS, dtype=torch.float32)
    return (0.25 * sylvester_hadamard(16) * signs[None, :]).to(device)


def apply_rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., K] (K % 16 == 0) -> fp32 x with every 16-chunk along K multiplied by R (or R^T)."""
    if x.shape[-1] % 16:
        raise ValueError(f"the RHT needs the last dimension divisible by 16, got {x.shape[-1]}")
    r = rht_matrix(x.device)
    if inverse:
        r = r.T
    chunks = x.float().reshape(*x.shape[:-1], x.shape[-1] // 16, 16)
    return (chunks @ r).reshape(x.shape)
