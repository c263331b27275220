"""The plain distribution's log-probs on the kernels: row log-sum-exp close to torch's, token log-probs
and their gradient close to the torch path's, a row's bits independent of its batch, and the sampler's
log-prob the learner's bit for bit (interpreter: fp32 / fp16; GPU: bf16 at Qwen3's vocabulary)."""

import pytest
import torch

from minite.execution import Execution
from minite.kernels import logprobs as kl
from minite.nn import token_logprobs as kp
from minite.sampler.sample import sample
from minite.sampling import SamplingParams, processed_logprobs, token_logprobs
from tests.kernels.helpers import device

LSE_RTOL = 1e-6  # a few fp32 ulps: the GPU's exp, another summation order


def _logits(r, v, dtype, seed=0, dev=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(r, v, generator=g) * 3).to(dtype).to(dev or device())


KERNELS, TORCH = Execution(elementwise="triton"), Execution(elementwise="ref")


@pytest.fixture
def kernels_on():
    return KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_lse_is_torchs_logsumexp(dtype, temperature):
    x = _logits(6, 333, dtype)
    want = torch.logsumexp(x.float() / temperature, -1)
    torch.testing.assert_close(kl.row_lse(x, temperature), want, rtol=LSE_RTOL, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_gradient_close_to_the_torch_path(kernels_on, temperature):
    x = _logits(7, 200, torch.float32)
    tokens = torch.randint(0, 200, (7,), generator=torch.Generator().manual_seed(1)).to(x.device)
    g = torch.randn(7).to(x.device)
    got_x, want_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = token_logprobs(got_x, tokens, temperature, execution=kernels_on)
    want = token_logprobs(want_x, tokens, temperature, execution=TORCH)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    got.backward(g)
    want.backward(g)
    torch.testing.assert_close(got_x.grad, want_x.grad, rtol=0, atol=1e-6)


def test_a_rows_log_prob_does_not_depend_on_the_batch(kernels_on):
    x = _logits(9, 300, torch.float16, seed=2)
    tokens = torch.arange(9, device=x.device) * 7
    full = token_logprobs(x, tokens, execution=kernels_on)
    for rows in (slice(0, 1), slice(3, 8)):
        assert torch.equal(token_logprobs(x[rows], tokens[rows], execution=kernels_on), full[rows])


def test_sampler_reports_the_learners_log_prob_bitwise(kernels_on):
    x = _logits(12, 250, torch.float16, seed=3)
    keys, steps = torch.arange(12, device=x.device), torch.full((12,), 3, device=x.device)
    params = [SamplingParams(temperature=0.8)] * 6 + [SamplingParams(temperature=1.0)] * 6
    tok, lp = sample(x, params, keys, steps, kernels_on)
    for rows, t in ((slice(0, 6), 0.8), (slice(6, 12), 1.0)):
        assert torch.equal(lp[rows], token_logprobs(x[rows], tok[rows], t, execution=kernels_on))
        ref = processed_logprobs(x[rows], t).gather(1, tok[rows, None])[:, 0]
        torch.testing.assert_close(lp[rows], ref, rtol=0, atol=1e-5)
    assert torch.isfinite(lp).all()


def test_learner_log_probs_and_gradients_through_the_kernel_path():
    """A tiny model's packed, chunked learner log-probs (checkpointed head): the kernel path within 1e-5
    of torch's, and gradients within 1e-5 relative."""
    from minite.learner import sequence_logprobs
    from tests.learner.helpers import random_batch, tiny_model

    batch = random_batch(params=SamplingParams(temperature=0.9))
    results = []
    for execution in (TORCH, KERNELS):
        model = tiny_model()
        model.set_recipe(model.recipe.replace(execution=execution))
        lp = sequence_logprobs(model, batch, chunk_rows=5)
        (lp * batch.mask()).sum().backward()
        results.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=1e-5)
    assert ((results[1][1] - results[0][1]).norm() / results[0][1].norm()).item() < 1e-5


def test_cut_and_greedy_distributions_keep_the_torch_path(kernels_on):
    x = _logits(3, 100, torch.float32)
    on = kernels_on
    assert not kp.plain_applies(x, 1.0, 5, 1.0, on) and not kp.plain_applies(x, 1.0, 0, 0.9, on)
    assert not kp.plain_applies(x, 0.0, 0, 1.0, on) and kp.plain_applies(x, 1.0, 100, 1.0, on)


def test_bad_inputs_are_clear_errors():
    x = _logits(3, 50, torch.float32)
    with pytest.raises(ValueError, match="unit stride"):
        kl.row_lse(x.t().contiguous().t())
    with pytest.raises(ValueError, match="temperature"):
        kl.row_lse(x, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_vocabulary_scale_sampler_equals_learner_and_is_close_to_torch():
    """bf16 logits over 151936 ids: the sampler's 512-row step and the learner's chunks of 300 / 212
    rows give the same bits; torch's log-softmax within 2e-5; the gradient close to autograd's."""
    x = _logits(512, 151936, torch.bfloat16, dev="cuda")
    keys, steps = torch.arange(512, device="cuda"), torch.full((512,), 5, device="cuda")
    tok, lp = sample(x, [SamplingParams(temperature=1.0)] * 512, keys, steps)
    learner = torch.cat([token_logprobs(x[:300], tok[:300]), token_logprobs(x[300:], tok[300:])])
    assert torch.equal(lp, learner)
    ref = torch.log_softmax(x.float(), -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=0, atol=2e-5)
    xg, xr = x[:64].clone().requires_grad_(), x[:64].float().requires_grad_()
    g = torch.randn(64, device="cuda")
    token_logprobs(xg, tok[:64]).backward(g)
    torch.log_softmax(xr, -1).gather(1, tok[:64, None])[:, 0].backward(g)
    torch.testing.assert_close(xg.grad.float(), xr.grad, rtol=2**-8, atol=1e-7)  # bf16 gradients
