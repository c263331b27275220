"""The one-launch q/k RMSNorm + RoPE (CPU interpreter): close to the reference (the sum of squares in
its own order), the rotation's bits given the norm, batch invariant, the cache store writes exactly
the values returned (quantized caches: the KV quantizer's bits of them), gradients close to the
reference's autograd; the model's attention runs it."""

import pytest
import torch

from minite.execution import Execution
from minite.kernels import qk_norm_rope as kq
from minite.kernels.kv_quant import quantize_kv as kernel_quantize_kv
from minite.nn import rope
from minite.nn.qk_norm_rope import qk_norm_rope
from minite.ref import kv_quant as ref_kv
from minite.ref.qk_norm_rope import qk_norm_rope as reference
from tests.kernels.helpers import model_through_fused_kernels

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(dtype, lead=(2, 5), hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(*lead, hq, d, generator=g) * 3).to(dtype)
    k = (torch.randn(*lead, hkv, d, generator=g) * 3).to(dtype)
    wq = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    wk = (1 + 0.3 * torch.randn(d, generator=g)).to(dtype)
    cos, sin = rope.rope_cos_sin(torch.randint(0, 5000, lead, generator=g), d, 1e6, dtype)
    return q, k, wq, wk, cos, sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_close_to_the_reference(dtype):
    q, k, wq, wk, cos, sin = _inputs(dtype)
    assert kq.applies(q, k, wq, wk, cos)
    got = kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin)
    want = reference(q, k, wq, wk, 1e-6, cos, sin)
    for g_, w_ in zip(got, want):
        assert g_.dtype == dtype and g_.shape == w_.shape
        torch.testing.assert_close(g_.float(), w_.float(), rtol=0, atol=ATOL[dtype])


def test_rotation_bits_given_the_norm():
    """With every row's sum of squares exact (entries +-1, +-2 at D = 32), the norm has one result and
    the whole op is the reference's bits."""
    g = torch.Generator().manual_seed(3)
    sign = 2 * torch.randint(0, 2, (7, 4, 32), generator=g) - 1
    q = torch.randint(1, 3, (7, 4, 32), generator=g) * sign
    k = q[:, :2].clone()
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    w = torch.linspace(0.5, 1.5, 32).to(torch.bfloat16)
    cos, sin = rope.rope_cos_sin(torch.arange(7) * 911, 32, 1e6, torch.bfloat16)
    for g_, w_ in zip(kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin), reference(q, k, w, w, 1e-6, cos, sin)):
        assert torch.equal(g_, w_)


def test_batch_invariant_and_strided_input():
    q, k, wq, wk, cos, sin = _inputs(torch.bfloat16, lead=(9,))
    full = kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin)
    part = kq.qk_norm_rope(q[3:5], k[3:5], wq, wk, 1e-6, cos[3:5], sin[3:5])
    assert torch.equal(full[0][3:5], part[0]) and torch.equal(full[1][3:5], part[1])
    # q and k as column slices of one q|k buffer (the segmented projection's output)
    buf = torch.cat((q.flatten(1), k.flatten(1)), 1)
    qs, ks = buf[:, :128].view(9, 4, 32), buf[:, 128:].view(9, 2, 32)
    strided = kq.qk_norm_rope(qs, ks, wq, wk, 1e-6, cos, sin)
    assert torch.equal(strided[0], full[0]) and torch.equal(strided[1], full[1])


def test_store_writes_the_returned_keys_and_the_values():
    q, k, wq, wk, cos, sin = _inputs(torch.bfloat16, lead=(5,))
    v = torch.randn(k.shape).to(torch.bfloat16)
    kc, vc = torch.zeros(12, 2, 32, dtype=torch.bfloat16), torch.zeros(12, 2, 32, dtype=torch.bfloat16)
    slots = torch.tensor([7, 0, 11, 3, 4])
    qo, ko = kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, store=(v, kc, vc, slots))
    assert torch.equal((qo, ko)[0], kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin)[0])
    assert torch.equal(kc[slots], ko) and torch.equal(vc[slots], v)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not kc[untouched].any() and not vc[untouched].any()
    # the fallback (reference ops, indexed store) writes the same places
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    _, kref = qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, Execution(elementwise="ref"),
                           store=(v, kr, vr, slots))
    assert torch.equal(kr[slots], kref) and torch.equal(vr, vc)
    with pytest.raises(ValueError, match="do not fit"):
        kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, store=(v, kc[:, :1], vc[:, :1], slots))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.view(torch.uint8)


def _assert_same_fields(a, b):
    assert all(torch.equal(_bits(x), _bits(y)) for x, y in zip(a.fields(), b.fields()))


@pytest.mark.parametrize("kv_format", ["fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_store_holds_the_kv_quantizers_bits(kv_format, dtype):
    """The store quantizes the returned k and the values row by row, as the KV quantizer does from
    them (the learner's forward): every field bitwise, other slots untouched; the fallback (reference
    ops, reference quantizer) writes the same values' bits."""
    q, k, wq, wk, cos, sin = _inputs(dtype, lead=(5,))
    v = (torch.randn(k.shape) * 4).to(dtype)
    v[1, 0] = 0  # a zero row: scale 1
    v[2, 1, :16] *= 1e3  # one block much larger than the rest of its row
    v[3, 0, 20] = 1e4  # the row's amax in its second half
    slots = torch.tensor([7, 0, 11, 3, 4])
    kc, vc = ref_kv.zeros(kv_format, (12,), 2, 32, "cpu"), ref_kv.zeros(kv_format, (12,), 2, 32, "cpu")
    qo, ko = kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, store=(v, kc, vc, slots))
    assert torch.equal(qo, kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin)[0])
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    for got, x in ((kc, ko), (vc, v)):
        _assert_same_fields(got[slots], kernel_quantize_kv(x, kv_format))
        assert not any(_bits(f[untouched]).any() for f in got.fields())
    kr, vr = ref_kv.zeros(kv_format, (12,), 2, 32, "cpu"), ref_kv.zeros(kv_format, (12,), 2, 32, "cpu")
    qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, Execution(elementwise="ref"), store=(v, kr, vr, slots))
    _assert_same_fields(vr, vc)
    other = "nvfp4" if kv_format == "fp8" else "fp8"
    with pytest.raises(ValueError, match="do not fit"):
        kq.qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin, store=(v, kc, ref_kv.zeros(other, (12,), 2, 32, "cpu"),
                                                               slots))


def _specialization(args) -> list:
    """What Triton compiles a launch's arguments into: tensor dtypes and 16-byte alignment, ints'
    classes (== 1, divisible by 16), the other arguments' types."""
    return [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
            else (a == 1, a % 16 == 0) if isinstance(a, int) else type(a) for a in args]


def test_every_store_and_batch_launches_one_build(monkeypatch):
    """The learner's store-free launch, the sampler's with each cache format and a one-token step all
    specialize alike, so they run one build (whose layouts fix the norm's summation order): only the
    arguments Triton is told not to specialize differ."""
    launches = []
    monkeypatch.setattr(kq, "launch_kernel", lambda kernel, grid, args, **meta: launches.append((args, meta)))
    for n in (8, 1):
        qkv = torch.randn(n, 8, 32).to(torch.bfloat16)
        q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
        w = torch.ones(32, dtype=torch.bfloat16)
        cos, sin = rope.rope_cos_sin(torch.arange(n), 32, 1e6, torch.bfloat16)
        slots = torch.arange(n)
        kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin)
        caches = [torch.zeros(16, 2, 32, dtype=torch.bfloat16)] + [ref_kv.zeros(f, (16,), 2, 32, "cpu")
                                                                   for f in ("fp8", "nvfp4")]
        for c in caches:
            kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin, store=(v, c, c, slots))
    names = kq._qk_norm_rope_kernel.arg_names
    free = [names.index(a) for a in kq.UNSPECIALIZED]
    specs = [[s for i, s in enumerate(_specialization(args)) if i not in free] for args, _ in launches]
    assert all(s == specs[0] for s in specs) and all(meta == launches[0][1] for _, meta in launches)
    assert sorted({args[names.index("store")] for args, _ in launches}) == [0, 1, 2, 3]


def test_gradient_close_to_the_reference():
    q, k, wq, wk, cos, sin = _inputs(torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, wq, wk)]
    g = torch.Generator().manual_seed(5)
    dq, dk = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
    out = qk_norm_rope(*leaves, 1e-6, cos, sin, Execution(elementwise="triton"))
    got = torch.autograd.grad(out, leaves, (dq, dk))
    want = torch.autograd.grad(reference(*leaves, 1e-6, cos, sin), leaves, (dq, dk))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_model_runs_the_fused_kernel(monkeypatch):
    want, got, calls, layers = model_through_fused_kernels(monkeypatch, kq, "qk_norm_rope")
    assert calls == layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8", "nvfp4"])
def test_gpu_every_store_keeps_the_engines_bits(kv_format):
    """The 1.7B shape, q / k / v views of one projection's output as the model hands them over: with
    each cache format's store the same q and k bits as the learner's store-free launch, and the cache
    holds them (bf16) or the KV quantizer's fields of them and of v (fp8 / nvfp4), bitwise."""
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(512, 32, 128, device="cuda", generator=g).to(torch.bfloat16)
    qkv[..., 24:, :] *= 3
    q, k, v = qkv[:, :16], qkv[:, 16:24], qkv[:, 24:]
    w = (1 + 0.2 * torch.randn(128, device="cuda", generator=g)).to(torch.bfloat16)
    cos, sin = rope.rope_cos_sin(torch.randint(0, 40000, (512,), device="cuda", generator=g), 128, 1e6,
                                 torch.bfloat16)
    if kv_format == "bf16":
        kc, vc = (torch.zeros(1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    else:
        kc, vc = (ref_kv.zeros(kv_format, (1024,), 8, 128, "cuda") for _ in range(2))
    slots = torch.randperm(1024, device="cuda", generator=g)[:512]
    plain = kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin)
    stored = kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin, store=(v, kc, vc, slots))
    assert torch.equal(plain[0], stored[0]) and torch.equal(plain[1], stored[1])
    if kv_format == "bf16":
        assert torch.equal(kc[slots], plain[1]) and torch.equal(vc[slots], v)
    else:
        for got, x in ((kc, plain[1]), (vc, v)):
            _assert_same_fields(got[slots], kernel_quantize_kv(x, kv_format))
    want = reference(q, k, w, w, 1e-6, cos, sin)
    for a, b in zip(plain, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0.05)
