"""Quantized KV: the Triton quantizer against `minite.ref.kv_quant` (bitwise), the attention kernel on
quantized keys and values against `minite.ref.attention` (close) and against itself, paged vs packed
(bitwise); on the GPU, bf16 at Qwen3 head shapes."""

import dataclasses

import pytest
import torch

from minite.kernels.attention import contiguous_attention, kv_block, paged_attention
from minite.kernels.kv_quant import quantize_kv
from minite.ref import attention as ref
from minite.ref import kv_quant
from tests.kernels.helpers import adversarial, device
from tests.kernels.test_attention import ATOL, gathered, paged_case

FORMATS = ["fp8", "nvfp4"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same(a: kv_quant.QuantizedKV, b: kv_quant.QuantizedKV):
    assert a.format == b.format and len(a.fields()) == len(b.fields())
    for x, y in zip(a.fields(), b.fields()):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantizer_equals_the_reference_bitwise(fmt, dtype):
    dev = device()
    x = adversarial(24, 64).view(12, 2, 64).to(dtype).to(dev)  # zero, subnormal, tie and outlier rows
    assert_same(quantize_kv(x, fmt), kv_quant.quantize_kv(x, fmt))
    y = adversarial(16, 128, seed=1).view(4, 4, 128).to(dtype).to(dev)
    assert_same(quantize_kv(y, fmt), kv_quant.quantize_kv(y, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_writes_rows_into_the_given_slots(fmt):
    dev = device()
    x = adversarial(16, 32).view(8, 2, 32).to(dev)
    out = kv_quant.zeros(fmt, (5, 4), 2, 32, dev)  # blocks of 4 slots
    slots = torch.tensor([19, 3, 0, 7, 8, 12, 1, 2], device=dev)
    quantize_kv(x, fmt, out=out.flatten(0, 1), slots=slots)
    flat, want = out.flatten(0, 1), kv_quant.quantize_kv(x, fmt)
    assert_same(flat[slots], want)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (flat.scale[untouched.to(dev)] == 0).all()


def quantized_case(fmt, dtype, lens, starts, seed=0, **kw):
    q, kc, vc, qseq, qpos, tables, lens_t = paged_case(lens, starts, dtype=dtype, dev=device(), seed=seed,
                                                      **kw)
    kq = kv_quant.quantize_kv(kc.flatten(0, 1), fmt)
    vq = kv_quant.quantize_kv(vc.flatten(0, 1), fmt)
    shape = kc.shape[:2]
    unflat = lambda t: t.view(*shape, *t.shape[1:])  # noqa: E731
    kq, vq = (kv_quant.QuantizedKV(fmt, *(unflat(t) for t in x.fields())) for x in (kq, vq))
    return (q, kq, vq, qseq, qpos, tables, lens_t), (kc, vc)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_on_quantized_kv_matches_the_reference(fmt, dtype):
    args, _ = quantized_case(fmt, dtype, [1, 9, 40, 33], [0, 3, 0, 31], Hq=4, Hkv=2, D=16, block_size=4)
    q, kq, vq = args[:3]
    got = paged_attention(*args)
    want = ref.paged_attention(*args, kv_block=kv_block(dtype, fmt))
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ATOL[dtype])
    # the folded scales compute attention over the dequantized values
    plain = ref.paged_attention(q, kq.dequantize(torch.float32), vq.dequantize(torch.float32), *args[3:],
                                kv_block=kv_block(dtype, fmt))
    torch.testing.assert_close(got.float(), plain.float(), rtol=0, atol=2 * ATOL[dtype])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_contiguous_equals_paged_bitwise(fmt, dtype):
    """The learner's packed keys, quantized by the kernel, and the sampler's paged cache give the
    kernel the same bits."""
    dev = device()
    lens = [13, 30, 2]
    q, kc, vc, qseq, qpos, tables, lens_t = paged_case(lens, [0, 0, 0], Hq=4, Hkv=2, D=16, block_size=4,
                                                      dtype=dtype, dev=dev, seed=3)
    keys = torch.cat([gathered(kc, tables, 4)[s, :n] for s, n in enumerate(lens)])  # [N, Hkv, D]
    values = torch.cat([gathered(vc, tables, 4)[s, :n] for s, n in enumerate(lens)])
    kcache, vcache = (kv_quant.zeros(fmt, kc.shape[:2], 2, 16, dev) for _ in range(2))
    slots = torch.cat([(tables[s].long()[:, None] * 4 + torch.arange(4, device=dev)).flatten()[:n]
                       for s, n in enumerate(lens)])
    quantize_kv(keys, fmt, out=kcache.flatten(0, 1), slots=slots)
    quantize_kv(values, fmt, out=vcache.flatten(0, 1), slots=slots)
    paged = paged_attention(q, kcache, vcache, qseq, qpos, tables, lens_t)
    starts = torch.tensor([0, 13, 43], device=dev)
    kq, vq = quantize_kv(keys, fmt), quantize_kv(values, fmt)
    packed = contiguous_attention(q, kq, vq, qseq, qpos, starts, lens_t)
    assert torch.equal(packed, paged)


def test_quantized_kv_inputs_are_checked():
    (q, kq, vq, qseq, qpos, tables, lens), (kc, vc) = quantized_case("fp8", torch.float32, [4], [0], Hq=4,
                                                                    Hkv=2, D=16, block_size=4)
    with pytest.raises(TypeError, match="v must be one too"):
        paged_attention(q, kq, vc, qseq, qpos, tables, lens)
    nv = kv_quant.quantize_kv(vc, "nvfp4")
    with pytest.raises(TypeError, match="v must be one too"):
        paged_attention(q, kq, nv, qseq, qpos, tables, lens)
    with pytest.raises(ValueError, match="power-of-two"):
        quantize_kv(torch.zeros(2, 2, 48, device=q.device), "fp8")
    wide = torch.zeros(*kq.payload.shape[:-1], 17, dtype=kq.payload.dtype, device=q.device)
    k17, v17 = (dataclasses.replace(t, payload=wide[..., :16]) for t in (kq, vq))  # rows 17 bytes apart
    with pytest.raises(ValueError, match="4-byte aligned"):
        paged_attention(q, k17, v17, qseq, qpos, tables, lens)


# GPU: the quantizer's bits at the learner's sizes, and bitwise invariance across batches


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_quantizer_bitwise_bf16(fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 8, 128, device="cuda", generator=g).pow(3).to(torch.bfloat16)
    x[0] = 0.0
    assert_same(quantize_kv(x, fmt), kv_quant.quantize_kv(x, fmt))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)], ids=["g2", "g8"])
def test_gpu_quantized_decode_prefill_packed_bitwise(fmt, heads):
    """bf16, head_dim 128: the reference within bf16 tolerance; a query's output the same bits in a
    prefill alone, a packed batch (keys quantized by the learner's path) and decode steps."""
    lens = [1, 63, 64, 65, 300, 17, 129, 700]
    args, _ = quantized_case(fmt, torch.bfloat16, lens, [0] * len(lens), Hq=heads[0], Hkv=heads[1], D=128,
                             block_size=16)
    q, kq, vq, qseq, qpos, tables, lens_t = args
    want = ref.paged_attention(*args)
    full = paged_attention(*args)
    torch.testing.assert_close(full.float(), want.float(), rtol=0, atol=ATOL[torch.bfloat16])
    ends = torch.cumsum(lens_t, 0)
    alone = torch.cat([paged_attention(q[e - n: e], kq, vq, qseq[e - n: e] * 0, qpos[e - n: e],
                                       tables[s: s + 1], lens_t[s: s + 1])
                       for s, (n, e) in enumerate(zip(lens, ends.tolist()))])
    assert torch.equal(alone, full)
    slots = torch.cat([(tables[s].long()[:, None] * 16 + torch.arange(16, device="cuda")).flatten()[:n]
                       for s, n in enumerate(lens)])
    flat_k, flat_v = kq.flatten(0, 1), vq.flatten(0, 1)
    packed = contiguous_attention(q, flat_k[slots], flat_v[slots], qseq, qpos, ends - lens_t, lens_t)
    assert torch.equal(packed, full)
    g = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, len(lens), (64,), generator=g)
    pos = (torch.rand(64, generator=g) * lens_t[seqs].cpu()).long()
    rows = ((ends.cpu() - lens_t.cpu())[seqs] + pos).cuda()
    out = paged_attention(q[rows], kq, vq, torch.arange(64, device="cuda"), pos.cuda(), tables[seqs.cuda()],
                          (pos + 1).cuda())
    assert torch.equal(out, full[rows])
