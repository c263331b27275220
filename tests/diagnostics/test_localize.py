"""Localization on tiny models: exact zeros where the paths agree, the perturbed op named first."""

import pytest
import torch

from minite.diagnostics.localize import LAYER_POINTS, Sequences, Side, localize, rel_diff, side_logprobs
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.recipe import get_recipe

# The same numerics as `aligned` under another name, so a hook can perturb one side only.
PERTURBED = get_recipe("aligned").replace(name="perturbed")


def _model(config):
    model = Qwen3(config, recipe="aligned")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    return model.to(torch.bfloat16)


def _seqs(n=3):
    g = torch.Generator().manual_seed(1)
    lens = [7, 11, 5, 9][:n]
    return Sequences([torch.randint(0, 128, (t,), generator=g).tolist() for t in lens], [3, 4, 2, 5][:n])


def test_rel_diff_and_padding():
    assert rel_diff(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0])) == float("inf")
    assert rel_diff(torch.tensor([1.0, 4.0]), torch.tensor([1.0, 2.0])) == pytest.approx(2 / 5**0.5)
    assert rel_diff(torch.zeros(2), torch.zeros(2)) == 0.0
    targets, mask = Sequences([[5, 6, 7, 8], [9, 10]], [2, 1]).padded()
    assert targets.tolist() == [[6, 7, 8], [10, 0, 0]]
    assert mask.tolist() == [[False, True, True], [True, False, False]]
    with pytest.raises(ValueError, match="prompt length"):
        Sequences([[1, 2]], [3])


def test_aligned_is_batch_invariant_everywhere():
    model, seqs = _model(tiny_qwen3()), _seqs()
    loc = localize(model, Side("aligned", "packed"), Side("aligned", "alone"), seqs)
    assert loc.first_divergent is None and all(o["rel_diff"] == 0 for o in loc.ops)
    a = side_logprobs(model, Side("aligned", "packed"), seqs)
    assert torch.equal(a, side_logprobs(model, Side("aligned", "alone"), seqs))
    assert model.recipe.name == "aligned"


def test_perturbed_o_proj_is_named_first():
    model, seqs = _model(tiny_qwen3()), _seqs()
    o_proj = model.layers[1].self_attn.o_proj
    def noise(mod, args, out):
        return out + 0.05 * torch.randn_like(out) if mod.recipe.name == "perturbed" else None

    handle = o_proj.register_forward_hook(noise)
    try:
        loc = localize(model, Side(PERTURBED), Side("aligned"), seqs)
    finally:
        handle.remove()
    assert loc.first_divergent == "layers.1.o_proj"
    names = [o["op"] for o in loc.ops]
    first = names.index("layers.1.o_proj")
    assert all(o["rel_diff"] == 0 for o in loc.ops[:first])
    assert all(o["rel_diff"] > 0 for o in loc.ops[first:])
    assert loc.layer_curve() == [0.0, loc.ops[names.index("layers.1.output")]["rel_diff"]]
    assert names[-2:] == ["norm", "lm_head"]


def test_moe_router_agreement_and_te_vs_vllm():
    model, seqs = _model(tiny_qwen3_moe()), _seqs(2)
    same = localize(model, Side("aligned"), Side("aligned"), seqs)
    routers = [o for o in same.ops if o["kind"] == "router"]
    assert len(routers) == 2
    assert all(o["router_topk_same"] == 1 and o["router_topk_overlap"] == 1 for o in routers)
    naive = localize(model, Side("te", "packed"), Side("vllm", "alone"), seqs)
    assert naive.first_divergent == "layers.0.q_proj"  # the first quantized GEMM
    by_op = {o["op"]: o for o in naive.ops}
    assert by_op["layers.0.input_layernorm"]["rel_diff"] == 0
    assert by_op["layers.0.router"]["rel_diff"] > 0 and by_op["lm_head"]["rel_diff"] > 0
    router = by_op["layers.1.router"]
    assert 0 <= router["router_topk_same"] <= router["router_topk_overlap"] <= 1


def test_each_layer_reports_the_ops_its_modules_have():
    model = _model(tiny_qwen3())
    loc = localize(model, Side("aligned"), Side("aligned"), _seqs(1))
    for layer in range(model.config.num_hidden_layers):
        kinds = [o["kind"] for o in loc.ops if o["layer"] == layer]
        assert kinds == [kind for kind, _, _ in LAYER_POINTS if kind != "router"]  # dense: no router


def test_moe_block_is_recorded_as_what_it_adds_to_the_residual_stream():
    """A MoE block adds the residual in its combine; its op is its output less that residual (what the
    block computes), not the residual stream after it."""
    from minite.diagnostics.localize import _on_every_op

    model, seqs = _model(tiny_qwen3_moe()), _seqs(1)
    seen = {}
    ids = torch.tensor(seqs.tokens[0]).unsqueeze(0)
    with torch.no_grad(), _on_every_op(model, lambda name, t: seen.setdefault(name, t.clone())):
        model(ids)
        alone = model.layers[0].mlp(seen["layers.0.post_attention_layernorm"]).double()
    block, stream = seen["layers.0.mlp"], seen["layers.0.output"].double()
    assert block.dtype == torch.float64 and block.shape == alone.shape
    torch.testing.assert_close(block, alone, rtol=0, atol=2 * 2.0**-8 * stream.abs().max().item())
    assert (block - stream).abs().max() > 10 * (block - alone).abs().max()
