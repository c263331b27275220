"""The MoE grouped decode GEMM (packed expert weights in the decode layout, few rows per expert): the
per-expert reference, and the aligned path's bits (its K order is the aligned one)."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available, interpreted
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels import grouped_decode as gd
from tests.kernels.helpers import device
from tests.kernels.test_gemm import heavy
from tests.kernels.test_grouped_gemm import case, run

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def tile(bm, halves=False):
    """The tile of BM rows (HALVES: from a 2 BM-row tile, whose short row tiles run BM-row MMAs)."""
    cfg = dict(next(t for _, t in gd.GROUPED_DECODE_TILES if t["BM"] == bm), HALVES=halves)
    if halves:
        cfg.update(BM=2 * bm)
    if interpreted():
        cfg.update(BN=32, BK=64, num_stages=1)
    return cfg


def decode_run(x, wqs, offsets, dev, config=None):
    xq = nvfp4.quantize(x, "row").to(dev)
    a = xq.unscaled().to(kg.operand_dtype(dev))
    codes = torch.stack([q.codes for q in wqs]).to(dev)
    sb = torch.stack([q.block_scales for q in wqs]).to(dev)
    w = kd.pack_weight(codes, sb, a.dtype)
    sw = torch.stack([q.global_scale for q in wqs]).to(dev)
    return gd.grouped_decode_gemm(a, xq.global_scale.reshape(-1), w, sw, offsets.to(dev),
                                  out_dtype=torch.float32, config=config).cpu()


@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("bm", [16, 32, 64])
def test_matches_per_expert_reference_and_aligned_with_empty_and_split_experts(bm, halves):
    """70 rows of one expert take several row tiles at every BM; empty experts take none; with
    halves, tiles of <= BM rows run the half-height MMAs and the others the full ones."""
    x, wqs, offsets, want = case([7, 0, 20, 1, 0, 12, 70], 96, 128)
    got = decode_run(x, wqs, offsets, device(), tile(bm, halves))
    assert torch.equal(got, want)
    assert torch.equal(got, run(x, wqs, offsets, False, device(), "aligned"))


def test_rows_read_through_an_index_equal_the_gathered_rows():
    """`rows`: each sorted row read from the token rows where an expert takes it (tokens repeated, out
    of order), row scales with them: bitwise the kernel on the gathered copy."""
    dev = device()
    torch.manual_seed(3)
    tokens = torch.randn(9, 128) * 3
    src = torch.tensor([4, 0, 8, 4, 2, 7, 7, 1, 3, 0, 5, 6, 8, 2, 4])  # 15 rows over 4 experts
    offsets = torch.tensor([0, 6, 6, 11, 15])
    _, wqs, _, _ = case([6, 0, 5, 4], 96, 128)
    xq = nvfp4.quantize(tokens, "row").to(dev)
    a, sa = xq.unscaled().to(kg.operand_dtype(dev)), xq.global_scale.reshape(-1)
    w = kd.pack_weight(torch.stack([q.codes for q in wqs]).to(dev),
                       torch.stack([q.block_scales for q in wqs]).to(dev), a.dtype)
    sw = torch.stack([q.global_scale for q in wqs]).to(dev)
    idx = src.to(dev)
    got = gd.grouped_decode_gemm(a, sa, w, sw, offsets.to(dev), out_dtype=torch.float32, rows=idx)
    want = gd.grouped_decode_gemm(a[idx], sa[idx], w, sw, offsets.to(dev), out_dtype=torch.float32)
    assert got.shape == (15, 96) and torch.equal(got, want)
    with pytest.raises(ValueError, match="rows must be"):
        gd.grouped_decode_gemm(a, sa, w, sw, offsets.to(dev), rows=idx.float())


def test_config_follows_the_average_rows_per_expert():
    cfgs = [gd.grouped_decode_config(t, 128) for t in (128, 512, 1024, 2048, 4096, 8192)]
    assert [(c["BM"], c.get("HALVES", False)) for c in cfgs] == [
        (16, False), (16, False), (16, False), (32, True), (64, True), (64, True)]
    assert gd.grouped_decode_config(1024, 128, 2048)["BK"] == (64 if interpreted() else 256)
    assert gd.grouped_decode_config(1024, 128, 768)["BM"] == 32  # short K: the 32-row tile
    assert gd.grouped_decode_config(1024, 128, 96)["BK"] == 32  # BK halves until it divides K
    assert gd.grouped_decode_config(8, 1, 768, 2048)["BM"] == 16  # one weight keeps the 16-row tile
    # one weight (`decode_gemm_rows`): 128-row tiles from 2048 rows, or from 512 on N >= 4096
    wide = [gd.grouped_decode_config(m, 1, 2048, n)["BM"] for m, n in ((512, 2048), (512, 4096), (2048, 512),
                                                                      (128, 12288))]
    assert wide == [64, 128, 128, 64]
    assert gd.grouped_decode_config(4096, 128, 2048, 4096)["BM"] == 64  # experts keep their tiles
    # below that, a grid of few programs narrows: BN 64 under NARROW_N programs, then BM 32 under NARROW_M
    narrow = [gd.grouped_decode_config(m, 1, 2048, n) for m, n in ((128, 2048), (256, 2048), (256, 12288))]
    assert [c["BM"] for c in narrow] == [32, 64, 64]
    if not interpreted():
        assert [c["BN"] for c in narrow] == [64, 64, 128]
    assert gd.grouped_decode_config(1024, 16, 2048, 2048)["BM"] == 64  # experts never narrow


def test_bad_arguments_raise():
    dev = device()
    x, wqs, offsets, _ = case([3, 5], 32, 128)
    xq = nvfp4.quantize(x, "row").to(dev)
    a = xq.unscaled().to(kg.operand_dtype(dev))
    codes = torch.stack([q.codes for q in wqs]).to(dev)
    sb = torch.stack([q.block_scales for q in wqs]).to(dev)
    sw = torch.ones(2, device=dev)
    w = kd.pack_weight(codes, sb, a.dtype)
    sa = xq.global_scale.reshape(-1)
    with pytest.raises(ValueError, match="experts"):
        gd.grouped_decode_gemm(a, sa, kd.pack_weight(codes[0], sb[0], a.dtype), sw,
                               offsets.to(dev))
    with pytest.raises(ValueError, match="must divide"):
        gd.grouped_decode_gemm(a, sa, w, sw, offsets.to(dev), config=dict(tile(16), BK=96))
    with pytest.raises(ValueError, match="offsets"):
        gd.grouped_decode_gemm(a, sa, w, sw, offsets[:2].to(dev))
    with pytest.raises(ValueError, match="w_scale"):
        gd.grouped_decode_gemm(a, sa, w, sw[:1], offsets.to(dev))
    with pytest.raises(ValueError, match="a must be"):
        gd.grouped_decode_gemm(a[:, :64], sa, w, sw, offsets.to(dev))
    with pytest.raises(ValueError, match="2D weight"):
        kd.decode_gemm(a, sa, w, sw[:1])


def heavy_experts(counts, n, k, seed):
    """Heavy-tailed rows and expert weights, where the fp32 accumulation order shows in the bits."""
    x = heavy(sum(counts), k, seed)
    wqs = [nvfp4.quantize(heavy(n, k, seed + 1 + e), "tensor") for e in range(len(counts))]
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    return x, wqs, offsets


@pytest.mark.gpu
@pytest.mark.parametrize("halves", [False, True])
@pytest.mark.parametrize("bm", [16, 32, 64])
def test_gpu_grouped_decode_gives_the_aligned_bits_on_heavy_tailed_data(bm, halves):
    """Every BM, rows spread over 16 experts (some empty, some over several row tiles), K = 768 (the
    MoE down projection's): bitwise the grouped aligned kernel on the bf16 copy."""
    torch.manual_seed(2)
    counts = torch.multinomial(torch.ones(16), 400, replacement=True).bincount(minlength=16)
    counts[5] = 0
    x, wqs, offsets = heavy_experts(counts.tolist(), 192, 768, 10)
    got = decode_run(x, wqs, offsets, "cuda", tile(bm, halves))
    assert torch.isfinite(got).all()
    assert torch.equal(got, run(x, wqs, offsets, False, "cuda", "aligned"))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16, 40, 64])
def test_gpu_decode_without_split_k_is_the_aligned_order_at_every_k_step(m):
    """The decode loop without split-K gives the aligned path's bits on heavy-tailed data at every BK
    (the same k16 MMA steps into one accumulator), while split-K differs somewhere on the same data:
    the data tells K orders apart."""
    k, n = 4096, 512
    xq = nvfp4.quantize(heavy(m, k, 4).cuda(), "row")
    wq = nvfp4.quantize(heavy(n, k, 5).cuda(), "tensor")
    a, sa = xq.unscaled().to(torch.bfloat16), xq.global_scale.reshape(-1)
    aligned = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq), wq.global_scale, out_dtype=torch.float32)
    dw = kd.pack_weight(wq.codes, wq.block_scales)
    for bk in (64, 128, 256):
        cfg = dict(kd.aligned_decode_config(m, k), BK=bk)
        assert torch.equal(kd.decode_gemm(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=cfg),
                           aligned), bk
    split = dict(kd.aligned_decode_config(m, k), SPLIT_K=4)
    assert not torch.equal(kd.decode_gemm(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=split),
                           aligned)


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("m", [1, 24, 150])
def test_dense_weight_at_any_row_count_gives_the_aligned_bits(m, wide):
    """`decode_gemm_rows`: one weight, its rows in several row tiles above 64 (or 128: the wide tile),
    bitwise the dense aligned GEMM on the bf16 copy (heavy-tailed data, where the K order shows)."""
    dev = device()
    k, n = 256, 96
    xq = nvfp4.quantize(heavy(m, k, 7).to(dev), "row")
    wq = nvfp4.quantize(heavy(n, k, 8).to(dev), "tensor")
    a, sa = xq.unscaled().to(kg.operand_dtype(dev)), xq.global_scale.reshape(-1)
    want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq).to(a.dtype), wq.global_scale, out_dtype=torch.float32)
    dw = kd.pack_weight(wq.codes, wq.block_scales, a.dtype)
    cfg = None
    if wide:
        cfg = dict(gd.WIDE_ROWS_TILE, **(dict(BN=32, BK=64, num_stages=1) if interpreted() else {}))
    got = gd.decode_gemm_rows(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=cfg)
    assert got.shape == (m, n) and torch.equal(got, want)
    with pytest.raises(ValueError, match="one weight"):
        gd.decode_gemm_rows(a, sa, kd.pack_weight(wq.codes[None], wq.block_scales[None], a.dtype),
                            wq.global_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [65, 512, 3000])
def test_gpu_dense_weight_at_any_row_count_gives_the_aligned_bits(m):
    """`decode_gemm_rows` at an attention projection's shape: bitwise the dense aligned GEMM."""
    k, n = 2048, 640
    xq = nvfp4.quantize(heavy(m, k, 9).cuda(), "row")
    wq = nvfp4.quantize(heavy(n, k, 10).cuda(), "tensor")
    a, sa = xq.unscaled().to(torch.bfloat16), xq.global_scale.reshape(-1)
    want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq), wq.global_scale, out_dtype=torch.float32)
    got = gd.decode_gemm_rows(a, sa, kd.pack_weight(wq.codes, wq.block_scales), wq.global_scale,
                              out_dtype=torch.float32)
    assert torch.isfinite(got).all() and torch.equal(got, want)
