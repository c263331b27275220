"""The aligned K order in chunks (`ref.gemm.k_chunk`): a dense weight's K cut into chunks, each summed
from zero, the chunk sums added in order. Every kernel that claims the aligned bits gets the same ones
whether it runs the chunks in separate programs (split-K) or one after another: the learner's tiles
(bf16 copy and packed), the decode kernel, the row tiles and the segmented launches. CPU tests take a
small chunk (KC in the config) so that the interpreter runs several at tiny shapes."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available, interpreted
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from minite.kernels import grouped_decode as gd
from minite.ref import gemm as ref
from tests.kernels.helpers import device
from tests.kernels.test_gemm import heavy

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def test_chunk_rule_cuts_k_into_1024_column_chunks_from_two_chunks_on():
    assert [ref.k_chunk(k) for k in (64, 768, 1024, 1536, 2048, 3072, 4096, 6144)] == [
        64, 768, 1024, 1536, 1024, 1024, 1024, 1024]


def test_reference_chunked_matmul_adds_the_chunk_products_in_order():
    a, b = heavy(5, 256, 1), heavy(256, 7, 2)
    want = a[:, :128] @ b[:128] + a[:, 128:] @ b[128:]
    assert torch.equal(ref.chunked_matmul(a, b, 128), want)
    assert torch.equal(ref.chunked_matmul(a, b, 256), a @ b)


def _case(m, n, k, dev):
    xq = nvfp4.quantize(heavy(m, k, 7).to(dev), "row")
    wq = nvfp4.quantize(heavy(n, k, 8).to(dev), "tensor")
    a, sa = xq.unscaled().to(kg.operand_dtype(dev)), xq.global_scale.reshape(-1)
    return a, sa, wq


def _learner(a, sa, wq, kc, packed=False):
    cfg = dict(kg.pick_config("aligned", a.shape[0], wq.shape[0]), KC=kc)
    if packed:
        return kg.w4a4_gemm(a, sa, wq.codes, wq.global_scale, wq.block_scales, out_dtype=torch.float32,
                            config=cfg)
    return kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq).to(a.dtype), wq.global_scale, out_dtype=torch.float32,
                        config=cfg)


def _tile(cfg):
    return dict(cfg, **(dict(BN=32, BK=64, num_stages=1) if interpreted() else {}))


@pytest.mark.parametrize("m", [3, 40])
def test_decode_kernel_gives_the_learner_bits_with_chunks_split_or_in_one_program(m):
    dev = device()
    k, n, kc = 256, 96, 64
    a, sa, wq = _case(m, n, k, dev)
    want = _learner(a, sa, wq, kc)
    assert torch.equal(_learner(a, sa, wq, kc, packed=True), want)
    dw = kd.pack_weight(wq.codes, wq.block_scales, a.dtype)
    for split in (1, k // kc):
        cfg = dict(kd.aligned_decode_config(m, k), KC=kc, SPLIT_K=split, BK=64)
        for _ in range(2):  # the second launch finds the split counters reset
            got = kd.decode_gemm(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=cfg)
            assert torch.equal(got, want), split


@pytest.mark.parametrize("m", [24, 150])
def test_row_tiles_give_the_learner_bits_with_chunks_split_or_in_one_program(m):
    dev = device()
    k, n, kc = 256, 96, 64
    a, sa, wq = _case(m, n, k, dev)
    want = _learner(a, sa, wq, kc)
    dw = kd.pack_weight(wq.codes, wq.block_scales, a.dtype)
    base = _tile(gd.GROUPED_DECODE_TILES[-1][1])
    for split in (1, k // kc):
        cfg = dict(base, KC=kc, SPLIT_K=split)
        for _ in range(2):
            got = gd.decode_gemm_rows(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=cfg)
            assert torch.equal(got, want), split


def test_segmented_launches_split_by_chunk_give_each_weights_own_bits():
    dev = device()
    k, kc, widths = 256, 64, (128, 64, 64)
    xq = nvfp4.quantize(heavy(20, k, 11).to(dev), "row")
    a, sa = xq.unscaled().to(kg.operand_dtype(dev)), xq.global_scale.reshape(-1)
    wqs = [nvfp4.quantize((heavy(n, k, 3 + j) * 10.0 ** (2 * j - 2)).to(dev), "tensor")
           for j, n in enumerate(widths)]
    layouts = [kd.pack_weight(q.codes, q.block_scales, a.dtype) for q in wqs]
    w = kd.DecodeWeight(torch.cat([x.codes for x in layouts]), torch.cat([x.scales for x in layouts]),
                        sum(widths))
    sws = torch.stack([q.global_scale.reshape(()).float() for q in wqs])
    wants = [_learner(a, sa, q, kc) for q in wqs]
    split = dict(KC=kc, SPLIT_K=k // kc)
    decode = kd.decode_gemm_segments(a, sa, w, sws, widths, out_dtype=torch.float32,
                                     config=dict(kd.aligned_decode_config(20, k), BK=64, **split))
    rows = gd.decode_rows_segments(a, sa, w, sws, widths, out_dtype=torch.float32,
                                   config=dict(_tile(gd.GROUPED_DECODE_TILES[-1][1]), **split))
    for j, want in enumerate(wants):
        assert torch.equal(decode[j], want) and torch.equal(rows[j], want), j


def test_configs_split_a_narrow_weight_by_its_chunks_and_keep_experts_whole():
    k = 4096
    narrow, wide = kd.aligned_decode_config(16, k, 2048), kd.aligned_decode_config(16, k, 65536)
    assert (narrow["KC"], narrow["SPLIT_K"]) == (1024, 4) and (wide["KC"], wide["SPLIT_K"]) == (1024, 1)
    assert kd.aligned_decode_config(16, 768, 2048)["SPLIT_K"] == 1  # one chunk
    rows = gd.grouped_decode_config(128, 1, k, 2048)
    assert (rows["KC"], rows["SPLIT_K"]) == (1024, 4)
    assert gd.grouped_decode_config(4096, 1, k, 2048)["SPLIT_K"] == 1  # many rows: chunks in one program
    assert "KC" not in gd.grouped_decode_config(1024, 128, k)  # experts: one chunk


def test_bad_chunks_raise():
    dev = device()
    a, sa, wq = _case(4, 64, 256, dev)
    dw = kd.pack_weight(wq.codes, wq.block_scales, a.dtype)
    with pytest.raises(ValueError, match="K chunk"):
        gd.decode_gemm_rows(a, sa, dw, wq.global_scale, config=dict(_tile(gd.GROUPED_DECODE_TILES[-1][1]),
                                                                     KC=64, SPLIT_K=2))
    with pytest.raises(ValueError, match="K chunk"):
        kd.decode_gemm(a, sa, dw, wq.global_scale, config=dict(kd.aligned_decode_config(4, 256), KC=96))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 40, 128, 256, 3000])
def test_gpu_chunked_order_is_one_set_of_bits_and_not_the_plain_order(m):
    """An attention output projection's K (4096: four chunks) on heavy-tailed data: every path that
    claims the aligned bits agrees with the learner's tile (at 3000 rows its large tile at BN 128),
    and the plain order differs somewhere (the data tells the orders apart)."""
    k, n = 4096, 640
    a, sa, wq = _case(m, n, k, "cuda")
    want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wq), wq.global_scale, out_dtype=torch.float32)
    dw = kd.pack_weight(wq.codes, wq.block_scales)
    got = [gd.decode_gemm_rows(a, sa, dw, wq.global_scale, out_dtype=torch.float32)]
    if m <= 64:
        got.append(kd.decode_gemm(a, sa, dw, wq.global_scale, out_dtype=torch.float32,
                                  config=kd.aligned_decode_config(m, k, n)))
    for g in got:
        assert torch.isfinite(g).all() and torch.equal(g, want)
    plain = _learner(a, sa, wq, k)
    assert m < 40 or not torch.equal(plain, want)
