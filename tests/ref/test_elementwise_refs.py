"""The references of the element-wise kernels (norm, RoPE, SwiGLU, the plain log-prob path): their
formulas against torch's own ops, and the log-prob gradient against autograd."""

import torch

from minite.ref import logprobs, norm, rope, swiglu


def test_norm_and_swiglu_are_their_formulas():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g).to(torch.bfloat16), torch.randn(32, generator=g).to(torch.bfloat16)
    xf = x.float()
    want = w * (xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), want, rtol=2**-7, atol=0)  # rsqrt vs 1 / sqrt
    a, b = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    torch.testing.assert_close(swiglu.swiglu(a, b), a * torch.sigmoid(a) * b)  # silu fused: an ulp


def test_rope_rotates_halves():
    x = torch.randn(3, 2, 8)
    cos, sin = torch.zeros(3, 8), torch.ones(3, 8)  # a quarter turn: x -> rotate_half(x)
    assert torch.equal(rope.apply_rope(x, cos, sin), torch.cat((-x[..., 4:], x[..., :4]), -1))


def test_log_prob_gradient_is_autograds():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 50, generator=g, requires_grad=True)
    tokens, w = torch.randint(0, 50, (6,), generator=g), torch.randn(6, generator=g)
    lse = logprobs.row_lse(x.detach(), 0.7)
    lp = torch.log_softmax(x / 0.7, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, x.detach()[torch.arange(6), tokens] / 0.7 - lse)
    (want,) = torch.autograd.grad((lp * w).sum(), x)
    torch.testing.assert_close(logprobs.token_logprob_grad(x.detach(), lse, tokens, w, 0.7), want,
                               rtol=1e-5, atol=1e-6)
