"""The Triton RoPE (CPU interpreter, fp32/fp16/bf16) equals the reference bit for bit; gradients too
(the model's attention runs the rotation inside `qk_norm_rope`)."""

import pytest
import torch

from minite.execution import Execution
from minite.kernels import rope as kr
from minite.nn import rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lead", [(13,), (2, 5)])
def test_bitwise_equal_to_the_reference(dtype, lead):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, 3, 32, generator=g).to(dtype)
    pos = torch.randint(0, 5000, lead, generator=g)
    cos, sin = rope.rope_cos_sin(pos, 32, 1e6, dtype)
    assert torch.equal(kr.apply_rope(x, cos, sin), rope.apply_rope_reference(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_backward_kernel_gives_the_references_autograd_bits(dtype):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 3, 32, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(2, 9, 3, 32, generator=g).to(dtype)
    cos, sin = rope.rope_cos_sin(torch.randint(0, 5000, (2, 9), generator=g), 32, 1e6, dtype)
    (want,) = torch.autograd.grad(rope.apply_rope_reference(x, cos, sin), x, dy)
    assert torch.equal(kr.apply_rope(dy, cos, sin, backward=True), want)
    # cos / sin halves that differ (the formula's general case, not only RoPE's repeated angles)
    cos2, sin2 = torch.randn(2, 9, 32, generator=g).to(dtype), torch.randn(2, 9, 32, generator=g).to(dtype)
    (want,) = torch.autograd.grad(rope.apply_rope_reference(x, cos2, sin2), x, dy)
    assert torch.equal(kr.apply_rope(dy, cos2, sin2, backward=True), want)


def test_gradient_and_switch(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4, 16, generator=g, requires_grad=True)
    cos, sin = rope.rope_cos_sin(torch.arange(6), 16, 1e4, torch.float32)
    dy = torch.randn(6, 4, 16, generator=g)
    y = rope.apply_rope(x, cos, sin, Execution(elementwise="triton"))
    y.backward(dy)
    gx = x.grad.clone()
    x.grad = None
    yr = rope.apply_rope_reference(x, cos, sin)
    yr.backward(dy)
    assert torch.equal(y, yr)
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=1e-6)


def test_bad_shapes_raise():
    x = torch.zeros(4, 2, 12)
    with pytest.raises(ValueError, match="power of two"):
        kr.apply_rope(x, torch.zeros(4, 12), torch.zeros(4, 12))
    with pytest.raises(ValueError, match="do not fit"):
        kr.apply_rope(torch.zeros(4, 2, 16), torch.zeros(3, 16), torch.zeros(3, 16))


@pytest.mark.gpu
def test_gpu_bf16_bitwise_equal_to_the_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 40000, (512,), device="cuda", generator=g)
    cos, sin = rope.rope_cos_sin(pos, 128, 1e6, torch.bfloat16)
    assert torch.equal(kr.apply_rope(x, cos, sin), rope.apply_rope_reference(x, cos, sin))
    xr = x.clone().requires_grad_()
    dy = torch.randn(x.shape, device="cuda", generator=g).to(torch.bfloat16)
    (want,) = torch.autograd.grad(rope.apply_rope_reference(xr, cos, sin), xr, dy)
    assert torch.equal(kr.apply_rope(dy, cos, sin, backward=True), want)
