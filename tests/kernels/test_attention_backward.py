"""The attention backward: the reference against autograd, the Triton kernels against the reference
(interpreter on tiny shapes, the GPU in bf16 at the learner's head shapes), bitwise run to run."""

import pytest
import torch

from minite.kernels.attention import contiguous_attention
from minite.kernels.attention_backward import contiguous_attention_backward
from minite.nn.attention import varlen_attention
from minite.ref import attention as ref
from tests.kernels.helpers import device

# relative RMS error of a gradient against the fp32 reference (p and dS enter the MMAs in the dtype)
REL_RMS = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


def packed(lens, Hq, Hkv, D, dtype, dev, seed=0):
    """Packed sequences of `lens` tokens: q, k, v, dO and the layout (seq, pos, kv_start, lens, cu)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype).to(dev) for h in (Hq, Hkv, Hkv))
    grad = torch.randn(n, Hq, D, generator=g).to(dtype).to(dev)
    lengths = torch.tensor(lens, device=dev)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), lengths)
    pos = torch.cat([torch.arange(m, device=dev) for m in lens])
    return q, k, v, grad, (seq, pos, cu[:-1], lengths, cu)


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def kernel_grads(q, k, v, grad, layout):
    seq, pos, start, lengths, _ = layout
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    out = contiguous_attention(q, k, v, seq, pos, start, lengths, lse=lse)
    return out, lse, contiguous_attention_backward(grad, q, k, v, out, lse, seq, pos, start, lengths)


def test_reference_matches_autograd():
    """The reference's formulas equal autograd through the exact attention (fp32)."""
    q, k, v, grad, layout = packed([5, 17, 33, 1], 6, 2, 16, torch.float32, "cpu")
    seq, pos, start, lengths, cu = layout
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(varlen_attention(*inputs, pos, cu), inputs, grad)
    got = ref.contiguous_attention_backward(grad, q, k, v, seq, pos, start, lengths)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (2, 2)])
def test_kernel_matches_reference(dtype, heads):
    """Odd lengths (a single token, a sequence past several tiles), GQA groups of 1-3."""
    q, k, v, grad, layout = packed([5, 40, 1, 18], *heads, 16, dtype, device())
    seq, pos, start, lengths, _ = layout
    out, lse, got = kernel_grads(q, k, v, grad, layout)
    want = ref.contiguous_attention_backward(grad.float(), q.float(), k.float(), v.float(), seq, pos, start,
                                             lengths)
    for a, b in zip(got, want):
        assert a.dtype == dtype and rel_rms(a, b) < REL_RMS[dtype]
    assert torch.equal(out, contiguous_attention(q, k, v, seq, pos, start, lengths))  # lse changes no bit
    s = torch.einsum("nhd,mhd->hnm", q.float(), k.float().repeat_interleave(heads[0] // heads[1], 1))
    visible = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    want_lse = torch.logsumexp(s * q.shape[-1] ** -0.5 + torch.where(visible, 0.0, float("-inf")), -1).T
    torch.testing.assert_close(lse * ref.LOG2E ** -1, want_lse, rtol=0, atol=1e-3)


def test_kernel_is_deterministic():
    q, k, v, grad, layout = packed([23, 9], 4, 2, 16, torch.float16, device(), seed=1)
    first = kernel_grads(q, k, v, grad, layout)[2]
    second = kernel_grads(q, k, v, grad, layout)[2]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_bad_inputs_are_rejected():
    q, k, v, grad, (seq, pos, start, lengths, _) = packed([4, 3], 2, 1, 16, torch.float32, device())
    out, lse, _ = kernel_grads(q, k, v, grad, (seq, pos, start, lengths, None))
    with pytest.raises(ValueError, match="lse must be"):
        contiguous_attention_backward(grad, q, k, v, out, lse.double(), seq, pos, start, lengths)
    with pytest.raises(ValueError, match="lse must be"):
        contiguous_attention(q, k, v, seq, pos, start, lengths, lse=lse[:, :1])
    with pytest.raises(ValueError, match="out / grad"):
        contiguous_attention_backward(grad[:5], q, k, v, out, lse, seq, pos, start, lengths)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 4)])
def test_gpu_bf16_matches_reference(heads):
    """The learner's head shapes (Qwen3-1.7B 16 / 8, Qwen3-30B-A3B 32 / 4; D 128) in bf16, sequences
    of 1 to 1030 tokens: close to the fp32 reference, the same bits on a second run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, grad, layout = packed([300, 1030, 1, 77], *heads, 128, torch.bfloat16, "cuda")
    seq, pos, start, lengths, _ = layout
    _, _, got = kernel_grads(q, k, v, grad, layout)
    want = ref.contiguous_attention_backward(grad.float(), q.float(), k.float(), v.float(), seq, pos, start,
                                             lengths)
    errors = [rel_rms(a, b) for a, b in zip(got, want)]
    assert max(errors) < REL_RMS[torch.bfloat16], errors
    again = kernel_grads(q, k, v, grad, layout)[2]
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.gpu
def test_gpu_model_gradients_match_the_reference_backward():
    """A bf16 model's parameter gradients through the Triton backward against the reference backward
    (fp32 recompute under autograd) on packed sequences: close (bf16 p and dS in the MMAs)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from minite.models import Qwen3, tiny_qwen3
    from minite.recipe import get_recipe

    cfg = tiny_qwen3(hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=1024)
    model = Qwen3(cfg, recipe="bf16").to(device="cuda", dtype=torch.bfloat16)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, cfg.vocab_size, (1, 700), generator=torch.Generator().manual_seed(1)).cuda()
    cu = torch.tensor([0, 300, 301, 700], device="cuda")
    probe = torch.randn(1, 700, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).cuda()
    grads = []
    for backward in ("kernel", "reference"):
        model.set_recipe(get_recipe("bf16").with_execution(attention_backward=backward))
        model.zero_grad(set_to_none=True)
        (model.hidden_states(ids, cu_seqlens=cu).float() * probe).sum().backward()
        grads.append([p.grad.float() for p in model.parameters() if p.grad is not None])
    errors = [rel_rms(a, b) for a, b in zip(*grads)]
    assert len(errors) > 10 and max(errors) < 3e-2, errors
