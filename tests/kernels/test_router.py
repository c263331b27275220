"""The router kernel: the reference's ids exactly and its weights to within the exp2 approximation
(interpreter: fp32 / fp16 / bf16 logits; GPU: the same asserts); the reference is HF's softmax /
top-k / renormalize up to the order of equal logits; the autograd op's gradients are autograd's of
the torch form. The gate in the same launch: the reference's logits (its chunk order), the same
bits whether the chunks are programs or one program's loop, the linear's gradients; a MoE layer
routes through it."""

import pytest
import torch
import torch.nn.functional as F

from minite.execution import Execution
from minite.kernels import router as kr
from minite.nn import router as nr
from minite.ref.router import gate_logits
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # 16-bit: one max over packed keys
def test_equal_logits_go_to_the_lower_expert(dtype):
    x = torch.zeros(4, 16)
    x[2, 5:] = 1.0
    x[3, ::2] = -0.0  # -0 ties +0
    x[3, 9:] = -float("inf")
    w, ids = kr.route(x.to(dtype).to(device()), 4, True)
    assert ids.cpu().tolist() == [[0, 1, 2, 3], [0, 1, 2, 3], [5, 6, 7, 8], [0, 1, 2, 3]]
    assert torch.equal(w.cpu(), torch.full((4, 4), 0.25, dtype=dtype))
    w, ids = kr.route(torch.full((1, 16), -float("inf"), dtype=dtype, device=device()), 2, True)
    assert ids.cpu().tolist() == [[0, 1]]


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


def _gate_inputs(t, h, e, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, generator=g).to(dtype), (torch.randn(e, h, generator=g) / h**0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h,e,k", [(37, 256, 128, 8), (5, 96, 60, 2), (300, 200, 16, 4)])
def test_gate_gives_the_references_logits_and_routes_them(dtype, t, h, e, k):
    x, w = _gate_inputs(t, h, e, dtype)
    logits, wt, ids = kr.gate_route(x.to(device()), w.to(device()), k, True)
    want = gate_logits(x, w)
    assert logits.dtype == dtype and logits.shape == (t, e)
    torch.testing.assert_close(logits.cpu(), want, rtol=RTOL[dtype], atol=RTOL[dtype])
    want_w, want_ids = reference(logits.cpu(), k, True)  # the routing of exactly these logits
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(wt.cpu(), want_w, rtol=RTOL[dtype], atol=0)


@pytest.mark.parametrize("normalize", [True, False])
def test_gate_rows_have_the_same_bits_split_or_not(normalize):
    """Up to SPLIT_MAX_BLOCKS blocks each chunk is a program, beyond one program walks the chunks: the
    same sums in the same order, so a row's logits, weights and counts do not depend on the batch."""
    x, w = _gate_inputs(kr.SPLIT_MAX_BLOCKS * 16 + 20, 384, 16, torch.float32)
    x, w = x.to(device()), w.to(device())
    big = kr.gate_route(x, w, 2, normalize)
    for t in (1, 40):
        small = kr.gate_route(x[:t].contiguous(), w, 2, normalize)
        for a, b in zip(small, big):
            assert torch.equal(a, b[:t])
    assert not kr._SEMAPHORES[x.device].any()  # every block's counter back at zero
    again = kr.gate_route(x[:40].contiguous(), w, 2, normalize)
    assert all(torch.equal(a, b) for a, b in zip(again, small))


def test_gate_counts_each_chunks_picks():
    x, w = _gate_inputs(40, 256, 16, torch.float32)
    _, _, ids, counts = kr.gate_route(x.to(device()), w.to(device()), 8, True, 128)
    flat = F.pad(ids.cpu().reshape(-1), (0, 3 * 128 - 40 * 8), value=16)
    assert torch.equal(counts.long().cpu(), F.one_hot(flat.reshape(3, 128), 17)[:, :, :16].sum(1))


def test_gate_op_gives_the_linears_gradients():
    x, w = _gate_inputs(9, 64, 32, torch.float32)
    g_w, g_l = torch.randn(9, 4), torch.randn(9, 32)
    ex = Execution(elementwise="triton")
    got = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    want = [x.clone().requires_grad_(), w.clone().requires_grad_()]
    logits, wt, ids = nr.gate_route(*got, 4, True, ex)
    hl = F.linear(*want)
    hw, hids = _torch_form(hl, 4, True)
    assert torch.equal(ids, hids)
    ((wt * g_w).sum() + (logits * g_l).sum()).backward()
    ((hw * g_w).sum() + (hl * g_l).sum()).backward()
    for a, b in zip(got, want):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-interpreter test (fp32); on CUDA the "
                    "agreement runs cover the MoE layer")
def test_moe_layer_routes_through_the_kernel(monkeypatch):
    plain, fused, calls = moe_through_fused_kernels(monkeypatch, kr, "gate_route")
    assert calls == 1
    assert torch.equal(plain[1], fused[1])  # the same experts
    for a, b in zip((plain[0], plain[2], *plain[3]), (fused[0], fused[2], *fused[3])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="unit stride"):
        kr.route(torch.zeros(8, 4, device=device()).t(), 2, True)
    with pytest.raises(ValueError, match="top-k"):
        kr.route(torch.zeros(4, 8, device=device()), 9, True)
    x, w = torch.zeros(4, 32, device=device()), torch.zeros(8, 32, device=device())
    with pytest.raises(ValueError, match="unit stride"):
        kr.gate_route(x, w[:, :16], 2, True)
    with pytest.raises(ValueError, match="dtype"):
        kr.gate_route(x, w.half(), 2, True)
    with pytest.raises(ValueError, match="chunk"):
        kr.gate_route(x, w, 2, True, 64)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("normalize", [True, False])
def test_gpu_gate_weights_keep_their_bits_split_or_not(normalize):
    """128 experts, top-8, bf16: a decode step's rows (the split launch) route with the bits they get
    among 2048 tokens (one program a block), the top-k renormalized or not (then the softmax's sum runs
    over every expert, in the layout of the logits read back in both launches)."""
    x, w = _gate_inputs(2048, 2048, 128, torch.bfloat16)
    x, w = x.cuda(), w.cuda()
    big = kr.gate_route(x, w, 8, normalize)
    for t in (1, 64, 128):
        for a, b in zip(kr.gate_route(x[:t].contiguous(), w, 8, normalize), big):
            assert torch.equal(a, b[:t])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_gate_decode_step_shape():
    """Qwen3-30B-A3B's gate (2048 -> 128 experts, top-8, bf16): the reference's logits, a decode step's
    128 tokens (the split launch) with the bits of the same rows in 2048 (one program a block), the
    same again after a launch, and in a CUDA graph."""
    x, w = _gate_inputs(2048, 2048, 128, torch.bfloat16)
    x, w = x.cuda(), w.cuda()
    big = kr.gate_route(x, w, 8, True)
    torch.testing.assert_close(big[0].float(), gate_logits(x, w).float(), rtol=2.0**-7, atol=2.0**-7)
    small = kr.gate_route(x[:128].contiguous(), w, 8, True, 128)
    for a, b in zip(small[:3], big):
        assert torch.equal(a, b[:128])
    want_w, want_ids = reference(small[0].cpu(), 8, True)
    assert torch.equal(small[2].cpu(), want_ids)
    torch.testing.assert_close(small[1].cpu(), want_w, rtol=RTOL[torch.bfloat16], atol=0)
    assert torch.equal(small[3].long().cpu(), F.one_hot(small[2].cpu().reshape(-1, 128), 128).sum(1))
    xs = x[:128].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kr.gate_route(xs, w, 8, True, 128)
    for _ in range(3):
        graph.replay()
    for a, b in zip(out, small):
        assert torch.equal(a, b)
    assert not kr._SEMAPHORES[x.device].any()
