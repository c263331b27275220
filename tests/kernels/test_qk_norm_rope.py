"""The one-launch q/k RMSNorm + RoPE (CPU interpreter): close to the reference (the sum of squares in
its own order), the rotation's bits given the norm, batch invariant, the cache store writes exactly
the values returned, gradients close to the reference's autograd; the model's attention runs it."""

import pytest
import torch

from minite.execution import Execution
from minite.kernels import qk_norm_rope as kq
from minite.nn import rope
from minite.nn.qk_norm_rope import qk_norm_rope
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
def test_gpu_engines_share_the_bits_and_the_store():
    """bf16 at the 1.7B shape: with and without the store the same q and k bits, the cache gets them."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(512, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(512, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(512, 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(128, device="cuda", generator=g)).to(torch.bfloat16)
    cos, sin = rope.rope_cos_sin(torch.randint(0, 40000, (512,), device="cuda", generator=g), 128, 1e6,
                                 torch.bfloat16)
    kc, vc = torch.zeros(1024, 8, 128, device="cuda", dtype=torch.bfloat16), torch.zeros_like(
        torch.empty(1024, 8, 128, device="cuda", dtype=torch.bfloat16))
    slots = torch.randperm(1024, device="cuda")[:512]
    plain = kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin)
    stored = kq.qk_norm_rope(q, k, w, w, 1e-6, cos, sin, store=(v, kc, vc, slots))
    assert torch.equal(plain[0], stored[0]) and torch.equal(plain[1], stored[1])
    assert torch.equal(kc[slots], plain[1]) and torch.equal(vc[slots], v)
    want = reference(q, k, w, w, 1e-6, cos, sin)
    for a, b in zip(plain, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0.05)
