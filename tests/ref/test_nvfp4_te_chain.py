"""Codes, block scales and global scales equal Transformer Engine's chain (docs/facts.md, "NVFP4 and
Transformer Engine's chain") bit for bit.

The expected values come from tests/ref/scalar_te.py, an independent scalar implementation. Codes are
compared with the sign bit included, so +0 and -0 are not conflated.
"""

import numpy as np
import pytest
import torch

from minite.nvfp4 import quantize, unpack
from tests.ref.scalar_te import E4M3, quantize_rows

E4M3_TIES = [(a + b) / 2 for a, b in zip(E4M3[:-1], E4M3[1:])]


def assert_matches_te(x: torch.Tensor, row_scaled: bool):
    q = quantize(x, scaling="row" if row_scaled else "tensor")
    codes, scales, s_dec = quantize_rows(x.float().numpy(), row_scaled)
    assert np.array_equal(unpack(q.codes).numpy().astype(np.int64), codes)
    assert np.array_equal(q.block_scales.float().numpy(), scales)
    got = q.global_scale.reshape(-1).numpy()
    want = s_dec if row_scaled else s_dec[:1]
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("row_scaled", [False, True])
@pytest.mark.parametrize("shape,scale", [((3, 32), 1.0), ((5, 48), 1e-3), ((2, 64), 3e4), ((4, 16), 1e-30)])
def test_random_inputs(shape, scale, row_scaled):
    g = torch.Generator().manual_seed(hash((shape, scale)) % 2**31)
    x = torch.randn(shape, generator=g) * scale
    x[0, 3] *= 40  # an outlier, so block scales spread
    assert_matches_te(x, row_scaled)


@pytest.mark.parametrize("row_scaled", [False, True])
def test_heavy_tailed_bf16_input(row_scaled):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 64, generator=g) ** 3).to(torch.bfloat16)
    assert_matches_te(x, row_scaled)


def test_every_e2m1_tie_and_grid_point():
    # amax 2688 makes S_enc = S_dec = 1; a block with max 6 gets s_b = e4m3(6 * fl32(1/6)) = 1,
    # so the element scale is exactly 1 and x itself is rounded to E2M1.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    row = torch.tensor([6.0] + ties + grid + [5.0001])
    x = torch.zeros(2, 32)
    x[0, :16] = row
    x[0, 16:] = -row
    x[1, 0] = 2688.0
    assert_matches_te(x, row_scaled=False)
    q = quantize(x)
    want = [7, 0, 2, 2, 4, 4, 6, 6, 0, 1, 2, 3, 4, 5, 6, 7]
    assert unpack(q.codes)[0, :16].tolist() == want
    assert unpack(q.codes)[0, 16:].tolist() == [c | 8 for c in want]


def test_block_maxima_on_e4m3_ties():
    # amax 448 makes S_enc * fl32(1/6) == 1 exactly, so the block scale is e4m3(block amax).
    ties = [t for t in E4M3_TIES if t < 448][::4]
    x = torch.zeros(len(ties) + 1, 16)
    x[: len(ties), 0] = torch.tensor(ties)
    x[: len(ties), 1] = -torch.tensor(ties) * 0.3
    x[-1, 0] = 448.0
    assert float(x.abs().max() * 6 / 2688 * 1) == 1.0
    assert_matches_te(x, row_scaled=False)


def test_saturation_subnormal_and_zero_block_scales():
    x = torch.zeros(1, 64)
    x[0, 0] = 1e4  # the tensor's amax: this block saturates at 448
    x[0, 16] = 1e4 * 2.0**-17  # block scale in the E4M3 subnormal range
    x[0, 32] = 1e4 * 2.0**-20  # block scale rounds to 0
    x[0, 48:] = 1e4 * 2.0**-22
    assert_matches_te(x, row_scaled=False)
    q = quantize(x)
    sb = q.block_scales.float()[0].tolist()
    assert sb[0] == 448.0 and 0 < sb[1] < 2.0**-6 and sb[2] == 0.0 and sb[3] == 0.0


def test_tiny_amax_overflows_encode_scale():
    x = torch.full((2, 16), 1e-40)  # fp32 subnormal: 2688 / amax overflows to inf -> FLT_MAX
    x[1] = -3e-42
    assert_matches_te(x, row_scaled=True)
    assert_matches_te(x, row_scaled=False)
    q = quantize(x)
    flt_max = torch.tensor(torch.finfo(torch.float32).max)
    assert torch.equal(q.global_scale, 1 / flt_max)


def test_all_zero_rows_and_tensor():
    x = torch.randn(3, 32)
    x[1] = 0
    assert_matches_te(x, row_scaled=True)
    q = quantize(x, scaling="row")
    assert float(q.global_scale[1]) == 1.0 and q.codes[1].eq(0).all()
    z = quantize(torch.zeros(4, 32))
    assert float(z.global_scale) == 1.0 and z.codes.eq(0).all() and z.block_scales.float().eq(0).all()


def test_static_scale_saturates_instead_of_nan():
    x = torch.tensor([[1000.0] + [1.0] * 15])
    q = quantize(x, scaling="static", static_scale=1.0 / 2688)  # calibrated amax 1, value 1000
    assert q.block_scales.float()[0, 0] == 448.0 and int(unpack(q.codes)[0, 0]) == 7
