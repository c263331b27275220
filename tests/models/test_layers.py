"""RMSNorm, RoPE and causal GQA attention against independent formulations."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3 import modeling_qwen3

from minite.nn.attention import attention, varlen_attention
from minite.nn.norm import RMSNorm, rms_norm
from minite.nn.rope import apply_rope, rope_cos_sin

TOL = 1e-6


def _sdpa_reference(q, k, v):
    """Causal SDPA with key/value heads repeated; q [B, T, Hq, D], k/v [B, T, Hkv, D]."""
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _qkv(B=2, T=9, Hq=6, Hkv=2, D=16, dtype=torch.float32):
    return (torch.randn(B, T, Hq, D, dtype=dtype), torch.randn(B, T, Hkv, D, dtype=dtype),
            torch.randn(B, T, Hkv, D, dtype=dtype))


@pytest.mark.parametrize("Hkv", [1, 2, 6])
def test_attention_matches_sdpa(Hkv):
    q, k, v = _qkv(Hkv=Hkv)
    pos = torch.arange(9).expand(2, 9)
    torch.testing.assert_close(attention(q, k, v, pos, pos), _sdpa_reference(q, k, v), atol=TOL, rtol=TOL)


def test_cached_keys_and_fresh_keys_are_alike():
    q, k, v = _qkv(B=1, T=7)
    pos = torch.arange(7)[None]
    full = attention(q, k, v, pos, pos)
    # decode the last token against a "cache" with keys in shuffled slots and two empty (-1) slots
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    k_cache = torch.cat([k[:, perm], torch.randn(1, 2, 2, 16)], dim=1)
    v_cache = torch.cat([v[:, perm], torch.randn(1, 2, 2, 16)], dim=1)
    k_pos = torch.cat([perm, torch.tensor([-1, -1])])[None]
    step = attention(q[:, 6:], k_cache, v_cache, pos[:, 6:], k_pos)
    torch.testing.assert_close(step, full[:, 6:], atol=TOL, rtol=TOL)


def test_query_without_visible_key_gives_zeros():
    q, k, v = _qkv(B=1, T=3)
    out = attention(q, k, v, torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]))
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and torch.isfinite(out).all()


def test_varlen_equals_separate_and_checks_bounds():
    q, k, v = (t[0] for t in _qkv(B=1, T=10))
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 2, 3, 4, 5])
    cu = torch.tensor([0, 3, 4, 10])
    out = varlen_attention(q, k, v, pos, cu)
    for a, b in [(0, 3), (3, 4), (4, 10)]:
        ref = _sdpa_reference(q[None, a:b], k[None, a:b], v[None, a:b])[0]
        torch.testing.assert_close(out[a:b], ref, atol=TOL, rtol=TOL)
    with pytest.raises(ValueError, match="cu_seqlens"):
        varlen_attention(q, k, v, pos, torch.tensor([0, 3, 9]))


def test_attention_bf16_keeps_dtype_and_rejects_bad_shapes():
    q, k, v = _qkv(dtype=torch.bfloat16)
    pos = torch.arange(9).expand(2, 9)
    out = attention(q, k, v, pos, pos)
    assert out.dtype == torch.bfloat16
    ref = _sdpa_reference(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="incompatible shapes"):
        attention(q[:, :, :5], k, v, pos, pos)


def test_rms_norm_formula_and_hf():
    x = torch.randn(3, 5, 32) * 4
    norm = RMSNorm(32, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    expected = norm.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), expected, atol=TOL, rtol=TOL)
    hf = modeling_qwen3.Qwen3RMSNorm(32, eps=1e-5)
    hf.weight.data.copy_(norm.weight.data)
    xb = x.bfloat16()
    assert torch.equal(rms_norm(xb, norm.weight.data.bfloat16(), 1e-5), hf.bfloat16()(xb))


def test_rope_matches_hf_and_is_relative():
    x = torch.randn(2, 6, 4, 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 9, 11, 100, 1000, 4096]])
    cos, sin = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    ref, _ = modeling_qwen3.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    torch.testing.assert_close(apply_rope(x, cos, sin), ref.transpose(1, 2), atol=TOL, rtol=TOL)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def score(i, j):
        ci, si = rope_cos_sin(torch.tensor([[i]]), 16, 10000.0, torch.float64)
        cj, sj = rope_cos_sin(torch.tensor([[j]]), 16, 10000.0, torch.float64)
        return (apply_rope(q, ci, si) * apply_rope(k, cj, sj)).sum()

    torch.testing.assert_close(score(5, 2), score(13, 10), atol=1e-6, rtol=1e-6)
