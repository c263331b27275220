"""The decode-regime W4A4 GEMM (packed weights, M <= 64): its in-register dequantization and its
output against the aligned path. On the GPU the dequantization is inline PTX; in the CPU interpreter
the same K order runs with plain integer ops."""

import pytest
import torch
import triton
import triton.language as tl

from minite import nvfp4
from minite.kernels import available, interpreted
from minite.kernels import decode_gemm as kd
from minite.kernels import gemm as kg
from tests.kernels.helpers import device
from tests.kernels.test_gemm import operands

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


@triton.jit
def _dequant_kernel(q_ptr, scales_ptr, out_ptr, NQ: tl.constexpr, NS: tl.constexpr, BF16: tl.constexpr,
                    HW: tl.constexpr):
    rows = tl.arange(0, NQ)[:, None]
    cols = tl.arange(0, NS)[None, :]
    q = tl.load(q_ptr + rows + 0 * cols)  # every word against every scale
    s = tl.load(scales_ptr + 0 * rows + cols)
    offs = rows * NS + cols
    for o in tl.static_range(4):
        tl.store(out_ptr + o * NQ * NS + offs, (kd._code(q, o, BF16, HW) * s).to(tl.float32))


def column(word, o):
    """The column of slot o of decode-layout word `word` (kernels.decode_gemm: MMA register order)."""
    g, t, e = word // 8, (word % 8) // 2, word % 2
    return 32 * g + 16 * (o // 2) + 8 * (o % 2) + 2 * t + e


def _codes(n, k, seed):
    """Codes uint8 [n, k // 2] in which each of the 16 codes lands in each slot of some word."""
    g = torch.Generator().manual_seed(seed)
    nib = torch.randint(0, 16, (n, k), generator=g)
    for w in range(16):
        for o in range(4):
            nib[:, column(w, o)] = w  # word w holds code w in every slot
    nib = nib.reshape(n, k // 2, 2)
    return (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequant_is_exact_for_every_code_and_scale(dtype):
    """code * scale == e2m1 * s_b / W_SHIFT exactly, for every code at each of a word's four
    positions and all 127 finite unsigned E4M3 bytes (0x7f, NaN, never comes out of a quantizer).
    In bf16 the codes +-0.5 are subnormal: this also checks that the multiply keeps them."""
    if dtype == torch.bfloat16 and interpreted():
        pytest.skip("bf16 is the GPU's operand dtype; the interpreter's bf16 is not faithful (docs/facts.md)")
    dev = device()
    codes = _codes(1, 512, 0)  # 128 words
    scales = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn)
    dw = kd.pack_weight(codes, torch.zeros(1, 32, dtype=torch.float8_e4m3fn), dtype)
    sw = kd.pack_weight(torch.zeros(1, 1024, dtype=torch.uint8), scales[None], dtype).rows()[1][0]
    out = torch.empty(4, 128, 128, dtype=torch.float32, device=dev)
    words = dw.rows()[0][0].contiguous()
    _dequant_kernel[(1,)](words.to(dev), sw.to(dev), out, NQ=128, NS=128, BF16=dtype == torch.bfloat16,
                          HW=not interpreted())
    e2m1 = torch.tensor(nvfp4.E2M1_VALUES, dtype=torch.float64)
    e2m1 = torch.cat([e2m1, -e2m1])
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(512).long()
    for o in range(4):
        codes_o = nib[[column(w, o) for w in range(128)]]
        want = e2m1[codes_o][:, None] * scales.double()[None, :] / kd.W_SHIFT[dtype]
        assert torch.equal(out[o].cpu().double()[:, :127], want[:, :127]), o


def test_pack_weight_of_experts_in_row_chunks_equals_each_expert_whole(monkeypatch):
    """[E, N, K] packs as E separate [N, K] weights, also when rows go through in uneven chunks."""
    g = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 256, (3, 40, 256), dtype=torch.uint8, generator=g)
    scales = torch.rand(3, 40, 32, generator=g).to(torch.float8_e4m3fn)
    whole = [kd.pack_weight(codes[e], scales[e]) for e in range(3)]
    monkeypatch.setattr(kd, "PACK_CODES", 256 * 7)  # 7 rows at a time
    dw = kd.pack_weight(codes, scales)
    assert dw.shape == (3, 40, 512) and dw.codes.is_contiguous()
    for e in range(3):
        assert torch.equal(dw.codes[e], whole[e].codes) and torch.equal(dw.scales[e], whole[e].scales)


def test_pack_weight_lays_rows_out_in_memory_tiles():
    """Each TILE_N-row block's TILE_K-column step is one contiguous piece, the steps in K order; rows
    padded with zeros to a whole tile; `rows()` gives the row-major words back."""
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(1, 256, (70, 384), dtype=torch.uint8, generator=g)  # K = 768: 3 tiles of 256
    scales = (torch.rand(70, 48, generator=g) + 0.5).to(torch.float8_e4m3fn)
    dw = kd.pack_weight(codes, scales)
    words, row_scales = dw.rows()
    assert dw.tk == kd.TILE_K == 256 and dw.n == 70 and dw.n_pad == 128 and dw.shape == (70, 768)
    assert dw.codes.shape == (2, 3, 64, 64) and dw.scales.shape == (2, 3, 64, 16) and dw.codes.is_contiguous()
    assert torch.equal(dw.codes[1, 1, :6], words[64:70, 64:128])  # rows 64-69, columns 256-511
    assert torch.equal(dw.scales[0, 2], row_scales[:64, 32:48])
    assert not dw.codes[1, :, 6:].any() and not dw.scales[1, :, 6:].any()  # the padding
    assert kd.pack_weight(codes[:, :48], scales[:, :6]).tk == 32  # K = 96: the tile halves to divide it


def test_pack_weight_puts_each_column_in_its_mma_register_slot():
    codes = _codes(3, 512, 1)
    scales = torch.rand(3, 32, generator=torch.Generator().manual_seed(2)).to(torch.float8_e4m3fn)
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(3, 512).to(torch.int32)
    dw = kd.pack_weight(codes, scales)
    assert dw.shape == (3, 512) and dw.codes.dtype == torch.int16 and dw.scales.dtype == torch.bfloat16
    row_words, row_scales = dw.rows()
    assert torch.equal(row_scales.double(), scales.double() * 2.0**62)
    words = row_words.to(torch.int32) & 0xFFFF  # [3, 128]
    for o, (mag_at, sign_at) in enumerate(kd.WORD_BITS):
        mag = sum(((words >> at) & 1) << bit for bit, at in enumerate(mag_at))
        got = mag | (((words >> sign_at) & 1) << 3)
        assert torch.equal(got, nib[:, [column(w, o) for w in range(128)]]), o
    with pytest.raises(ValueError, match="multiple"):
        kd.pack_weight(codes[:, :40], scales[:, :5])
    a = torch.zeros(2, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=512"):
        kd.decode_gemm(a[:, :256], torch.ones(()), dw, torch.ones(()))
    with pytest.raises(ValueError, match="a_scale"):
        kd.decode_gemm(a, torch.ones(3), dw, torch.ones(()))
    with pytest.raises(ValueError, match="SPLIT_K"):
        cfg = dict(kd.decode_config(2, 3, 512), BK=512, SPLIT_K=2)
        kd.decode_gemm(a, torch.ones(()), dw, torch.ones(()), config=cfg)
    with pytest.raises(ValueError, match="tile width"):  # a K step wider than the memory tile
        cfg = dict(kd.decode_config(2, 3, 512), BK=512, SPLIT_K=1)
        kd.decode_gemm(a, torch.ones(()), dw, torch.ones(()), config=cfg)


CASES = [  # (M, N, K, tile): ragged N (masked loads), N % BN == 0, split-K, padded M 16 and 32
    (1, 40, 256, dict(BM=16, BN=16, BK=64, SPLIT_K=1)),
    (3, 48, 256, dict(BM=16, BN=16, BK=64, SPLIT_K=1)),
    (5, 40, 256, dict(BM=16, BN=16, BK=64, SPLIT_K=4)),
    (16, 32, 512, dict(BM=16, BN=32, BK=128, SPLIT_K=2)),
    (20, 48, 128, dict(BM=32, BN=16, BK=64, SPLIT_K=1)),
    (4, 136, 256, dict(BM=16, BN=128, BK=64, SPLIT_K=1)),  # a tile of rows across two memory tiles
]


@pytest.mark.parametrize("m, n, k, tile", CASES)
def test_decode_matches_aligned_on_gaussian_data(m, n, k, tile):
    """Gaussian data: every fp32 sum is exact (docs/facts.md), so the decode kernel's other K order
    gives the aligned path's bits, also on a second launch that reuses the split-K counters."""
    x, w = torch.randn(m, k), torch.randn(n, k)
    xq, wq = nvfp4.quantize(x, "row"), nvfp4.quantize(w, "tensor")
    a, sa, wqd, sw = operands(xq, wq, device())
    want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wqd), sw, out_dtype=torch.float32)
    cfg = dict(tile, kernel="decode", num_warps=4, num_stages=1)
    for _ in range(2):  # the second launch checks that the split-K counters were reset
        got = kg.w4a4_gemm(a, sa, wqd.codes, sw, wqd.block_scales, out_dtype=torch.float32, config=cfg)
        assert torch.equal(got, want)


@pytest.mark.parametrize("bk, split", [(32, 1), (64, 1), (128, 1), (256, 1), (32, 4), (64, 2)])
def test_every_k_step_and_split_gives_the_aligned_bits_on_gaussian_data(bk, split):
    """BK only regroups the same k16 MMA steps (one accumulator, plain column order); split-K sums
    exact partials here. Also the fp16 interpreter path of every code slot."""
    x, w = torch.randn(3, 256), torch.randn(32, 256)
    xq, wq = nvfp4.quantize(x, "row"), nvfp4.quantize(w, "tensor")
    a, sa, wqd, sw = operands(xq, wq, device())
    want = kg.w4a4_gemm(a, sa, kg.unscaled_copy(wqd), sw, out_dtype=torch.float32)
    dw = kd.pack_weight(wqd.codes, wqd.block_scales, a.dtype)
    cfg = dict(BM=16, BN=16, BK=bk, SPLIT_K=split, num_warps=4, num_stages=1)
    assert torch.equal(kd.decode_gemm(a, sa, dw, sw, out_dtype=torch.float32, config=cfg), want)


def test_decode_config_is_picked_by_padded_m_and_rejects_copies():
    for m, bm in ((1, 16), (8, 16), (16, 16), (17, 32), (64, 64)):
        assert kd.decode_config(m, 12288, 4096)["BM"] == bm
        assert kd.aligned_decode_config(m, 4096)["BM"] == bm
    cfg = kd.decode_config(1, 1024, 4096)
    assert cfg["SPLIT_K"] > 1 and 4096 % (cfg["SPLIT_K"] * cfg["BK"]) == 0
    assert kd.aligned_decode_config(1, 4096)["SPLIT_K"] == 1
    assert kd.decode_config(1, 1024, 96)["BK"] == 32  # BK halves until it divides K
    with pytest.raises(ValueError, match="M <= 64"):
        kd.decode_config(65, 1024, 4096)
    with pytest.raises(ValueError, match="column group"):
        kd.decode_config(1, 1024, 80)
    dt, dev = kg.operand_dtype(device()), device()
    a, s = torch.zeros(2, 64, dtype=dt, device=dev), torch.ones((), device=dev)
    with pytest.raises(ValueError, match="packed"):
        kg.w4a4_gemm(a, s, a, s, config=dict(kd.decode_config(2, 64, 64), kernel="decode"))
