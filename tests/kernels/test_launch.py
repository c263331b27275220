"""`minite.kernels.launch`: the specialization key, and direct launches giving Triton's own results."""

import pytest
import torch

from minite.kernels import launch


def _key(args, meta=None):
    return launch.specialization_key("kernel", meta or {"BLOCK": 64, "num_warps": 4}, args, 0)


def test_key_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.bfloat16)
    assert _key((x, 7)) == _key((torch.ones(64, dtype=torch.bfloat16), 9))  # same specialization
    assert _key((x, 7)) != _key((x.float(), 7))  # dtype
    assert _key((x, 7)) != _key((x[1:], 7))  # 16-byte alignment of the data pointer
    ints = [_key((x, v)) for v in (1, 2, 16, 2**40, 2**63)]  # == 1, % 16, 64-bit range, unsigned
    assert len(set(ints)) == len(ints)
    assert _key((x, 7), {"BLOCK": 64, "num_warps": 8}) != _key((x, 7))  # constexprs and options


def test_key_declines_what_it_does_not_cover():
    x = torch.zeros(8)
    assert _key((x, None)) is None
    assert _key((x, [1, 2])) is None


def test_only_plain_constexprs_are_cached():
    """The constexpr tail comes from meta in signature order; a missing one (Triton fills its default)
    or a tensor there (the cache would keep it alive) leaves the launch on Triton's path."""
    class Kernel:
        arg_names = ["x_ptr", "n", "BLOCK", "EVEN"]

    assert launch._constexpr_tail(Kernel, 2, {"EVEN": True, "BLOCK": 64, "num_warps": 4}) == (64, True)
    assert launch._constexpr_tail(Kernel, 2, {"BLOCK": 64}) is None
    assert launch._constexpr_tail(Kernel, 2, {"BLOCK": 64, "EVEN": torch.zeros(1)}) is None


def test_host_helpers_equal_triton_s():
    import triton

    for n in [0, 1, 2, 3, 15, 16, 17, 1000, 2**31 + 5]:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 16, 128):
            assert launch.cdiv(n, d) == triton.cdiv(n, d)


@pytest.mark.gpu
def test_gpu_direct_launches_equal_triton_s(monkeypatch):
    """scale_rows and the W4A4 GEMM through the direct path (repeat launches, an unaligned view
    that needs its own specialization) equal their results on Triton's own launch path."""
    from minite.kernels import gemm as kg
    from minite.kernels import nvfp4 as kq
    from minite.kernels.scale import scale_rows

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 1030, device="cuda", generator=g).to(torch.bfloat16)
    s = torch.rand(300, device="cuda", generator=g)
    a, sa = kq.quantize_unscaled(torch.randn(300, 512, device="cuda", generator=g).to(torch.bfloat16))
    wq = kq.quantize(torch.randn(256, 512, device="cuda", generator=g), "tensor")
    w = kg.unscaled_copy(wq)
    views = (x[:, :1024], x[:, 3:1027], x[:, :1024].contiguous())

    def run():
        return [scale_rows(v, s) for v in views] + [kg.w4a4_gemm(a, sa, w, wq.global_scale) for _ in range(2)]

    with monkeypatch.context() as m:  # Triton's own path: as while a profiler's launch hooks are installed
        m.setattr(launch, "_hooks_installed", lambda: True)
        want = run()
    launch._COMPILED.clear()
    first, again = run(), run()
    assert len(launch._COMPILED) >= 3  # the aligned and unaligned scale_rows, the GEMM
    for got in (first, again):
        assert all(torch.equal(u, v) for u, v in zip(got, want, strict=True))
