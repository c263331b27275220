"""2-3 weights concatenated along N in one decode layout, one launch (`decode_gemm.decode_gemm_segments`
at few rows, `grouped_decode.decode_rows_segments` in row tiles): each weight's output bitwise its own
launch's, with its own global scale, on heavy-tailed data."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels import grouped_decode as gd
from tests.kernels.helpers import device
from tests.kernels.test_gemm import heavy

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def weights(widths, k, dev, seed=3):
    """Each weight quantized as its own tensor (its own global scale, some far apart)."""
    out = []
    for j, n in enumerate(widths):
        w = heavy(n, k, seed + j) * (10.0 ** (2 * j - 2))
        out.append(nvfp4.quantize(w.to(dev), "tensor"))
    return out


def concatenated(wqs, dtype):
    layouts = [kd.pack_weight(q.codes, q.block_scales, dtype) for q in wqs]
    codes, scales = torch.cat([w.codes for w in layouts]), torch.cat([w.scales for w in layouts])
    return layouts, kd.DecodeWeight(codes, scales, sum(w.n for w in layouts))


def scales(wqs, alpha=False):
    s = [(q.amax if alpha else q.global_scale).reshape(()).float() for q in wqs]
    return torch.stack([*s, s[-1]][:3])


def activation(m, k, dev):
    xq = nvfp4.quantize(heavy(m, k, 11).to(dev), "row")
    return xq.unscaled().to(kg.operand_dtype(dev)), xq.global_scale.reshape(-1)


@pytest.mark.parametrize("widths", [(128, 64, 64), (64, 192)])
@pytest.mark.parametrize("m", [1, 24, 64])
def test_few_rows_give_each_weights_own_bits(m, widths):
    dev, k = device(), 256
    wqs = weights(widths, k, dev)
    a, sa = activation(m, k, dev)
    layouts, w = concatenated(wqs, a.dtype)
    outs = kd.decode_gemm_segments(a, sa, w, scales(wqs), widths, out_dtype=torch.float32)
    assert len(outs) == len(widths)
    for out, lay, q in zip(outs, layouts, wqs):
        want = kd.decode_gemm(a, sa, lay, q.global_scale, out_dtype=torch.float32,
                              config=kd.aligned_decode_config(m, k))
        assert out.is_contiguous() and torch.equal(out, want)


@pytest.mark.parametrize("m", [24, 150])
def test_row_tiles_give_each_weights_own_bits(m):
    dev, k, widths = device(), 256, (128, 64, 64)
    wqs = weights(widths, k, dev)
    a, sa = activation(m, k, dev)
    layouts, w = concatenated(wqs, a.dtype)
    outs = gd.decode_rows_segments(a, sa, w, scales(wqs), widths, out_dtype=torch.float32)
    for out, lay, q in zip(outs, layouts, wqs):
        want = gd.decode_gemm_rows(a, sa, lay, q.global_scale, out_dtype=torch.float32)
        assert out.shape == (m, lay.n) and out.is_contiguous() and torch.equal(out, want)


def test_alpha_epilogue_and_one_activation_scale():
    """TE's 'alpha' epilogue (the amaxes) with one per-tensor activation factor."""
    dev, k, m, widths = device(), 128, 5, (64, 64)
    wqs = weights(widths, k, dev)
    xq = nvfp4.quantize(heavy(m, k, 12).to(dev), "tensor")
    a, sa = xq.unscaled().to(kg.operand_dtype(dev)), xq.amax.reshape(())
    layouts, w = concatenated(wqs, a.dtype)
    outs = kd.decode_gemm_segments(a, sa, w, scales(wqs, alpha=True), widths, "alpha", torch.float32)
    for out, lay, q in zip(outs, layouts, wqs):
        want = kd.decode_gemm(a, sa, lay, q.amax.reshape(()).float(), "alpha", torch.float32,
                              kd.aligned_decode_config(m, k))
        assert torch.equal(out, want)


def test_bad_arguments_raise():
    dev, k = device(), 128
    wqs = weights((64, 64), k, dev)
    a, sa = activation(4, k, dev)
    _, w = concatenated(wqs, a.dtype)
    with pytest.raises(ValueError, match="widths"):
        kd.decode_gemm_segments(a, sa, w, scales(wqs), (64, 32, 32))
    with pytest.raises(ValueError, match="multiples of 64"):
        gd.decode_rows_segments(a, sa, w, scales(wqs), (96, 32))
    with pytest.raises(ValueError, match="3 scales"):
        kd.decode_gemm_segments(a, sa, w, scales(wqs)[:2], (64, 64))
    with pytest.raises(ValueError, match="split-K"):
        kd.decode_gemm_segments(a, sa, w, scales(wqs), (64, 64), config=dict(kd.decode_config(4, 128, k),
                                                                            SPLIT_K=2))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 32, 64, 512])
def test_gpu_attention_projections_in_one_launch(m):
    """q|k|v of Qwen3-30B-A3B (K 2048; 4096, 512, 512 rows), bf16 activations: the segments' bits at
    every row count, few rows on the decode kernel, more in row tiles."""
    k, widths = 2048, (4096, 512, 512)
    wqs = weights(widths, k, "cuda")
    a, sa = activation(m, k, "cuda")
    layouts, w = concatenated(wqs, a.dtype)
    if m <= 64:
        outs = kd.decode_gemm_segments(a, sa, w, scales(wqs), widths)
        wants = [kd.decode_gemm(a, sa, lay, q.global_scale, config=kd.aligned_decode_config(m, k))
                 for lay, q in zip(layouts, wqs)]
    else:
        outs = gd.decode_rows_segments(a, sa, w, scales(wqs), widths)
        wants = [gd.decode_gemm_rows(a, sa, lay, q.global_scale) for lay, q in zip(layouts, wqs)]
    for out, want in zip(outs, wants):
        assert torch.equal(out, want)
