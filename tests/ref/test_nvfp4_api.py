"""The public NVFP4 API: packing, padding, 2D tiles, stochastic rounding, RHT, chains, bad input."""

import pytest
import torch

from minite.nvfp4 import dequantize, pack, quantize, unpack
from minite.ref.hadamard import apply_rht, rht_matrix

SR_DRAWS = 20000
# Each SR draw errs by at most the grid gap (<= 2 below 6) with std <= gap / 2, so the mean of
# SR_DRAWS draws has std <= 1 / sqrt(SR_DRAWS) ~ 0.007; allow 5 sigma.
SR_MEAN_TOL = 5 / SR_DRAWS**0.5


def unit_scale_block(values) -> torch.Tensor:
    """A 2-row tensor whose first row's 16-block is quantized with element scale exactly 1."""
    x = torch.zeros(2, 16)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    x[0, -1] = 6.0
    x[1, 0] = 2688.0
    return x


def test_public_api_is_the_format_modules_container_and_decode():
    """`minite.nvfp4` re-exports the format (`minite.nvfp4_format`, which ref and kernels build on)."""
    from minite import nvfp4, nvfp4_format
    from minite.nvfp4 import NVFP4Tensor

    assert NVFP4Tensor is nvfp4_format.NVFP4Tensor and dequantize is nvfp4_format.dequantize
    assert pack is nvfp4_format.pack and unpack is nvfp4_format.unpack
    assert nvfp4.E2M1_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    q = quantize(torch.randn(4, 32))
    assert isinstance(q, NVFP4Tensor) and torch.equal(q.dequantize(), dequantize(q))


def test_pack_puts_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert pack(codes).tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack(pack(codes)), codes)


def test_shapes_and_dequantize_roundtrip_on_grid():
    x = unit_scale_block([0.5, -1.5, 3.0, -4.0, 0.0])
    q = quantize(x)
    assert q.codes.shape == (2, 8) and q.codes.dtype == torch.uint8
    assert q.block_scales.shape == (2, 1) and q.block_scales.dtype == torch.float8_e4m3fn
    assert q.global_scale.shape == () and q.global_scale.dtype == torch.float32
    assert torch.equal(dequantize(q)[0], x[0])
    qr = quantize(torch.randn(3, 5, 32), scaling="row")
    assert qr.global_scale.shape == (3, 5, 1) and dequantize(qr).shape == (3, 5, 32)


def test_pad_zero_pads_and_dequantize_trims():
    x = torch.randn(3, 20)
    with pytest.raises(ValueError, match="pad=True"):
        quantize(x)
    q = quantize(x, pad=True)
    assert q.codes.shape == (3, 16) and dequantize(q).shape == (3, 20)
    assert torch.equal(unpack(q.codes)[:, 20:], torch.zeros(3, 12, dtype=torch.uint8))
    w = torch.randn(20, 32)
    with pytest.raises(ValueError, match="row count 20"):
        quantize(w, block=(16, 16))
    assert dequantize(quantize(w, block=(16, 16), pad=True)).shape == (20, 32)


def test_2d_tiles_share_one_scale():
    w = torch.randn(32, 48)
    w[3, 20] = 50.0  # dominates tile (0, 1) only
    q = quantize(w, block=(16, 16))
    sb = q.block_scales.float()  # [32, 3]
    assert torch.equal(sb[:16], sb[:1].expand(16, 3)) and torch.equal(sb[16:], sb[16:17].expand(16, 3))
    assert sb[0, 1] > 4 * sb[0, 0]
    assert sb[16, 1] < sb[0, 1] / 4  # the tile below, without the outlier, keeps a small scale


def test_stochastic_rounding_is_unbiased():
    values = [0.3, 0.8, 1.1, 1.6, 2.2, 2.75, 3.3, 4.4, 5.5, -0.3, -2.9, -5.1, 0.0, 0.1]
    x = unit_scale_block(values).repeat(SR_DRAWS, 1)
    g = torch.Generator().manual_seed(0)
    mean = dequantize(quantize(x, rounding="stochastic", generator=g))[0::2].mean(0)
    target = x[0]
    assert (mean - target).abs().max() < SR_MEAN_TOL
    rne_bias = (dequantize(quantize(x[:2]))[0] - target).abs().max()
    assert rne_bias > 10 * SR_MEAN_TOL  # the test can tell a biased rounding apart


def test_stochastic_rounding_is_reproducible_with_a_seed():
    x = torch.randn(8, 64)
    q1 = quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    q2 = quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    q3 = quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(q1.codes, q2.codes) and not torch.equal(q1.codes, q3.codes)


def test_rht_is_orthonormal_and_keeps_the_wgrad_product():
    r = rht_matrix()
    assert torch.equal(r @ r.T, torch.eye(16))
    x, g = torch.randn(64, 32), torch.randn(64, 24)  # tokens x features
    wgrad = g.T @ x
    rotated = apply_rht(g.T) @ apply_rht(x.T).T  # RHT along the token dimension
    torch.testing.assert_close(rotated, wgrad, rtol=1e-5, atol=1e-5)
    xr = torch.randn(4, 32)
    torch.testing.assert_close(apply_rht(apply_rht(xr), inverse=True), xr, rtol=0, atol=1e-6)
    q = quantize(xr, hadamard=True)
    assert q.hadamard and dequantize(q, undo_hadamard=True).shape == xr.shape


def test_bad_input_raises_clearly_and_changes_nothing():
    x = torch.randn(4, 32)
    x[1, 5], x[2, 0] = float("nan"), float("inf")
    before = x.clone()
    with pytest.raises(ValueError, match=r"2 non-finite.*\(1, 5\)"):
        quantize(x)
    assert torch.equal(x.nan_to_num(), before.nan_to_num())
    quantize(x, check_finite=False)
    for dtype in (torch.float64, torch.int32, torch.float8_e4m3fn):
        with pytest.raises(TypeError, match="supports float32"):
            quantize(torch.zeros(2, 16).to(dtype))
    with pytest.raises(ValueError, match="static_scale"):
        quantize(torch.zeros(2, 16), scaling="static")
    with pytest.raises(ValueError, match="scaling='tensor'"):
        quantize(torch.zeros(16, 16), block=(16, 16), scaling="row")
    with pytest.raises(ValueError, match="chain"):
        quantize(torch.zeros(2, 16), chain="cublas")


def test_bf16_and_fp16_inputs_quantize_like_fp32():
    x = torch.randn(4, 32).to(torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        assert torch.equal(quantize(xd).codes, quantize(xd.float()).codes)
