"""`hadamard=True` is Transformer Engine's RHT bit for bit.

TE's definition, written here from its documentation and reference quantizer (not from our module):
the 16x16 Hadamard matrix H (Sylvester: H_2 = [[1, 1], [1, -1]], H_2n = H_2 kron H_n), the sign
matrix diag(s) applied to it from the left, the product cast to the input dtype and scaled by
1/sqrt(16); every 16-chunk of x (a row) is multiplied by it in the input dtype.
"""

import pytest
import torch

from minite.nvfp4 import dequantize, quantize
from minite.ref.hadamard import apply_rht

TE_WGRAD_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def te_rht(x: torch.Tensor) -> torch.Tensor:
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    h = h2
    for _ in range(3):
        h = torch.kron(h2, h)
    signed = torch.diag(torch.tensor(TE_WGRAD_SIGNS, dtype=torch.float32)) @ h
    transform = signed.to(x.dtype) * (1.0 / 16 ** 0.5)
    return (x.contiguous().view(-1, 16) @ transform).view(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotation_is_tes_bit_for_bit(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, 256, generator=g) * torch.rand(64, 1, generator=g) * 10).to(dtype)
    got = apply_rht(x)
    assert got.dtype == dtype
    assert torch.equal(got, te_rht(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_codes_are_those_of_tes_rotated_values(dtype):
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    q, want = quantize(x, "tensor", hadamard=True), quantize(te_rht(x), "tensor")
    assert torch.equal(q.codes, want.codes)
    assert torch.equal(q.block_scales.view(torch.uint8), want.block_scales.view(torch.uint8))
    assert torch.equal(q.global_scale, want.global_scale)


def test_signs_come_before_the_hadamard():
    """The unit vector e_i is rotated to s_i * (row i of H) / 4: the sign scales a whole row of H (our
    former matrix, H diag(s) / 4, scaled a column instead)."""
    h = te_rht(torch.eye(16)) * torch.tensor(TE_WGRAD_SIGNS, dtype=torch.float32)[:, None]  # H / 4
    assert torch.equal(h, h.T) and torch.equal(h.abs(), torch.full((16, 16), 0.25))
    for i, s in enumerate(TE_WGRAD_SIGNS):
        assert torch.equal(apply_rht(torch.eye(16)[i]), s * h[i])


def test_undo_gives_back_the_input():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(apply_rht(apply_rht(x), inverse=True), x, rtol=0, atol=1e-6)
    q = quantize(x, hadamard=True)
    rotated_back = apply_rht(dequantize(q), inverse=True)
    assert torch.equal(dequantize(q, undo_hadamard=True), rotated_back)
