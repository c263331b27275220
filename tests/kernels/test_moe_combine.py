"""The MoE combine kernel: the reference's bits (interpreter: fp32 / fp16; GPU: bf16); the reference is
torch's gather-multiply-sum on the CPU; the autograd op's gradients are autograd's of the torch form;
a MoE layer gives the same output and gradients through it."""

import pytest
import torch

from minite.execution import Execution
from minite.kernels import moe_combine as kc
from minite.nn import moe_combine as nc
from minite.nn import router
from minite.ref.moe_combine import combine as reference
from tests.kernels.helpers import device, moe_through_fused_kernels


def _inputs(t, k, h, dtype, seed=0, dev="cpu"):
    g = torch.Generator().manual_seed(seed)
    ys = torch.randn(t * k, h, generator=g).to(dtype)
    inverse = torch.randperm(t * k, generator=g)
    w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dtype)
    return ys.to(dev), inverse.to(dev), w.to(dev)


def _torch_form(ys, inverse, w):
    t, k = w.shape
    return (ys[inverse].reshape(t, k, -1) * w.unsqueeze(-1)).sum(dim=1)


def _residual(t, h, dtype, dev="cpu"):
    return (torch.randn(t, h, generator=torch.Generator().manual_seed(9)) * 4).to(dtype).to(dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,k,h", [(13, 2, 80), (5, 8, 32), (1, 1, 7)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_gives_the_references_bits(dtype, t, k, h, with_residual):
    ys, inverse, w = _inputs(t, k, h, dtype, dev=device())
    r = _residual(t, h, dtype, device()) if with_residual else None
    want = reference(ys.cpu(), inverse.cpu(), w.cpu(), None if r is None else r.cpu())
    assert torch.equal(kc.combine(ys, inverse, w, r).cpu(), want)


def test_residual_add_is_torchs_add_after_the_combine():
    """The reference's residual add: the rounded combine plus the residual, rounded again (bf16)."""
    ys, inverse, w = _inputs(9, 8, 64, torch.bfloat16)
    r = _residual(9, 64, torch.bfloat16)
    assert torch.equal(reference(ys, inverse, w, r), r + _torch_form(ys, inverse, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_is_torchs_sum_on_the_cpu(dtype):
    ys, inverse, w = _inputs(9, 8, 64, dtype)
    assert torch.equal(reference(ys, inverse, w), _torch_form(ys, inverse, w))


def test_autograd_op_gives_autograd_gradients_of_the_torch_form():
    ys, inverse, w = _inputs(7, 3, 40, torch.float32, seed=1)
    g = torch.randn(7, 40)
    got = [t.clone().requires_grad_() for t in (ys, w)]
    want = [t.clone().requires_grad_() for t in (ys, w)]
    out = nc.combine(got[0], inverse, got[1], Execution(elementwise="triton"))
    out.backward(g)
    _torch_form(want[0], inverse, want[1]).backward(g)
    assert torch.equal(out, _torch_form(ys, inverse, w))
    for a, b in zip(got, want):
        assert torch.equal(a.grad, b.grad)


def test_autograd_op_with_residual_passes_the_gradient_to_it():
    ys, inverse, w = _inputs(7, 3, 40, torch.float32, seed=2)
    r = _residual(7, 40, torch.float32).requires_grad_()
    g = torch.randn(7, 40)
    out = nc.combine(ys, inverse, w, Execution(elementwise="triton"), r)
    out.backward(g)
    assert torch.equal(out, r.detach() + _torch_form(ys, inverse, w))
    assert torch.equal(r.grad, g)
    torch_out = nc.combine(ys, inverse, w, Execution(elementwise="ref"), r.detach())
    assert torch.equal(torch_out, out.detach())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-interpreter test (fp32 experts on "
                    "torch._grouped_mm); on CUDA the agreement runs cover the MoE layer")
def test_moe_layer_through_the_kernel_equals_the_torch_combine(monkeypatch):
    """Bitwise on the CPU interpreter (fp32): output, input and parameter gradients."""
    # the gate and router's torch form in both runs (the kernel sums and rounds its own way)
    real = router.gate_route
    monkeypatch.setattr(router, "gate_route", lambda x, w, k, norm, _, **kw: real(x, w, k, norm, **kw))
    plain, fused, calls = moe_through_fused_kernels(monkeypatch, kc, "combine")
    assert calls == 1
    for a, b in zip(plain[:3] + tuple(plain[3]), fused[:3] + tuple(fused[3])):
        assert torch.equal(a, b)


def test_bad_inputs_are_clear_errors():
    ys, inverse, w = _inputs(4, 2, 16, torch.float32, dev=device())
    with pytest.raises(ValueError, match="unit stride"):
        kc.combine(ys.t().contiguous().t(), inverse, w)
    with pytest.raises(ValueError, match="weights must be"):
        kc.combine(ys, inverse, w.double())
    with pytest.raises(ValueError, match="inverse must be"):
        kc.combine(ys, inverse[:5], w)
    with pytest.raises(ValueError, match="residual must be"):
        kc.combine(ys, inverse, w, torch.zeros(4, 15, device=device()))
    with pytest.raises(ValueError, match="residual must be"):
        kc.combine(ys, inverse, w, torch.zeros(4, 16, dtype=torch.float16, device=device()))
    assert kc.combine(ys[:0], inverse[:0], w[:0]).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_decode_step_shape_gives_the_references_bits():
    """A MoE decode step of Qwen3-30B-A3B: 512 tokens x top-8 over hidden 2048, bf16."""
    ys, inverse, w = _inputs(512, 8, 2048, torch.bfloat16, dev="cuda")
    assert torch.equal(kc.combine(ys, inverse, w), reference(ys, inverse, w))
    r = _residual(512, 2048, torch.bfloat16, "cuda")
    assert torch.equal(kc.combine(ys, inverse, w, r), reference(ys, inverse, w, r))
