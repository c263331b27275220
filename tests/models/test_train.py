"""Recipe placement in the model and a tiny Qwen3 training on CPU under the aligned NVFP4 recipe."""

import pytest
import torch
import torch.nn.functional as F

from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.recipe import get_recipe

STEPS = 8


def test_recipe_placement_and_switch():
    recipe = get_recipe("aligned", bf16_first_layers=1, bf16_last_layers=1)
    model = Qwen3(tiny_qwen3_moe(num_hidden_layers=4), recipe=recipe)
    names = [[m.recipe.name for m in layer.quantizable_modules()] for layer in model.layers]
    # qkv_proj, o_proj, the experts
    assert names == [["bf16"] * 3, ["aligned"] * 3, ["aligned"] * 3, ["bf16"] * 3]
    assert all(layer.mlp.gate.recipe.name == "bf16" for layer in model.layers)
    model.set_recipe("te")
    assert {m.recipe.name for layer in model.layers for m in layer.quantizable_modules()} == {"te"}
    assert all(layer.mlp.gate.recipe.name == "bf16" for layer in model.layers)
    model.set_recipe("bf16")
    ids = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        ref = model(ids)
        model.set_recipe("aligned")
        quantized = model(ids)
    assert torch.isfinite(quantized).all() and not torch.equal(ref, quantized)


TRAIN_CONFIGS = [tiny_qwen3(), tiny_qwen3_moe(tie_word_embeddings=True)]


@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=["dense", "moe"])
def test_aligned_recipe_trains(config):
    torch.manual_seed(0)
    model = Qwen3(config, recipe="aligned")
    model.init_weights(std=0.1)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} received no gradient"
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses
