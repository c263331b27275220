"""`gemm.gemm_segments`: several weights concatenated along N in one launch give each weight's own
`gemm_on_copy` bits (the fused q/k/v and gate/up projections rely on it)."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available
from minite.kernels import gemm as kg
from tests.kernels.helpers import device
from tests.kernels.test_gemm import heavy

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def _weights(widths, k, seed):
    dev, dt = device(), kg.operand_dtype(device())
    qs = [nvfp4.quantize(heavy(n, k, seed + i) * (i + 1), "tensor") for i, n in enumerate(widths)]
    copies = [q.unscaled().to(dev, dt) for q in qs]
    scales = [q.global_scale.reshape(()).to(dev) for q in qs]
    return copies, scales, [q.amax.reshape(()).to(dev) for q in qs]


def _tiles():
    if device() == "cpu":
        tile = kg.CONFIGS["interpret"]
        return [tile, dict(tile, BN=64), dict(tile, TMA=True, PERSIST=0)]
    return [kg.pick_config("aligned", 300, 1), kg.pick_config("aligned", 4096, 1), kg.CONFIGS["aligned_wave"],
            kg.CONFIGS["aligned_waves"], dict(BM=64, BN=64, BK=64, GROUP_M=4, num_warps=4, num_stages=3)]


@pytest.mark.parametrize("widths", [(48, 16, 16), (32, 96), (40, 24, 8)])
@pytest.mark.parametrize("epilogue", ["sdec", "alpha", "bf16_scalar"])
def test_each_segment_has_its_own_gemms_bits(widths, epilogue):
    """Segments narrower than a tile and boundaries inside tiles included; both output dtypes."""
    m, k = (70 if device() == "cpu" else 300), 128
    xq = nvfp4.quantize(heavy(m, k, 9), "row")
    a = xq.unscaled().to(device(), kg.operand_dtype(device()))
    sa = (xq.amax if epilogue == "alpha" else xq.global_scale).reshape(-1).to(device())
    copies, sdec, amax = _weights(widths, k, 20)
    sw = amax if epilogue == "alpha" else sdec
    w = torch.cat(copies)
    sws = torch.stack([*sw, sw[-1]][:3])
    for cfg in _tiles():
        for out_dtype in (torch.float32, torch.bfloat16 if device() == "cuda" else torch.float16):
            outs = kg.gemm_segments(a, sa, w, sws, widths, epilogue, out_dtype, cfg)
            assert [tuple(o.shape) for o in outs] == [(m, n) for n in widths]
            for o, c, s in zip(outs, copies, sw):
                assert o.is_contiguous()
                alone = kg.gemm_on_copy(a, sa, c, s, epilogue, out_dtype, cfg)
                assert torch.equal(o, alone), (cfg, out_dtype)


def test_aligned_configs_share_bk():
    """The fused projections pad their concatenated copy to one BK for every M."""
    assert {kg.CONFIGS[c]["BK"] for c in ("aligned", "aligned_wave", "aligned_waves", "aligned_large")} == {
        kg.CONFIGS["aligned"]["BK"]}


def test_bad_widths_raise():
    dev, dt = device(), kg.operand_dtype(device())
    a, w = torch.zeros(4, 64, dtype=dt, device=dev), torch.zeros(48, 64, dtype=dt, device=dev)
    one = torch.ones(1, device=dev)
    cfg = kg.pick_config("aligned", 4, 48)
    for widths in ((48,), (16, 16), (16, 16, 8, 8), (48, 0)):
        with pytest.raises(ValueError, match="widths"):
            kg.gemm_segments(a, one, w, torch.ones(3, device=dev), widths, "sdec", torch.float32, cfg)
    with pytest.raises(ValueError, match="2\\^31"):
        kg.gemm_segments(a[:1].expand(2**26, 64), one, w, torch.ones(3, device=dev), (16, 32), "sdec",
                         torch.float32, cfg)
    with pytest.raises(ValueError, match="3 scales"):
        kg.gemm_segments(a, one, w, torch.ones(2, device=dev), (16, 32), "sdec", torch.float32, cfg)
