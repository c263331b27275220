"""The Triton RMSNorm (CPU interpreter, fp32/fp16) against the reference formula: values, batch
invariance, gradients, and the execution's `elementwise` choice (the kernels on CUDA by default) that
routes a whole model through it."""

import pytest
import torch

from minite.kernels import norm as kn
from minite.kernels import nvfp4 as kq
from minite.nn import norm
from tests.kernels.helpers import ZeroFills, model_through_fused_kernels


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float32, 100), (torch.float16, 128),
                                     (torch.float16, 100), (torch.bfloat16, 48)])
def test_matches_reference_and_is_batch_invariant(dtype, d):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, d, generator=g) * 3).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    got = kn.rms_norm(x, w, 1e-6)
    want = norm.rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: dict(rtol=2e-6, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-3),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}[dtype]
    torch.testing.assert_close(got, want, **tol)
    for rows in (1, 5, 36):  # a row's bits do not depend on the batch it is normalized in
        assert torch.equal(kn.rms_norm(x[-rows:], w, 1e-6), got[-rows:])


def test_gradients_equal_the_reference():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 48, generator=g, requires_grad=True)
    w = (torch.rand(48, generator=g) + 0.5).requires_grad_()
    dy = torch.randn(2, 7, 48, generator=g)
    kn.rms_norm(x, w, 1e-6).backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    norm.rms_norm_reference(x, w, 1e-6).backward(dy)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,d,rows", [(torch.float16, 64, 300), (torch.bfloat16, 100, 37),
                                          (torch.float32, 48, 5)])
def test_backward_kernel_close_to_the_references_autograd(dtype, d, rows, monkeypatch):
    """One launch for dx and the dW partials; more row blocks than programs (each program loops)."""
    monkeypatch.setattr(kn, "MAX_BWD_PROGRAMS", 3)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, d, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).requires_grad_()
    dy = torch.randn(rows, d, generator=g).to(dtype)
    gx, gw = kn.rms_norm_backward(x.detach(), w.detach(), dy, 1e-6)
    rx, rw = torch.autograd.grad(norm.rms_norm_reference(x, w, 1e-6), (x, w), dy)
    assert gx.dtype == rx.dtype and gw.dtype == rw.dtype
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(gx.float(), rx.float(), rtol=ulp, atol=ulp * rx.abs().max().item())
    torch.testing.assert_close(gw.float(), rw.float(), rtol=ulp, atol=ulp * rw.abs().max().item())
    assert torch.equal(kn.rms_norm_backward(x.detach(), w.detach(), dy, 1e-6)[1], gw)  # deterministic


def _same(a, b):
    assert a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _fused_against_two_kernels(x, w, out_dtype, chain):
    out, vals, sdec, amax = kn.rms_norm_quantize(x, w, 1e-6, out_dtype, chain)
    want = kn.rms_norm(x, w, 1e-6)
    _same(out, want)
    wv, ws, _, _, wa = kq.quantize_unscaled(want, out_dtype, chain, return_codes=True)
    for got, ref in ((vals, wv), (sdec, ws), (amax, wa)):
        _same(got, ref)
    return out, vals, sdec


@pytest.mark.parametrize("dtype,d,chain", [(torch.float32, 64, "te"), (torch.float16, 80, "vllm"),
                                           (torch.float16, 256, "torchao"), (torch.bfloat16, 64, "te")])
def test_fused_quantizer_is_bitwise_the_two_kernels(dtype, d, chain):
    """One launch: the norm's output and its row-scaled quantization (values, S_dec, amax), bitwise
    `rms_norm` then `quantize_unscaled`; heavy-tailed rows, a zero row, a non-finite row; batch invariant."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, d, generator=g) ** 3
    x[4] = 0.0
    x[7, 3] = float("inf")
    x = x.to(dtype)
    w = (torch.rand(d, generator=g) * 4).to(dtype)
    out, vals, sdec = _fused_against_two_kernels(x, w, torch.float16, chain)
    assert torch.isnan(sdec[7]).all() and not torch.isnan(sdec[8:]).any()
    for rows in (1, 6):
        got = kn.rms_norm_quantize(x[-rows:], w, 1e-6, torch.float16, chain)
        _same(got[1], vals[-rows:])
        _same(got[2], sdec[-rows:])


def test_fused_quantizer_gradient_is_the_norms():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 32, generator=g, requires_grad=True)
    w = (torch.rand(32, generator=g) + 0.5).requires_grad_()
    dy = torch.randn(3, 5, 32, generator=g)
    out, vals, sdec, amax = kn.rms_norm_quantize(x, w, 1e-6, torch.float16)
    assert not (vals.requires_grad or sdec.requires_grad or amax.requires_grad)
    out.backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    kn.rms_norm(x, w, 1e-6).backward(dy)
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)


def test_fused_quantizer_backward_makes_no_zero_gradients():
    """The quantized outputs are not differentiable: autograd does not zero-fill gradients for them
    (a memset of the [rows, D] values each backward on the GPU); the backward fills no more than the
    plain norm's."""
    counts = []
    for quantize in (False, True):
        x = torch.randn(3, 5, 32, requires_grad=True)
        w = torch.ones(32, requires_grad=True)
        out = kn.rms_norm_quantize(x, w, 1e-6, torch.float16)[0] if quantize else kn.rms_norm(x, w, 1e-6)
        dy = torch.ones_like(out)
        with ZeroFills() as fills:
            out.backward(dy)
        counts.append(fills.count)
    assert counts[1] == counts[0]


@pytest.mark.parametrize("dtype,d,rows", [(torch.float16, 64, 32), (torch.bfloat16, 80, 21),
                                          (torch.float32, 48, 5)])
@pytest.mark.parametrize("quantize", [False, True])
def test_add_rms_norm_is_torchs_add_then_the_norm(dtype, d, rows, quantize):
    """h = x + r and its norm (and quantization): bitwise torch's add, then `rms_norm` /
    `rms_norm_quantize` (one launch for 16-bit rows; full and partial row blocks)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    r = (torch.randn(rows, d, generator=g) * 30).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    h = x + r
    if quantize and dtype != torch.float32:
        got = kn.add_rms_norm(x, r, w, 1e-6, torch.float16)
        want = (h, *kn.rms_norm_quantize(h, w, 1e-6, torch.float16))
    else:
        got, want = kn.add_rms_norm(x, r, w, 1e-6), (h, kn.rms_norm(h, w, 1e-6))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        _same(a, b)
    with pytest.raises(ValueError, match="residual"):
        kn.add_rms_norm(x, r[:-1], w, 1e-6)


def test_nn_add_rms_norm_fuses_only_without_gradients(monkeypatch):
    """The nn form runs the fused launch when nothing needs a gradient (the sampler), torch's add
    and the norm otherwise (the learner), with the same bits."""
    from minite.execution import Execution

    g = torch.Generator().manual_seed(6)
    x, r = (torch.randn(2, 5, 64, generator=g).to(torch.float16) for _ in range(2))
    w = (torch.rand(64, generator=g) + 0.5).to(torch.float16).requires_grad_()
    calls = []
    real = kn.add_rms_norm
    monkeypatch.setattr(kn, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    ex = Execution(elementwise="triton")
    h, out = norm.add_rms_norm(x, r, w, 1e-6, ex)
    assert calls == [] and out.requires_grad
    with torch.no_grad():
        fused = norm.add_rms_norm(x, r, w, 1e-6, ex)
    assert calls == [1]
    _same(fused[0], h)
    _same(fused[1], out.detach())


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple of 16"):
        kn.rms_norm_quantize(torch.zeros(2, 40), torch.ones(40), 1e-6)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        kn.rms_norm_quantize(torch.zeros(2, 32), torch.ones(32), 1e-6, torch.float32)
    with pytest.raises(ValueError, match="last dimension"):
        kn.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="MAX_D"):
        kn.rms_norm(torch.zeros(1, kn.MAX_D * 2), torch.ones(kn.MAX_D * 2), 1e-6)


def test_switch_routes_the_model_through_the_kernel(monkeypatch):
    want, got, calls, layers = model_through_fused_kernels(monkeypatch, kn, "_launch")
    assert calls == 2 * layers + 1  # input, post-attn; final norm (q, k: `qk_norm_rope`)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_bf16_close_to_reference_and_batch_invariant():
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in (128, 2048, 4096):
        x = torch.randn(3000, d, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.rand(d, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        got = kn.rms_norm(x, w, 1e-6)
        torch.testing.assert_close(got, norm.rms_norm_reference(x, w, 1e-6), rtol=1.6e-2, atol=1e-2)
        for rows in (1, 7, 64, 300):
            assert torch.equal(kn.rms_norm(x[:rows], w, 1e-6), got[:rows])
        _fused_against_two_kernels(x, w, torch.bfloat16, "te")
        r = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
        for a, b in zip(kn.add_rms_norm(x, r, w, 1e-6, torch.bfloat16),
                        (x + r, *kn.rms_norm_quantize(x + r, w, 1e-6, torch.bfloat16))):
            _same(a, b)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        dy = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
        rx, rw = torch.autograd.grad(norm.rms_norm_reference(xr, wr, 1e-6), (xr, wr), dy)
        gx, gw = kn.rms_norm_backward(x, w, dy, 1e-6)
        torch.testing.assert_close(gx, rx, rtol=1.6e-2, atol=1.6e-2 * rx.abs().max().item())
        torch.testing.assert_close(gw, rw, rtol=1.6e-2, atol=1.6e-2 * rw.abs().max().item())


@pytest.mark.gpu
def test_gpu_fused_paths_batch_invariant():
    """Every path (plain, quantized, residual-added and quantized) gives a row the same bits in a decode
    step's batch of 64 rows as in a learner's 8192: a launch shape that changed a row's sum order left
    1-2 of these rows one bit off, which broke aligned agreement."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(8192, 2048, device="cuda", generator=g) * 2).to(torch.bfloat16)
    r = torch.randn(8192, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.rand(2048, device="cuda", generator=g) + 0.5).to(torch.bfloat16)

    def paths(x, r):
        return ((kn.rms_norm(x, w, 1e-6),), kn.rms_norm_quantize(x, w, 1e-6),
                kn.add_rms_norm(x, r, w, 1e-6, torch.bfloat16))
    big = paths(x, r)
    for s in range(0, 8192, 64):
        for small, whole in zip(paths(x[s:s + 64], r[s:s + 64]), big, strict=True):
            for a, b in zip(small, whole, strict=True):
                _same(a, b[s:s + 64])
