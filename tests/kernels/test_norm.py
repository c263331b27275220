"""The Triton RMSNorm (CPU interpreter, fp32/fp16) against the reference formula: values, batch
invariance, gradients, and the switch (`use_fused_kernels`; on by default on CUDA) that routes a
whole model through it."""

import pytest
import torch

from minite.kernels import norm as kn
from minite.nn import norm
from tests.kernels.helpers import model_through_fused_kernels


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float32, 100), (torch.float16, 128)])
def test_matches_reference_and_is_batch_invariant(dtype, d):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, d, generator=g) * 3).to(dtype)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    got = kn.rms_norm(x, w, 1e-6)
    want = norm.rms_norm_reference(x, w, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
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
    gx, gw = kn._backward(x.detach(), w.detach(), dy, 1e-6)
    rx, rw = torch.autograd.grad(norm.rms_norm_reference(x, w, 1e-6), (x, w), dy)
    assert gx.dtype == rx.dtype and gw.dtype == rw.dtype
    ulp = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(gx.float(), rx.float(), rtol=ulp, atol=ulp * rx.abs().max().item())
    torch.testing.assert_close(gw.float(), rw.float(), rtol=ulp, atol=ulp * rw.abs().max().item())
    assert torch.equal(kn._backward(x.detach(), w.detach(), dy, 1e-6)[1], gw)  # deterministic


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="last dimension"):
        kn.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="MAX_D"):
        kn.rms_norm(torch.zeros(1, kn.MAX_D * 2), torch.ones(kn.MAX_D * 2), 1e-6)


def test_switch_routes_the_model_through_the_kernel(monkeypatch):
    want, got, calls, layers = model_through_fused_kernels(monkeypatch, kn, "_launch")
    assert calls == 4 * layers + 1  # input, post-attn, q, k; final norm
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
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        dy = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
        rx, rw = torch.autograd.grad(norm.rms_norm_reference(xr, wr, 1e-6), (xr, wr), dy)
        gx, gw = kn._backward(x, w, dy, 1e-6)
        torch.testing.assert_close(gx, rx, rtol=1.6e-2, atol=1.6e-2 * rx.abs().max().item())
        torch.testing.assert_close(gw, rw, rtol=1.6e-2, atol=1.6e-2 * rw.abs().max().item())
