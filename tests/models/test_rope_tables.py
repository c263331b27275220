"""One cos/sin table per forward: every layer gets the first layer's tables, with identical outputs."""

import contextlib

import torch

from minite.models import Qwen3, qwen3, tiny_qwen3
from minite.nn import forward_scope, rope


def test_layers_share_one_table_per_forward_and_outputs_are_unchanged(monkeypatch):
    model = Qwen3(tiny_qwen3(num_hidden_layers=3), recipe="bf16").float()
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    computed = []
    real = rope._rope_cos_sin
    monkeypatch.setattr(rope, "_rope_cos_sin", lambda *a: computed.append(1) or real(*a))
    shared = model(ids)
    assert len(computed) == 1  # not one per layer
    assert not forward_scope._STACK  # the memo lives only inside a forward
    computed.clear()
    monkeypatch.setattr(qwen3, "forward_scope", contextlib.nullcontext)
    assert torch.equal(model(ids), shared) and len(computed) == 3


def test_the_memo_never_serves_another_positions_tensor():
    with forward_scope.forward_scope():
        a = rope.rope_cos_sin(torch.arange(5), 8, 1e4, torch.float32)
        b = rope.rope_cos_sin(torch.arange(5) + 3, 8, 1e4, torch.float32)
        again = rope.rope_cos_sin(torch.arange(5) + 3, 8, 1e4, torch.float32)
    assert not torch.equal(a[0], b[0])
    assert torch.equal(b[0], again[0])
