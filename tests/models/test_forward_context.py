"""One forward for every engine: the full-sequence context, output rows, activation checkpointing."""

import pytest
import torch

from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.nn.attention_backends import SequenceAttention
from minite.nn.context import ForwardContext, sequence_context


def _model(moe=False, recipe="aligned"):
    model = Qwen3((tiny_qwen3_moe if moe else tiny_qwen3)(), recipe=recipe).float()
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    return model


def _ids(shape, seed=1):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def test_keyword_arguments_make_the_sequence_context():
    model, ids = _model(), _ids((1, 12))
    cu = torch.tensor([0, 5, 12])
    ctx = sequence_context(ids, cu_seqlens=cu)
    assert isinstance(ctx.attention, SequenceAttention) and ctx.kv_cache is None
    assert ctx.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    with torch.no_grad():
        assert torch.equal(model(ids, context=ctx), model(ids, cu_seqlens=cu))
    with pytest.raises(ValueError, match="context"):
        model(ids, cu_seqlens=cu, context=ctx)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        sequence_context(ids[0])
    with pytest.raises(ValueError, match="cu_seqlens must run from 0"):
        sequence_context(ids, cu_seqlens=torch.tensor([0, 5, 11]))


def test_output_rows_leave_the_layers_before_the_final_norm():
    model, ids = _model(), _ids((3, 6))
    ctx = sequence_context(ids)
    rows = torch.tensor([2, 0])
    normed = []
    model.norm.register_forward_hook(lambda mod, args, out: normed.append(args[0].shape[0]))
    with torch.no_grad():
        full = model(ids, context=ctx)  # [3, 6, V]
        picked = model(ids, context=ForwardContext(ctx.positions, ctx.attention, output_rows=rows))
    assert normed == [3, 2]
    torch.testing.assert_close(picked, full[rows], rtol=1e-6, atol=1e-6)  # other GEMM rows: not bitwise


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_checkpointing_recomputes_each_layer_with_the_same_bits(moe):
    model, ids = _model(moe), _ids((1, 14))
    cu = torch.tensor([0, 9, 14])
    calls = []
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda *a: calls.append(1))
    results = []
    for ckpt in (False, True):
        model.zero_grad()
        calls.clear()
        hidden = model.hidden_states(ids, cu_seqlens=cu, activation_checkpointing=ckpt)
        hidden.square().sum().backward()
        results.append((hidden.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None],
                        len(calls)))
    (h0, g0, n0), (h1, g1, n1) = results
    assert torch.equal(h0, h1) and len(g0) == len(g1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    layers = model.config.num_hidden_layers
    assert n0 == layers and n1 == 2 * layers  # the backward ran every layer again
    with torch.no_grad():  # nothing to recompute without autograd
        calls.clear()
        assert torch.equal(model.hidden_states(ids, cu_seqlens=cu, activation_checkpointing=True), h0)
        assert len(calls) == layers
