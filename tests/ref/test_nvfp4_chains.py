"""The `vllm` and `torchao` chains differ from `te` where docs/numerics.md's engine table says they
do, and only there."""

import torch

from minite.nvfp4 import dequantize, quantize
from minite.ref.nvfp4 import global_scales


def unit_global_scale_input(seed: int) -> torch.Tensor:
    """Random blocks in a tensor of amax 2688: every chain then has S_enc = S_dec = 1 exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-1, 2, 64)[:, None]
    x[0, 0] = 2688.0
    return x


def same(a, b) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.block_scales.float(), b.block_scales.float())
            and torch.equal(a.global_scale, b.global_scale))


def test_chains_agree_when_scales_are_exact():
    for seed in range(3):
        x = unit_global_scale_input(seed)
        te = quantize(x)
        assert te.block_scales.float().min() >= 2.0**-6  # no block in the range where torchao clamps
        assert same(te, quantize(x, chain="vllm")) and same(te, quantize(x, chain="torchao"))


def test_chains_mostly_agree_on_random_data():
    x = torch.randn(256, 256) * 0.02
    te = quantize(x).codes
    for chain in ("vllm", "torchao"):
        assert (quantize(x, chain=chain).codes == te).float().mean() > 0.99


def test_vllm_global_scale_rounds_differently():
    # te: S_dec = 1 / (2688 / amax); vllm: S_dec = amax / 2688. Find an amax where they differ.
    amax = torch.rand(4096, generator=torch.Generator().manual_seed(0)) * 10 + 0.1
    te_dec = global_scales(amax, "te")[1]
    vllm_dec = global_scales(amax, "vllm")[1]
    differ = te_dec != vllm_dec
    assert differ.any()
    a = float(amax[differ][0])
    x = torch.full((1, 16), a / 3)
    x[0, 0] = a
    assert not torch.equal(quantize(x).global_scale, quantize(x, chain="vllm").global_scale)


def test_vllm_zeroes_codes_of_zero_scale_blocks():
    x = torch.zeros(1, 32)
    x[0, 0] = 1e4
    x[0, 16:] = 1e4 * 2.0**-22  # block scale underflows to 0
    te, vllm = quantize(x), quantize(x, chain="vllm")
    assert te.block_scales.float()[0, 1] == 0 and vllm.block_scales.float()[0, 1] == 0
    # te's element scale becomes FLT_MAX (codes saturate at 6); vllm's is 0 (codes 0). Both decode to 0.
    assert (te.codes[0, 8:] == 0x77).all() and (vllm.codes[0, 8:] == 0).all()
    assert torch.equal(dequantize(te), dequantize(vllm))


def test_torchao_floors_small_block_scales():
    x = torch.zeros(1, 32)
    x[0, 0] = 1e4
    x[0, 16:] = 1e4 * 2.0**-17 * torch.linspace(0.1, 1, 16)  # te: subnormal scale; torchao: 2^-6
    te, ao = quantize(x), quantize(x, chain="torchao")
    assert te.block_scales.float()[0, 1] < 2.0**-6 and ao.block_scales.float()[0, 1] == 2.0**-6
    assert not torch.equal(te.codes, ao.codes)
    err_te = (dequantize(te) - x)[0, 16:].norm()
    err_ao = (dequantize(ao) - x)[0, 16:].norm()
    assert err_ao > err_te  # the floor costs precision on small blocks
