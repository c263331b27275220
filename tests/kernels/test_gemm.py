"""The W4A4 GEMM kernels against `minite.ref.gemm`, and the aligned path's batch invariance."""

import pytest
import torch
import triton
import triton.language as tl

from minite import nvfp4
from minite.kernels import available
from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq
from minite.ref import gemm as rg
from tests.kernels.helpers import device

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")

# fp32 accumulation across 16-blocks in another order: relative to the output scale
REL_TOL = 1e-5
# Gaussian data: almost every fp32 sum is exact (FACTS.md 1.1), so almost every output is bitwise equal
MIN_EXACT_FRACTION_GAUSSIAN = 0.99


def heavy(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) ** 3
    x[torch.rand(m, k, generator=g) < 0.001] *= 50.0
    return x


def operands(xq, wq, dev):
    a = xq.unscaled().to(dev, kg.operand_dtype(dev))
    return a, xq.global_scale.reshape(-1).to(dev), wq.to(dev), wq.global_scale.to(dev)


@pytest.mark.parametrize("epilogue", ["sdec", "alpha", "bf16_scalar"])
@pytest.mark.parametrize("wblock", [(1, 16), (16, 16)])
def test_matches_reference_small(epilogue, wblock):
    x, w = torch.randn(20, 64), torch.randn(48, 64)
    xq = nvfp4.quantize(x, "row")
    wq = nvfp4.quantize(w, "tensor", block=wblock)
    want = rg.nvfp4_gemm(xq, wq, epilogue)
    got = kg.nvfp4_gemm(xq.to(device()), wq.to(device()), epilogue).cpu()
    assert torch.equal(got, want)


def test_both_weight_representations_and_every_m_give_the_same_rows():
    x, w = heavy(40, 128, 0), heavy(64, 128, 1)
    xq, wq = nvfp4.quantize(x, "row"), nvfp4.quantize(w, "tensor")
    a, sa, wqd, sw = operands(xq, wq, device())
    copy = kg.unscaled_copy(wqd)
    full = kg.w4a4_gemm(a, sa, copy, sw, out_dtype=torch.float32)
    for m in (1, 7, 40):
        packed = kg.w4a4_gemm(a[:m], sa[:m], wqd.codes, sw, wqd.block_scales, out_dtype=torch.float32)
        assert torch.equal(packed, full[:m])
        assert torch.equal(kg.w4a4_gemm(a[-m:], sa[-m:], copy, sw, out_dtype=torch.float32), full[-m:])


def test_output_is_fully_written():
    a = torch.zeros(7, 64, dtype=kg.operand_dtype(device()), device=device())
    w = torch.zeros(24, 64, dtype=a.dtype, device=device())
    one = torch.ones((), device=device())
    out = kg.w4a4_gemm(a, one.reshape(1), w, one, out_dtype=torch.float32)
    assert out.shape == (7, 24) and torch.isfinite(out).all() and (out == 0).all()


def test_bad_arguments_raise():
    dt, dev = kg.operand_dtype(device()), device()
    a = torch.zeros(4, 64, dtype=dt, device=dev)
    s = torch.ones((), device=dev)
    with pytest.raises(ValueError, match="K=64"):
        kg.w4a4_gemm(a, s, torch.zeros(8, 32, dtype=dt, device=dev), s)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        kg.w4a4_gemm(a.float(), s, a, s)
    with pytest.raises(TypeError, match="w_block_scales"):
        kg.w4a4_gemm(a, s, torch.zeros(8, 32, dtype=torch.uint8, device=dev), s)
    with pytest.raises(ValueError, match="epilogue"):
        kg.w4a4_gemm(a, s, a, s, epilogue="nope")
    with pytest.raises(ValueError, match="w_scale"):
        kg.w4a4_gemm(a, s, a, torch.ones(2, device=dev))


@triton.jit
def _decode_values_kernel(codes_ptr, scales_ptr, lo_ptr, hi_ptr, NC: tl.constexpr, NS: tl.constexpr):
    c = tl.load(codes_ptr + tl.arange(0, NC))[:, None]
    s = kg._scale_f16(tl.load(scales_ptr + tl.arange(0, NS)))[None, :]
    lo, hi = kg._codes_to_f16(c)
    offs = tl.arange(0, NC)[:, None] * NS + tl.arange(0, NS)[None, :]
    tl.store(lo_ptr + offs, lo * s)
    tl.store(hi_ptr + offs, hi * s)


def test_decode_dequant_is_exact_for_every_code_byte_and_scale():
    """fp16(e2m1 * 2^-14) * fp16(s_b * 2^7) == e2m1 * s_b * 2^-7 for all 256 code bytes (both nibbles)
    and all 127 finite unsigned E4M3 bytes (0x7f, NaN, never comes out of a quantizer)."""
    dev = device()
    codes = torch.arange(256, dtype=torch.uint8, device=dev)
    scales = torch.arange(128, dtype=torch.uint8, device=dev)
    lo = torch.empty(256, 128, dtype=torch.float16, device=dev)
    hi = torch.empty_like(lo)
    _decode_values_kernel[(1,)](codes, scales, lo, hi, NC=256, NS=128)
    e2m1 = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
    e2m1 = torch.cat([e2m1, -e2m1])
    sb = scales.cpu().view(torch.float8_e4m3fn).double()
    for got, nib in ((lo, codes.cpu() & 15), (hi, codes.cpu() >> 4)):
        want = e2m1[nib.long()][:, None] * sb[None, :] / 128.0
        assert torch.equal(got.cpu().double()[:, :127], want[:, :127])


DECODE_CASES = [  # (M, N, K, tile): the FMA path (M = 1), the MMA path, split-K, 3-D scale loads
    (1, 40, 128, dict(BM=1, BN=16, BK=32, SPLIT_K=1, SCALE_3D=False)),
    (1, 40, 128, dict(BM=1, BN=16, BK=32, SPLIT_K=2, SCALE_3D=True)),
    (5, 40, 128, dict(BM=16, BN=16, BK=32, SPLIT_K=1, SCALE_3D=False)),
    (5, 40, 128, dict(BM=16, BN=16, BK=32, SPLIT_K=4, SCALE_3D=True)),
]


@pytest.mark.parametrize("m, n, k, tile", DECODE_CASES)
def test_decode_kernel_matches_aligned_on_gaussian_data(m, n, k, tile):
    """Gaussian data: every fp32 sum is exact (FACTS.md 1.1), so the decode kernel's other K order
    gives the aligned path's bits, also on a second launch that reuses the split-K counters."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    xq, wq = nvfp4.quantize(x, "row"), nvfp4.quantize(w, "tensor")
    a, sa, wqd, sw = operands(xq, wq, device())
    want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wqd), sw, out_dtype=torch.float32)
    cfg = dict(tile, kernel="decode", num_warps=4, num_stages=1)
    for _ in range(2):  # the second launch checks that the split-K counters were reset
        got = kg.w4a4_gemm(a, sa, wqd.codes, sw, wqd.block_scales, out_dtype=torch.float32, config=cfg)
        assert torch.equal(got, want)


def test_decode_config_is_picked_by_padded_m_and_rejects_copies():
    for m, bm in ((1, 1), (2, 16), (16, 16), (17, 32), (64, 64)):
        assert kg.decode_config(m, 12288, 4096)["BM"] == bm
    cfg = kg.decode_config(1, 1024, 4096)
    assert cfg["SPLIT_K"] > 1 and 4096 % (cfg["SPLIT_K"] * cfg["BK"]) == 0
    with pytest.raises(ValueError, match="M <= 64"):
        kg.decode_config(65, 1024, 4096)
    dt, dev = kg.operand_dtype(device()), device()
    a, s = torch.zeros(2, 64, dtype=dt, device=dev), torch.ones((), device=dev)
    with pytest.raises(ValueError, match="packed"):
        kg.w4a4_gemm(a, s, a, s, config=dict(kg.decode_config(2, 64, 64), kernel="decode"))


@pytest.mark.gpu
def test_gpu_error_bound_against_reference():
    x, w = torch.randn(256, 4096), torch.randn(512, 4096)
    xq, wq = nvfp4.quantize(x, "row"), nvfp4.quantize(w, "tensor")
    want = rg.nvfp4_gemm(xq, wq, "sdec")
    a, sa, wqd, sw = operands(xq, wq, "cuda")
    for w_op, sb in ((kg.unscaled_copy(wqd), None), (wqd.codes, wqd.block_scales)):
        for config in ("aligned", "prefill"):
            got = kg.w4a4_gemm(a, sa, w_op, sw, sb, out_dtype=torch.float32, config=config).cpu()
            err = (got - want).abs().max() / want.abs().max()
            assert err <= REL_TOL, (config, float(err))
            assert (got == want).float().mean() >= MIN_EXACT_FRACTION_GAUSSIAN
    aligned = kg.w4a4_gemm(a, sa, wqd.codes, sw, wqd.block_scales, out_dtype=torch.float32).cpu()
    for m in (1, 8, 16, 32, 64):
        dec = kg.w4a4_gemm(a[:m], sa[:m], wqd.codes, sw, wqd.block_scales, out_dtype=torch.float32,
                           config="decode").cpu()
        assert (dec - want[:m]).abs().max() / want.abs().max() <= REL_TOL, m
        assert torch.equal(dec, aligned[:m]), m


@pytest.mark.gpu
def test_gpu_batch_invariance_aligned():
    """Rows bitwise equal across M in {1, 7, 64, 300, 4096} and both weight representations, on
    heavy-tailed data where accumulation order matters."""
    k, n = 4096, 1024
    x = heavy(4096, k, 2).cuda()
    wq = kq.quantize(heavy(n, k, 3).cuda(), "tensor")
    a, sa = kq.quantize_unscaled(x)
    copy = kg.unscaled_copy(wq)
    full = kg.w4a4_gemm(a, sa, copy, wq.global_scale)
    assert torch.isfinite(full.float()).all()
    for m in (1, 7, 64, 300, 4096):
        for rows in (slice(0, m), slice(4096 - m, 4096)):
            a_m, sa_m = kq.quantize_unscaled(x[rows])
            assert torch.equal(a_m, a[rows]) and torch.equal(sa_m, sa[rows])
            assert torch.equal(kg.w4a4_gemm(a_m, sa_m, copy, wq.global_scale), full[rows]), m
            packed = kg.w4a4_gemm(a_m, sa_m, wq.codes, wq.global_scale, wq.block_scales)
            assert torch.equal(packed, full[rows]), m
