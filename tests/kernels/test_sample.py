"""The Triton inverse-CDF draw: the reference's tokens on random rows, never a dropped token, exact
frequencies, rows independent of the batch, clear errors; on the H200 the sampler's shape."""

import pytest
import torch

from minite.kernels import sample as ks
from minite.ref.sample import draw as reference
from tests.kernels.helpers import device


def _rows(b: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """log-softmax rows [b, v] with dropped (-inf) runs: a whole block's worth, and scattered ids."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, v, generator=g) * scale
    z[:, v // 5: v // 5 + 150] = float("-inf")
    z[torch.rand(b, v, generator=g) < 0.3] = float("-inf")
    return torch.log_softmax(z, -1)


@pytest.mark.parametrize("v", [37, 64, 1000], ids=["one-block", "exact-block", "many-blocks"])
def test_kernel_draws_the_references_tokens(v):
    lp = _rows(48, v)
    u = torch.rand(48, generator=torch.Generator().manual_seed(1))
    u[:3] = torch.tensor([0.0, 1 - 2.0**-24, 0.5])
    got = ks.draw(lp.to(device()), u.to(device())).cpu()
    assert torch.equal(got, reference(lp, u))
    assert torch.isfinite(lp.gather(1, got[:, None])).all()


def test_never_a_dropped_token_and_u_zero_picks_the_first_live_one():
    lp = torch.log(torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]))
    # not u = 0.25 itself: on the GPU tl.exp is within 2 ulp, and the step at 0.25 may move by that
    for u, want in [(0.0, 1), (0.2499, 1), (0.2501, 3), (0.9999999, 3)]:
        assert ks.draw(lp.to(device()), torch.tensor([u], device=device())).item() == want
    # the only live token sits after several fully dropped blocks
    lp = torch.full((2, 300), float("-inf"))
    lp[:, 271] = 0.0
    assert ks.draw(lp.to(device()), torch.tensor([0.0, 0.999], device=device())).tolist() == [271, 271]


def test_frequencies_follow_the_probabilities_exactly_on_a_uniform_grid():
    """Probabilities on multiples of 1/8 and u on a grid of 8 * 64 midpoints: each token is drawn
    exactly 64 times per eighth of mass (the cdf steps are exact in fp32)."""
    p = torch.zeros(200)
    p[[3, 70, 71, 150, 199]] = torch.tensor([1, 2, 1, 3, 1]) / 8
    n = 512
    u = (torch.arange(n) + 0.5) / n
    got = ks.draw(p.log().expand(n, -1).contiguous().to(device()), u.to(device())).cpu()
    counts = torch.bincount(got, minlength=200)
    assert counts[[3, 70, 71, 150, 199]].tolist() == [64, 128, 64, 192, 64] and counts.sum() == n


def test_a_rows_token_does_not_depend_on_the_batch():
    lp, u = _rows(40, 700, seed=3), torch.rand(40, generator=torch.Generator().manual_seed(4))
    lp, u = lp.to(device()), u.to(device())
    batch = ks.draw(lp, u)
    for i in (0, 17, 39):
        assert ks.draw(lp[i:i + 1], u[i:i + 1]).item() == batch[i].item()
    assert torch.equal(ks.draw(lp[5:25], u[5:25]), batch[5:25])


def test_bad_inputs_are_clear_errors():
    lp, u = _rows(4, 100).to(device()), torch.rand(4, device=device())
    with pytest.raises(ValueError, match="fp32"):
        ks.draw(lp.double(), u)
    with pytest.raises(ValueError, match="unit stride"):
        ks.draw(lp.t().contiguous().t(), u)
    with pytest.raises(ValueError, match="u must be"):
        ks.draw(lp, u[:3])
    assert ks.draw(lp[:0], u[:0]).shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sampler_shape_agrees_with_the_reference():
    """512 rows over Qwen3's 151936 ids (the rollout benchmark's decode step): never a dropped token,
    the reference's token on all but rounding-width cases, and those adjacent in cdf terms."""
    g = torch.Generator(device="cuda").manual_seed(0)
    z = torch.randn(512, 151936, device="cuda", generator=g) * 4
    z[:, 100_000:] = float("-inf")  # a vocabulary tail the model never uses
    lp = torch.log_softmax(z, -1)
    u = torch.rand(512, device="cuda", generator=g)
    got, want = ks.draw(lp, u), reference(lp, u)
    assert torch.isfinite(lp.gather(1, got[:, None])).all()
    same = (got == want).float().mean().item()
    cdf = torch.cumsum(lp.exp(), -1)
    target = u * cdf[:, -1]
    # where they differ, the target lies within fp32 rounding of the reference's cdf at our token
    at = cdf.gather(1, got[:, None])[:, 0]
    before = torch.where(got > 0, cdf.gather(1, (got - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    slack = 1e-5
    assert same >= 0.99 and ((target <= at + slack) & (target >= before - slack)).all(), same
