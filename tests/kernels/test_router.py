"""The router kernel: the reference's ids exactly and its weights to within the exp2 approximation
(interpreter: fp32 / fp16 / bf16 logits; GPU: the same asserts); the reference is HF's softmax /
top-k / renormalize up to the order of equal logits; the autograd op's gradients are autograd's of
the torch form; a MoE layer routes through it."""

import pytest
import torch
import torch.nn.functional as F

from minite.execution import Execution
from minite.kernels import router as kr
from minite.nn import router as nr
from minite.ref.router import route as reference
from tests.kernels.helpers import device, moe_through_fused_kernels

# the weights' tolerance: a few fp32 ulps before the cast, so at most one unit of a 16-bit dtype
RTOL = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _logits(t, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, e, generator=g) * 2).to(dtype)
    if t > 2:
        x[1] = 0.5  # a row of equal logits
        x[2, : e // 2] = x[2, 0]  # ties around the k-th place
    return x


def _torch_form(logits, k, normalize):
    w, ids = torch.topk(torch.softmax(logits.float(), -1), k, dim=-1)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("t,e,k", [(37, 128, 8), (5, 60, 2), (1, 8, 1), (19, 16, 16)])
def test_kernel_gives_the_references_ids_and_weights(dtype, normalize, t, e, k):
    x = _logits(t, e, dtype)
    w, ids = kr.route(x.to(device()), k, normalize)
    want_w, want_ids = reference(x, k, normalize)
    assert ids.dtype == torch.int64 and w.dtype == dtype
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=RTOL[dtype], atol=0)


def test_equal_logits_go_to_the_lower_expert():
    x = torch.zeros(3, 16)
    x[2, 5:] = 1.0
    w, ids = kr.route(x.to(device()), 4, True)
    assert ids.cpu().tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [5, 6, 7, 8]]
    assert torch.equal(w.cpu(), torch.full((3, 4), 0.25))


def test_reference_is_hfs_routing_up_to_the_order_of_equal_logits():
    x = torch.randn(300, 128).to(torch.bfloat16)  # bf16 logits: equal values at the k-th place are common
    for normalize in (True, False):
        w, ids = reference(x, 8, normalize)
        hw, hids = _torch_form(x, 8, normalize)
        assert torch.equal(x.gather(-1, ids), x.gather(-1, hids))  # the same logits, in the same order
        torch.testing.assert_close(w, hw, rtol=RTOL[torch.bfloat16], atol=0)
        assert (ids != hids).any()  # rows where torch ordered or picked equal logits otherwise


def test_autograd_op_gives_autograd_gradients_of_the_torch_form():
    x = torch.randn(9, 32)  # fp32: no equal logits
    g = torch.randn(9, 4)
    for normalize in (True, False):
        got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
        w, ids = nr.route(got, 4, normalize, Execution(elementwise="triton"))
        hw, hids = _torch_form(want, 4, normalize)
        assert torch.equal(ids, hids) and not ids.requires_grad
        torch.testing.assert_close(w, hw, rtol=RTOL[torch.float32], atol=0)
        w.backward(g)
        hw.backward(g)
        assert torch.equal(got.grad, want.grad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-interpreter test (fp32); on CUDA the "
                    "agreement runs cover the MoE layer")
def test_moe_layer_routes_through_the_kernel(monkeypatch):
    plain, fused, calls = moe_through_fused_kernels(monkeypatch, kr, "route")
    assert calls == 1
    assert torch.equal(plain[1], fused[1])  # the same experts
    for a, b in zip((plain[0], plain[2], *plain[3]), (fused[0], fused[2], *fused[3])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unit stride"):
        kr.route(torch.zeros(8, 4, device=device()).t(), 2, True)
    with pytest.raises(ValueError, match="top-k"):
        kr.route(torch.zeros(4, 8, device=device()), 9, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_decode_step_shape():
    """A MoE decode step of Qwen3-30B-A3B: 512 tokens over 128 experts, top-8, bf16 logits."""
    x = (torch.randn(512, 128) * 3).to(torch.bfloat16)
    w, ids = kr.route(x.cuda(), 8, True)
    want_w, want_ids = reference(x, 8, True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, rtol=RTOL[torch.bfloat16], atol=0)
    w2, ids2, counts = kr.route(x.cuda(), 8, True, 128)  # counting for the sort in the same launch
    assert torch.equal(w2, w) and torch.equal(ids2, ids)
    assert torch.equal(counts.long().cpu(), F.one_hot(ids.cpu().reshape(-1, 128), 128).sum(1))
