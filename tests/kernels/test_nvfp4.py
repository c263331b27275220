"""The quantize kernel against `minite.ref.nvfp4`: bitwise for RNE (codes, block scales, S_dec, amax)."""

import pytest
import torch
import triton
import triton.language as tl

from minite import nvfp4
from minite.kernels import available
from minite.kernels import nvfp4 as kq
from tests.kernels.helpers import adversarial, device

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")

CASES = [("row", (1, 16), c) for c in ("te", "vllm", "torchao")] + \
        [("tensor", b, c) for b in ((1, 16), (16, 16)) for c in ("te", "vllm", "torchao")]


def assert_same(a: nvfp4.NVFP4Tensor, b: nvfp4.NVFP4Tensor) -> None:
    assert torch.equal(a.codes.cpu(), b.codes.cpu()), "codes differ"
    assert torch.equal(a.block_scales.view(torch.uint8).cpu(), b.block_scales.view(torch.uint8).cpu()), \
        "block scales differ"
    assert torch.equal(a.global_scale.cpu(), b.global_scale.cpu()), "global scales differ"
    assert torch.equal(a.amax.cpu(), b.amax.cpu()), "amax differs"


@pytest.mark.parametrize("scaling,block,chain", CASES)
def test_rne_bitwise_adversarial(scaling, block, chain):
    x = adversarial(16, 256)
    want = nvfp4.quantize(x, scaling, block, chain=chain)
    got = kq.quantize(x.to(device()), scaling, block, chain=chain)
    assert_same(want, got)


@pytest.mark.parametrize("chain", ["te", "vllm", "torchao"])
def test_static_scale_saturates_like_reference(chain):
    x = adversarial(16, 128, seed=1)
    s = float(x.abs().max()) / 2688.0 / 8.0  # 8x too small: block scales saturate at 448
    want = nvfp4.quantize(x, "static", chain=chain, static_scale=s)
    assert (want.block_scales.float() == 448.0).any()
    assert_same(want, kq.quantize(x.to(device()), "static", chain=chain, static_scale=s))


# bf16 is broken in the interpreter (docs/facts.md, "Triton on the CPU"): bf16 inputs are checked on
# the GPU only
@pytest.mark.parametrize("dtype", [torch.float16] + [torch.bfloat16] * torch.cuda.is_available())
def test_low_precision_input_and_leading_dims(dtype):
    x = adversarial(16, 64, seed=2).clamp(-6e4, 6e4).to(dtype).reshape(2, 8, 64)
    assert_same(nvfp4.quantize(x, "row"), kq.quantize(x.to(device()), "row"))


def test_hadamard_and_padding():
    """The rotation is a torch matmul on x's device, not part of the kernel: the reference runs on the
    same device (CPU and cuBLAS sum the 16 products in different orders)."""
    x = torch.randn(5, 40, device=device())
    want = nvfp4.quantize(x, "tensor", hadamard=True, pad=True, backend="ref")
    assert_same(want, kq.quantize(x, "tensor", hadamard=True, pad=True))


def test_fused_activation_values_are_exact():
    x = adversarial(8, 128, seed=3)
    dt = torch.float16 if device() == "cpu" else torch.bfloat16
    vals, sdec, codes, sb, amax = kq.quantize_unscaled(x.to(device()), dt, return_codes=True)
    q = nvfp4.quantize(x, "row")
    assert vals.dtype == dt
    assert torch.equal(vals.float().cpu(), q.unscaled())
    assert torch.equal(sdec.cpu(), q.global_scale) and torch.equal(amax.cpu(), q.amax)
    assert torch.equal(codes.cpu(), q.codes) and torch.equal(sb.view(torch.uint8).cpu(),
                                                             q.block_scales.view(torch.uint8))


def test_stochastic_rounding_picks_a_neighbour_and_is_unbiased():
    x = (torch.rand(16, 256) * 2 - 1) * 3.0
    x[:, :16] = 3.0 * torch.sign(x[:, :16])  # every block amax is 3: fixed scales
    rne = nvfp4.quantize(x, "tensor")
    g = torch.Generator(device=device()).manual_seed(0)
    sr = kq.quantize(x.to(device()), "tensor", rounding="stochastic", generator=g)
    assert torch.equal(rne.block_scales.view(torch.uint8), sr.block_scales.view(torch.uint8).cpu())
    d_sr, d_rne = nvfp4.dequantize(sr.to("cpu")), nvfp4.dequantize(rne)
    step = 2.0 * rne.block_scales.float().repeat_interleave(16, -1) * rne.global_scale
    assert ((d_sr - x).abs() <= step * 1.0001).all()
    assert (d_sr != d_rne).any()
    bias = (d_sr - x).mean() / x.abs().mean()
    assert bias.abs() < 0.02


def test_bad_input_raises():
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        kq.quantize_packed(torch.zeros(4, 32, dtype=torch.int32, device=device()))
    with pytest.raises(ValueError, match="multiple of 16"):
        kq.quantize_packed(torch.zeros(4, 20, device=device()))
    with pytest.raises(ValueError, match="row count divisible by 16"):
        kq.quantize_packed(torch.zeros(4, 32, device=device()), block=(16, 16))
    with pytest.raises(ValueError, match="non-finite"):
        kq.quantize(torch.tensor([[float("nan")] * 16], device=device()))


@pytest.mark.gpu
@pytest.mark.parametrize("scaling,block,chain", CASES)
def test_gpu_rne_bitwise_large(scaling, block, chain):
    x = adversarial(512, 4096, seed=4)
    x[64:] *= torch.logspace(-30, 30, 448)[:, None]
    want = nvfp4.quantize(x, scaling, block, chain=chain)
    assert_same(want, kq.quantize(x.cuda(), scaling, block, chain=chain))


@pytest.mark.gpu
def test_gpu_fused_bf16_values_exact():
    x = adversarial(256, 4096, seed=5).bfloat16()
    vals, sdec = kq.quantize_unscaled(x.cuda())
    q = nvfp4.quantize(x, "row")
    assert torch.equal(vals.float().cpu(), q.unscaled()) and torch.equal(sdec.cpu(), q.global_scale)


def test_row_scaling_two_pass_path(monkeypatch):
    """Rows longer than MAX_K are read twice (amax pass, then quantize pass): same bits."""
    monkeypatch.setitem(kq.CONFIGS, "1x16", dict(kq.CONFIGS["1x16"], MAX_K=64, CHUNK_K=64))
    x = adversarial(8, 256, seed=6)
    assert_same(nvfp4.quantize(x, "row"), kq.quantize(x.to(device()), "row"))
    vals, sdec = kq.quantize_unscaled(x.to(device()), kg_dtype())
    assert torch.equal(vals.float().cpu(), nvfp4.quantize(x, "row").unscaled())


def kg_dtype():
    return torch.float16 if device() == "cpu" else torch.bfloat16


@pytest.mark.parametrize("two_pass", [False, True])
def test_row_scaling_marks_non_finite_rows_nan(two_pass, monkeypatch):
    """The kernels never raise on inf/NaN (that would sync with the host): such a row gets S_dec and
    amax NaN, the other rows their usual bits; in both the one- and the two-pass paths."""
    if two_pass:
        monkeypatch.setitem(kq.CONFIGS, "1x16", dict(kq.CONFIGS["1x16"], MAX_K=32, CHUNK_K=32))
    x = adversarial(8, 128, seed=7)
    bad = x.clone()
    bad[1, 100] = float("nan")
    bad[3, 5] = float("-inf")
    bad[6, 0] = float("inf")
    good = [0, 2, 4, 5, 7]
    vals, sdec = kq.quantize_unscaled(bad.to(device()), kg_dtype())
    _, _, s, amax = kq.quantize_packed(bad.to(device()), "row")
    for t in (sdec, s, amax):
        t = t.reshape(-1).cpu()
        assert t[[1, 3, 6]].isnan().all() and torch.isfinite(t[good]).all()
    want = nvfp4.quantize(x[good], "row")
    assert torch.equal(vals[good].float().cpu(), want.unscaled())
    assert torch.equal(sdec[good].cpu(), want.global_scale)


def _e2m1_probe_values() -> torch.Tensor:
    """fp32 values around every E2M1 tie and grid point (+-64 ulps), subnormals, zeros, huge and inf."""
    pts = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0])
    bits = pts.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)[None, :]
    near = bits.reshape(-1).view(torch.float32)
    rest = torch.tensor([0.0, 1e-45, 1e-38, 3e38, float("inf"), float("nan")])
    g = torch.Generator().manual_seed(0)
    rand = torch.rand(4096, generator=g) * 8.0
    v = torch.cat([near, rest, rand])
    return torch.cat([v, -v])


@triton.jit
def _e2m1_probe_kernel(v_ptr, out_ptr, n, HW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, kq._e2m1_rne(v, v, HW), mask=offs < n)


def test_e2m1_rounding_matches_reference_thresholds():
    """The kernels' E2M1 rounding (three fmas, three mins) is the reference's thresholds exactly, around
    every tie and grid point, for NaN (saturates) and for the sign."""
    from minite.ref import nvfp4 as ref

    v = _e2m1_probe_values()
    codes = torch.empty(v.shape, dtype=torch.int32, device=device())
    _e2m1_probe_kernel[(triton.cdiv(v.numel(), 1024),)](v.to(device()), codes, v.numel(),
                                                        HW=device() == "cuda", BLOCK=1024)
    assert torch.equal(codes.cpu().to(torch.uint8), ref.e2m1_rne(v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling,chain", [("row", "te"), ("row", "vllm"), ("row", "torchao"),
                                           ("tensor", "te"), ("static", "vllm")])
def test_pair_path_bitwise(dtype, scaling, chain, monkeypatch):
    """16-bit inputs take the pair kernel (x read as int32 words): same bits as the reference, codes and
    fused values, whole rows (a grid this small takes 8 rows a program for values, 4 for codes: 22
    rows end ragged; 96 words padded to 128: masked) and rows looped over in chunks."""
    from minite.kernels.nvfp4 import pairs as nvfp4_pairs

    x = adversarial(22, 192, seed=8).clamp(-6e4, 6e4).to(dtype)
    static = float(x.float().abs().max()) / 2688.0 if scaling == "static" else None
    want = nvfp4.quantize(x, scaling, chain=chain, static_scale=static)
    calls = []
    monkeypatch.setattr(nvfp4_pairs, "_pairs_kernel", _spy(nvfp4_pairs._pairs_kernel, calls))
    assert_same(want, kq.quantize(x.to(device()), scaling, chain=chain, static_scale=static))
    assert calls, "the pair kernel did not run"
    if scaling == "row":
        out = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
        vals, sdec, codes, sb, amax = kq.quantize_unscaled(x[:21].to(device()), out, chain, return_codes=True)
        q = nvfp4.quantize(x[:21], "row", chain=chain)
        assert torch.equal(vals.float().cpu(), q.unscaled()) and torch.equal(sdec.cpu(), q.global_scale)
        assert torch.equal(codes.cpu(), q.codes)
    else:  # rows longer than MAX_WORDS: tensor/static scaling loops over 32-word chunks
        monkeypatch.setitem(nvfp4_pairs.CONFIG, "MAX_WORDS", 64)
        monkeypatch.setitem(nvfp4_pairs.CONFIG, "CHUNK_WORDS", 32)
        calls.clear()
        assert_same(want, kq.quantize(x.to(device()), scaling, chain=chain, static_scale=static))
        assert calls, "the pair kernel did not run"


def test_pair_path_falls_back_on_unaligned_views():
    """A view starting half a word in (odd element offset) goes to the general kernel: same bits."""
    x = adversarial(8, 66, seed=9).to(torch.float16)[:, 1:65]  # 64 columns from element 1
    assert x.data_ptr() % 4 != 0 or x.stride(0) % 2
    assert_same(nvfp4.quantize(x, "row"), kq.quantize(x.to(device()), "row"))


def _spy(kernel, calls):
    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return kernel[grid]
    return Spy()


def test_hadamard_low_precision_input_is_rotated_in_its_dtype():
    """fp16 input (bf16 on the GPU): the kernel quantizes TE's rotated values rounded to the input
    dtype, the reference's bits."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float16
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = nvfp4.quantize(x, "tensor", hadamard=True, backend="ref")
    assert_same(want, kq.quantize(x.to(device()), "tensor", hadamard=True))
