"""Row scaling of bf16 values (interpreter on the CPU): bitwise torch's mixed-dtype mul with bf16 out."""

import pytest
import torch

from minite.kernels import scale as ks
from tests.kernels.helpers import device


@pytest.mark.parametrize("shape,per_row", [((5, 7, 48), True), ((37, 3000), True), ((6, 40), False)])
def test_bitwise_torch_mul_with_bf16_out(shape, per_row):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3).to(torch.bfloat16)
    x.view(-1)[:3] = torch.tensor([float("inf"), float("nan"), 3.0e38])
    s = torch.rand(shape[:-1] if per_row else (), generator=g) * 4 + 1e-3
    want = torch.mul(x, s[..., None] if per_row else s, out=torch.empty_like(x))
    got = ks.scale_rows(x.to(device()), s.to(device())).cpu()
    assert torch.equal(got.view(torch.int16)[~want.isnan()], want.view(torch.int16)[~want.isnan()])
    assert torch.equal(got.isnan(), want.isnan())
    inplace = x.to(device())
    ks.scale_rows(inplace, s.to(device()), out=inplace)
    assert torch.equal(inplace.cpu().isnan(), want.isnan())


def test_bad_input_raises():
    with pytest.raises(TypeError, match="bf16"):
        ks.scale_rows(torch.zeros(2, 3), torch.ones(2))
    with pytest.raises(ValueError, match="rows"):
        ks.scale_rows(torch.zeros(2, 3, dtype=torch.bfloat16), torch.ones(3))


@pytest.mark.gpu
def test_gpu_backward_helper_equals_torch():
    from minite.nn.nvfp4_matmul import _scale_bf16

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(3, 1000, 2048, device="cuda", generator=g).to(torch.bfloat16)
    for shape in ((1, 1, 1), (3, 1, 1), (3, 1000, 1)):
        s = torch.rand(*shape, device="cuda", generator=g)
        want = torch.mul(x, s, out=torch.empty_like(x))
        assert torch.equal(_scale_bf16(x, s), want)
        y = x.clone()
        _scale_bf16(y, s, inplace=True)
        assert torch.equal(y, want)
