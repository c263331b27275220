"""Packed (varlen) attention equals attention run on each sequence alone, forward and backward."""

import importlib

import pytest
import torch

from minite.nn.attention import attention, varlen_attention

attn_mod = importlib.import_module("minite.nn.attention")  # the module; minite.nn.attention is the function

LENGTHS = [5, 1, 9, 3, 9, 2]


def per_sequence(q, k, v, pos, cu):
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        p = pos[None, a:b]
        outs.append(attention(q[None, a:b], k[None, a:b], v[None, a:b], p, p)[0])
    return torch.cat(outs)


@pytest.mark.parametrize("budget", [attn_mod.VARLEN_SCORE_BUDGET, 4 * 81])  # one group / many groups
def test_varlen_matches_per_sequence(monkeypatch, budget):
    monkeypatch.setattr(attn_mod, "VARLEN_SCORE_BUDGET", budget)
    g = torch.Generator().manual_seed(0)
    N = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in LENGTHS])
    q = torch.randn(N, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(N, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(N, 2, 8, generator=g, requires_grad=True)
    out = varlen_attention(q, k, v, pos, cu)
    ref = per_sequence(q, k, v, pos, cu)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
