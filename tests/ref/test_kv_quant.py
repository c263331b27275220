"""The KV quantizer's contract (`minite.ref.kv_quant`): scale rules, exact values, round-trip error
bounds, zero rows, the layout of the stored fields and the bytes a token takes."""

import pytest
import torch

from minite.nvfp4_format import unpack
from minite.ref import nvfp4
from minite.ref.kv_quant import QuantizedKV, bytes_per_token, quantize_kv, zeros

E4M3_REL = 2.0**-4  # half an E4M3 ulp at 3 mantissa bits, relative


def rows(seed=0, n=6, h=3, d=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g) ** 3
    x[0, 0] = 0.0  # a zero row
    x[1, 2] = -0.0
    x[2, 1, 5] = 1e4  # an outlier
    return x


def test_fp8_scale_is_row_amax_over_448_and_one_for_zero_rows():
    x = rows()
    q = quantize_kv(x, "fp8")
    amax = x.abs().amax(-1)
    assert q.payload.dtype == torch.float8_e4m3fn and q.payload.shape == x.shape
    assert q.scale.dtype == torch.float32 and q.scale.shape == x.shape[:2] and q.block_scales is None
    want = torch.where(amax == 0, 1.0, amax / 448.0)
    assert torch.equal(q.scale, want)
    assert q.scale[0, 0] == 1.0 and q.scale[1, 2] == 1.0
    assert torch.equal(q.dequantize()[0, 0], torch.zeros(32))
    # the row's amax maps onto 448 (the E4M3 maximum), never above
    assert q.payload.float().abs().amax(-1)[amax > 0].eq(448.0).all()


def test_fp8_payload_is_the_rne_e4m3_of_x_over_s():
    x = rows(1)
    q = quantize_kv(x, "fp8")
    v = x / q.scale[..., None]
    want = v.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.payload.view(torch.uint8), want.view(torch.uint8))
    # values already on the grid at unit scale stay exact
    grid = torch.tensor([448.0, -448.0, 1.0, -0.5, 2.0**-9, 3 * 2.0**-9, 0.0, 240.0] * 2).view(1, 1, 16)
    g = quantize_kv(grid, "fp8")
    assert g.scale.item() == 1.0 and torch.equal(g.dequantize(), grid)


def test_fp8_round_trip_error_bound():
    x = rows(2)
    q = quantize_kv(x, "fp8")
    err = (q.dequantize() - x).abs()
    # normals: half an ulp relative; the subnormal range: half its spacing 2^-9, times s
    bound = torch.maximum(x.abs() * E4M3_REL, 2.0**-10 * q.scale[..., None]) * (1 + 1e-6)
    assert (err <= bound).all()


def test_nvfp4_is_the_nvfp4_row_quantization_of_each_row():
    x = rows(3)
    q = quantize_kv(x, "nvfp4")
    assert q.payload.dtype == torch.uint8 and q.payload.shape == (6, 3, 16)
    assert q.block_scales.dtype == torch.float8_e4m3fn and q.block_scales.shape == (6, 3, 2)
    assert q.scale.shape == (6, 3) and q.head_dim == 32 and q.shape == x.shape
    codes, sb, s_dec, _ = nvfp4.quantize_ref(x.reshape(18, 32), "row", (1, 16), "rne", "te", None, False,
                                             None)
    assert torch.equal(unpack(q.payload).reshape(18, 32), codes)
    assert torch.equal(q.block_scales.reshape(18, 2).view(torch.uint8), sb.view(torch.uint8))
    assert torch.equal(q.scale.reshape(18), s_dec.reshape(18))
    assert q.scale[0, 0] == 1.0 and torch.equal(q.dequantize()[0, 0], torch.zeros(32))


def test_nvfp4_round_trip_error_bound():
    """E2M1 RNE: at most half a grid step (1 for |v| in [4, 6]) times s_b * S_dec per element, and a
    block's amax lands on 6 * s_b up to its E4M3 rounding."""
    x = rows(4)
    q = quantize_kv(x, "nvfp4")
    step = (q.block_scales.float() * q.scale[..., None]).repeat_interleave(16, -1)  # s_b * S_dec per element
    assert ((q.dequantize() - x).abs() <= step * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_values_are_exact_in_16_bits_and_dequantize_is_exact_times_scale(fmt, dtype):
    x = rows(5).to(dtype)
    q = quantize_kv(x, fmt)
    exact = q.exact()
    assert torch.equal(q.exact(dtype).float(), exact)
    assert torch.equal(q.dequantize(), exact * q.scale[..., None])
    assert torch.equal(q.dequantize(dtype), (exact * q.scale[..., None]).to(dtype))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_row_does_not_depend_on_its_batch_and_indexing_keeps_fields_together(fmt):
    x = rows(6)
    q = quantize_kv(x, fmt)
    alone = quantize_kv(x[3:4], fmt)
    for a, b in zip(q[3:4].fields(), alone.fields()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    dst = zeros(fmt, (10,), 3, 32, "cpu")
    dst.store(torch.tensor([7, 2, 0, 9, 4, 5]), q)
    for a, b in zip(dst[torch.tensor([2, 9])].fields(), q[1:4:2].fields()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert isinstance(dst.flatten(0, 0), QuantizedKV)


def test_bytes_per_token():
    assert bytes_per_token("bf16", 8, 128, torch.bfloat16) == 2 * 8 * 128 * 2
    assert bytes_per_token("fp8", 8, 128, torch.bfloat16) == 2 * 8 * (128 + 4)
    assert bytes_per_token("nvfp4", 8, 128, torch.bfloat16) == 2 * 8 * (64 + 8 + 4)
    for fmt in ("fp8", "nvfp4"):  # what a stored token really takes
        q = zeros(fmt, (1,), 8, 128, "cpu")
        assert 2 * sum(t.numel() * t.element_size() for t in q.fields()) == bytes_per_token(fmt, 8, 128,
                                                                                         torch.bfloat16)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="kv_cache='int8'"):
        quantize_kv(torch.zeros(2, 16), "int8")
    with pytest.raises(ValueError, match="nothing to quantize"):
        quantize_kv(torch.zeros(2, 16), "bf16")
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_kv(torch.zeros(2, 2, 12), "fp8")
    with pytest.raises(TypeError, match="int64"):
        quantize_kv(torch.zeros(2, 16, dtype=torch.int64), "fp8")
