"""The MoE grouped GEMM against the per-expert reference GEMM."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available
from minite.kernels import gemm as kg
from minite.kernels import grouped_gemm as gg
from minite.ref import gemm as rg
from tests.kernels.helpers import device

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def case(counts, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts)
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    x = torch.randn(int(counts.sum()), k, generator=g) ** 3
    wqs = [nvfp4.quantize(torch.randn(n, k, generator=g), "tensor") for _ in counts]
    parts = [rg.nvfp4_gemm(nvfp4.quantize(x[offsets[e]:offsets[e + 1]], "row"), wqs[e])
             if c else torch.zeros(0, n) for e, c in enumerate(counts.tolist())]
    return x, wqs, offsets, torch.cat(parts)


def run(x, wqs, offsets, packed, dev, config="prefill", out_dtype=torch.float32):
    xq = nvfp4.quantize(x, "row").to(dev)
    a = xq.unscaled().to(kg.operand_dtype(dev))
    sw = torch.stack([q.global_scale for q in wqs]).to(dev)
    if packed:
        w = torch.stack([q.codes for q in wqs]).to(dev)
        sb = torch.stack([q.block_scales for q in wqs]).to(dev)
    else:
        w, sb = torch.stack([kg.unscaled_copy(q.to(dev)) for q in wqs]), None
    return gg.grouped_w4a4_gemm(a, xq.global_scale.reshape(-1), w, sw, offsets.to(dev), sb,
                                out_dtype=out_dtype, config=config).cpu()


@pytest.mark.parametrize("packed", [False, True])
def test_matches_per_expert_reference_with_empty_experts(packed):
    x, wqs, offsets, want = case([7, 0, 20, 1, 0, 12], 32, 64)
    assert torch.equal(run(x, wqs, offsets, packed, device()), want)


def test_tma_kernel_gives_the_pointer_kernels_bits():
    """Operands by TMA: row tiles that run into the next expert's rows and an N (40) that is not a
    multiple of BN (reads into the next expert's weight rows) are masked; the same bits as pointer
    loads, empty experts included."""
    x, wqs, offsets, want = case([7, 0, 20, 1, 0, 12], 40, 64, seed=3)
    tile = (dict(gg.CONFIGS["interpret"]) if device() == "cpu"
            else dict(BM=64, BN=32, BK=64, num_warps=4, num_stages=3))
    pointer = run(x, wqs, offsets, False, device(), tile)
    assert torch.equal(run(x, wqs, offsets, False, device(), dict(tile, TMA=True)), pointer)
    assert (pointer - want).abs().max() <= 1e-5 * want.abs().max()


def test_bad_offsets_raise():
    a = torch.zeros(4, 64, dtype=kg.operand_dtype(device()), device=device())
    w = torch.zeros(2, 8, 64, dtype=a.dtype, device=device())
    with pytest.raises(ValueError, match="offsets"):
        gg.grouped_w4a4_gemm(a, torch.ones(4, device=device()), w, torch.ones(2, device=device()),
                             torch.tensor([0, 4], device=device()))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["prefill", "aligned"])
def test_gpu_matches_per_expert_reference(config):
    torch.manual_seed(0)
    counts = torch.multinomial(torch.ones(16), 700, replacement=True).bincount(minlength=16)
    counts[3] = 0
    x, wqs, offsets, want = case(counts.tolist(), 256, 512)
    for packed in (False, True):
        got = run(x, wqs, offsets, packed, "cuda", config)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert (got == want).float().mean() > 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [300, 2048])
def test_gpu_grouped_aligned_gives_each_expert_the_dense_aligned_bits(tokens):
    """300 rows over 16 experts take the `aligned` tile, 2048 the `aligned_large` one (>= 64 rows per
    expert): either way each expert's rows get the bits of a dense aligned GEMM of just those rows
    (itself on the small tile): the tile shape partitions outputs, never a row's sum."""
    assert (tokens >= gg.ALIGNED_LARGE_ROWS_PER_EXPERT * 16) == (tokens == 2048)
    torch.manual_seed(1)
    counts = torch.multinomial(torch.ones(16), tokens, replacement=True).bincount(minlength=16)
    x, wqs, offsets, _ = case(counts.tolist(), 256, 512)
    got = run(x, wqs, offsets, False, "cuda", "aligned")
    xq = nvfp4.quantize(x, "row").to("cuda")
    a, sa = xq.unscaled().to(torch.bfloat16), xq.global_scale.reshape(-1)
    for e, q in enumerate(wqs):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            q = q.to("cuda")
            dense = kg.w4a4_gemm(a[lo:hi], sa[lo:hi], kg.unscaled_copy(q), q.global_scale,
                                 out_dtype=torch.float32)
            assert torch.equal(dense.cpu(), got[lo:hi]), e


@pytest.mark.gpu
@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_persistent_tma_kernel_gives_one_tile_per_program_bits(flatten, out_dtype):
    """More tiles (4 N tiles x ~80 row tiles) than programs (one per SM): the persistent loop walks
    every expert's tiles, an empty expert included, in the dense K order (fp32 outputs run unflattened:
    `gemm.flatten`)."""
    torch.manual_seed(2)
    counts = torch.multinomial(torch.ones(16), 8192, replacement=True).bincount(minlength=16)
    counts[5] = 0
    x, wqs, offsets, want = case(counts.tolist(), 1024, 256)
    tile = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3, TMA=True)
    one_each = run(x, wqs, offsets, False, "cuda", tile, out_dtype)
    persistent = run(x, wqs, offsets, False, "cuda", dict(tile, PERSIST=1, FLATTEN=flatten), out_dtype)
    assert torch.equal(persistent, one_each)
    assert (one_each.float() - want).abs().max() <= 1e-2 * want.abs().max()
