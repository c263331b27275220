"""The Triton SwiGLU (CPU interpreter; GPU with the `gpu` marker) against torch's `F.silu(gate) * up`,
and its fused quantizer bitwise against the quantize kernel run on its output."""

import pytest
import torch
import torch.nn.functional as F

from minite.kernels import nvfp4 as kq
from minite.kernels import swiglu as ks
from tests.kernels.helpers import ZeroFills

# one rounding to the 16-bit dtype away from torch's (exp differs in the last fp32 bit now and then
# between libraries): at most one ulp of the output (2^-7 of it for bf16, 2^-10 for fp16)
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _same(a, b):
    assert a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _gate_up(rows, width, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * width, generator=g, device=device) * 3).to(dtype)
    return gate_up.chunk(2, dim=-1)  # views with row stride 2 * width, as the MoE experts give them


def _close_to_torch(h, gate, up):
    want = F.silu(gate) * up
    diff = (h.float() - want.float()).abs()
    assert (diff <= ULP[h.dtype] * want.float().abs()).all()
    return (h == want).float().mean().item()


@pytest.mark.parametrize("dtype,rows,width", [(torch.bfloat16, 5, 48), (torch.float16, 9, 80),
                                              (torch.bfloat16, 3, 256), (torch.bfloat16, 4, 100)])
def test_matches_torch_and_is_batch_invariant(dtype, rows, width):
    gate, up = _gate_up(rows, width, dtype, 0)
    h = ks.swiglu(gate, up)
    assert h.dtype == dtype and h.shape == gate.shape and h.is_contiguous()
    assert _close_to_torch(h, gate, up) > 0.9
    for r in (1, rows - 1):
        _same(ks.swiglu(gate[-r:], up[-r:]), h[-r:])


@pytest.mark.parametrize("dtype,chain,chunk,width", [
    (torch.bfloat16, "te", 1024, 64), (torch.float16, "vllm", 1024, 64), (torch.bfloat16, "te", 1024, 96),
    (torch.bfloat16, "te", 8, 64)])
def test_fused_quantizer_is_bitwise_the_quantize_kernel(dtype, chain, chunk, width, monkeypatch):
    """Chunk 1024 (7 rows): each row quantized in one pass from registers (width 96: one masked chunk of 64
    words); chunk 8: the row's four chunks walked twice (h and its amax, then h read back)."""
    monkeypatch.setattr(ks, "CHUNK_WORDS", chunk)
    gate, up = _gate_up(7, width, dtype, 1)
    gate[2] = 0.0
    up[4, 5] = float("nan")
    h, vals, sdec, amax = ks.swiglu_quantize(gate, up, torch.float16, chain)
    _same(h, ks.swiglu(gate, up))
    wv, ws, _, _, wa = kq.quantize_unscaled(h, torch.float16, chain, return_codes=True)
    for got, ref in ((vals, wv), (sdec, ws), (amax, wa)):
        _same(got, ref)
    assert torch.isnan(sdec[4]).all() and not torch.isnan(sdec[5:]).any()


def test_gradients_are_autograds():
    """The backward runs autograd's own ops on the recomputed silu: the same bits."""
    gate, up = (t.detach().clone().requires_grad_() for t in _gate_up(6, 32, torch.bfloat16, 2))
    dh = torch.randn(6, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    h, vals, _, _ = ks.swiglu_quantize(gate, up, torch.float16)
    assert not vals.requires_grad
    got = torch.autograd.grad(h, (gate, up), dh)
    want = torch.autograd.grad(F.silu(gate) * up, (gate, up), dh)
    for a, b in zip(got, want, strict=True):
        _same(a, b)


def test_backward_makes_no_zero_gradients_for_the_quantized_outputs():
    """The quantized values, S_dec and amax are not differentiable: autograd does not zero-fill
    gradients for them (a memset of the [rows, I] values each backward on the GPU)."""
    counts = []
    for quantize in (False, True):
        gate, up = (t.detach().clone().requires_grad_() for t in _gate_up(6, 32, torch.bfloat16, 2))
        h = ks.swiglu_quantize(gate, up, torch.float16)[0] if quantize else ks.swiglu(gate, up)
        with ZeroFills() as fills:
            h.backward(torch.ones_like(h))
        counts.append(fills.count)
        assert gate.grad is not None and up.grad is not None
    assert counts[1] == counts[0]


def test_bad_input_raises():
    gate, up = _gate_up(2, 32, torch.bfloat16, 4)
    with pytest.raises(ValueError, match="one shape"):
        ks.swiglu(gate.float(), up.float())
    with pytest.raises(ValueError, match="one shape"):
        ks.swiglu(gate, up[:, :16])
    g, u = _gate_up(2, 40, torch.bfloat16, 5)
    with pytest.raises(ValueError, match="multiple of 16"):
        ks.swiglu_quantize(g, u)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        ks.swiglu_quantize(gate, up, torch.float32)


@pytest.mark.gpu
def test_gpu_bf16_matches_torch_and_quantizes_bitwise():
    for rows, width in ((3000, 768), (1024, 768), (600, 12288)):  # two passes, one pass, chunked
        gate, up = _gate_up(rows, width, torch.bfloat16, 6, "cuda")
        h, vals, sdec, amax = ks.swiglu_quantize(gate, up)
        assert _close_to_torch(h, gate, up) >= 0.999
        wv, ws, _, _, wa = kq.quantize_unscaled(h, torch.bfloat16, return_codes=True)
        for got, ref in ((vals, wv), (sdec, ws), (amax, wa)):
            _same(got, ref)
        for r in (1, 7, 64):
            _same(ks.swiglu(gate[:r], up[:r]), h[:r])
