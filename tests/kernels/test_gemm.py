"""The W4A4 GEMM kernels against `minite.ref.gemm`, and the aligned path's batch invariance."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available
from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq
from minite.ref import gemm as rg
from tests.kernels.helpers import device

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")

# fp32 accumulation across 16-blocks in another order: relative to the output scale
REL_TOL = 1e-5
# Gaussian data: almost every fp32 sum is exact (docs/facts.md), so almost every output is bitwise equal
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


def test_tma_kernel_gives_the_pointer_kernels_bits():
    """The TMA kernel (operands by tensor descriptors; persistent on the GPU) keeps the pointer kernel's
    K order: the same bits on heavy-tailed data, ragged M and N; unaligned operands fall back."""
    x, w = heavy(300 if device() == "cuda" else 40, 256, 4), heavy(96, 256, 5)
    xq, wq = nvfp4.quantize(x, "row"), nvfp4.quantize(w, "tensor")
    a, sa, wqd, sw = operands(xq, wq, device())
    copy = kg.unscaled_copy(wqd)
    tile = dict(kg.CONFIGS["interpret"]) if device() == "cpu" else dict(BM=64, BN=64, BK=64, GROUP_M=4,
                                                                        num_warps=4, num_stages=3)
    want = kg.w4a4_gemm(a, sa, copy, sw, out_dtype=torch.float32, config=tile)
    variants = [dict(PERSIST=0)] + ([dict(PERSIST=1), dict(PERSIST=1, FLATTEN=True)] if device() == "cuda"
                                    else [])
    for v in variants:
        got = kg.w4a4_gemm(a, sa, copy, sw, out_dtype=torch.float32, config=dict(tile, TMA=True, **v))
        assert torch.equal(got, want), v
    shifted = torch.empty(a.shape[0], a.shape[1] + 1, dtype=a.dtype, device=a.device)[:, 1:]
    shifted.copy_(a)  # 2-byte offset rows: not TMA-able
    assert not kg._tma_ok(shifted, copy) and kg._tma_ok(a, copy)
    got = kg.w4a4_gemm(shifted, sa, copy, sw, out_dtype=torch.float32, config=dict(tile, TMA=True, PERSIST=0))
    assert torch.equal(got, want)


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
@pytest.mark.parametrize("n", [1024, 4096])
def test_gpu_batch_invariance_aligned(n):
    """Rows bitwise equal across M in {1, 7, 64, 300, 512, 1024, 4096} (every `aligned` tile: at 512
    rows N = 1024 fits one wave, 4096 does not) and both weight representations, on heavy-tailed data
    where accumulation order matters."""
    k = 4096
    x = heavy(4096, k, 2).cuda()
    wq = kq.quantize(heavy(n, k, 3).cuda(), "tensor")
    a, sa = kq.quantize_unscaled(x)
    copy = kg.unscaled_copy(wq)
    full = kg.w4a4_gemm(a, sa, copy, wq.global_scale)
    assert torch.isfinite(full.float()).all()
    for m in (1, 7, 64, 300, 512, 1024, 4096):
        for rows in (slice(0, m), slice(4096 - m, 4096)):
            a_m, sa_m = kq.quantize_unscaled(x[rows])
            assert torch.equal(a_m, a[rows]) and torch.equal(sa_m, sa[rows])
            assert torch.equal(kg.w4a4_gemm(a_m, sa_m, copy, wq.global_scale), full[rows]), m
            packed = kg.w4a4_gemm(a_m, sa_m, wq.codes, wq.global_scale, wq.block_scales)
            assert torch.equal(packed, full[rows]), m


@pytest.mark.gpu
def test_gpu_persistent_tile_takes_fp32_outputs():
    """More tiles than SMs on the large tile (persistent, flattened for bf16): an fp32 output fits in
    shared memory (run unflattened) and rounds to the bf16 output."""
    x, w = heavy(4096, 512, 4).cuda(), kq.quantize(heavy(2048, 512, 5).cuda(), "tensor")
    a, sa = kq.quantize_unscaled(x)
    copy = kg.unscaled_copy(w)
    out16 = kg.w4a4_gemm(a, sa, copy, w.global_scale)
    out32 = kg.w4a4_gemm(a, sa, copy, w.global_scale, out_dtype=torch.float32)
    assert torch.equal(out32.to(torch.bfloat16), out16)


def test_tma_allocator_is_set_per_thread_and_never_overrides_a_callers():
    """Triton's allocator is a ContextVar: a thread without one gets ours at its first TMA launch; an
    allocator the caller set stays."""
    import threading

    import triton
    from triton.runtime import _allocation

    a = torch.ones(16, 64, dtype=kg.operand_dtype(device()), device=device())
    w = torch.ones(32, 64, dtype=a.dtype, device=device())
    one = torch.ones((), device=device())
    tile = dict(kg.CONFIGS["interpret"], TMA=True, PERSIST=0)
    seen = {}

    def fresh_thread():
        seen["before"] = _allocation._allocator.get()
        kg.w4a4_gemm(a, one.reshape(1), w, one, config=tile)
        seen["after"] = _allocation._allocator.get()

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join()
    assert isinstance(seen["before"], _allocation.NullAllocator) and seen["after"] is kg._torch_scratch

    def mine(size, alignment, stream):
        return torch.empty(size, dtype=torch.int8, device=device())

    def callers_thread():
        triton.set_allocator(mine)
        kg.w4a4_gemm(a, one.reshape(1), w, one, config=tile)
        seen["kept"] = _allocation._allocator.get()

    t = threading.Thread(target=callers_thread)
    t.start()
    t.join()
    assert seen["kept"] is mine
