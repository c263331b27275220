import pytest
import torch

from minite.nn import MoEExperts, calibrate, moe_reference
from minite.nn.moe import group_by_expert

# Grouped and per-expert paths run the same quantizations; they differ only in GEMM batching (bmm
# vs mm) and in the order the top-k expert outputs are summed, i.e. a few fp32 roundings.
MOE_RTOL = 1e-6
# HF's block vs ours in fp32 under the bf16 recipe: same math, different summation order.
HF_RTOL = 1e-5
RECIPES = ["bf16", "aligned", "te", "torchao"]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _moe(recipe="aligned", e=8, h=32, i=16, k=2, **kw):
    return MoEExperts(e, h, i, k, recipe=recipe, **kw)


def _assert_matches_reference(moe, x, g, tol):
    """moe(x) backward g against `moe_reference`: output, input and parameter gradients within tol."""
    y = moe(x)
    y.backward(g)
    grads = [p.grad.clone() for p in moe.parameters()]
    dx = x.grad.clone()
    moe.zero_grad()
    x.grad = None
    yr = moe_reference(moe, x)
    yr.backward(g)
    assert y.shape == x.shape
    assert _rel(y.float(), yr.float()) <= tol
    assert _rel(dx.float(), x.grad.float()) <= tol
    for a, p in zip(grads, moe.parameters()):
        assert _rel(a.float(), p.grad.float()) <= tol, p.shape


def test_group_by_expert_layout():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2], [0, 3]])  # [T=4, k=2]
    g = group_by_expert(ids, num_experts=5)
    assert g.experts.tolist() == [0, 2, 3]
    assert g.capacity == 3
    flat = ids.reshape(-1)
    sorted_e = g.experts[g.slot]
    assert torch.equal(sorted_e[g.inverse], flat)
    assert torch.equal(g.tokens[g.inverse], torch.arange(4).repeat_interleave(2))
    slots = set(zip(g.slot.tolist(), g.rank.tolist()))
    assert len(slots) == 8 and max(r for _, r in slots) == 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_equals_per_expert_reference(recipe):
    moe = _moe(recipe)
    x = torch.randn(3, 11, 32, requires_grad=True)
    _assert_matches_reference(moe, x, torch.randn(3, 11, 32), MOE_RTOL)


@pytest.mark.parametrize("backward", ["dequantized", "nvfp4"])
def test_every_parameter_gets_a_gradient(backward):
    moe = _moe()
    moe.set_recipe(moe.recipe.replace(backward=backward))
    x = torch.randn(40, 32, requires_grad=True)
    moe(x).square().sum().backward()
    assert torch.bincount(moe.last_topk_ids.reshape(-1), minlength=8).min() > 0
    for name, p in moe.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


def test_router_stays_bf16_and_routing_is_exposed():
    moe = _moe("te")
    assert moe.gate.recipe.name == "bf16"
    x = torch.randn(2, 5, 32)
    out, r = moe(x, return_router=True)
    assert r.logits.shape == (10, 8) and r.experts.shape == (10, 2) and r.weights.shape == (10, 2)
    assert torch.equal(moe.last_topk_ids, r.experts)
    assert torch.allclose(r.weights.sum(-1), torch.ones(10))
    probs = torch.softmax(r.logits.float(), -1)
    assert torch.equal(torch.topk(probs, 2).indices, r.experts)


def test_expert_weights_quantized_per_expert_and_cached():
    moe = _moe("aligned")
    qw = moe.quantized_weight("gate_up_proj")
    assert qw.unscaled.shape == (8, 32, 32) and qw.global_scale.shape == (8, 1, 1)
    amax = moe.gate_up_proj.detach().abs().amax(dim=(1, 2))
    assert torch.equal(qw.amax.reshape(-1), amax)
    moe(torch.randn(4, 32))
    assert moe.quantized_weight("gate_up_proj") is qw
    with torch.no_grad():
        moe.gate_up_proj.mul_(0.5)
    assert moe.quantized_weight("gate_up_proj") is not qw


def test_static_calibration_shared_across_experts():
    moe = _moe("vllm")
    x = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="never calibrated"):
        moe(x)
    with calibrate(moe):
        moe(x)
    assert torch.equal(moe.gate_up_input_scale, x.abs().amax() / 2688.0)
    assert moe.down_input_scale > 0
    assert _rel(moe(x), moe_reference(moe, x)) <= MOE_RTOL


def test_empty_batch():
    moe = _moe()
    assert moe(torch.randn(0, 32)).shape == (0, 32)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_bf16_matches_transformers_qwen3_moe_block(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=3,
                         norm_topk_prob=norm_topk_prob)
    hf = Qwen3MoeSparseMoeBlock(cfg)
    moe = MoEExperts(8, 32, 16, 3, recipe="bf16", norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        hf.gate.weight.copy_(moe.gate.weight)
        hf.experts.gate_up_proj.copy_(moe.gate_up_proj)
        hf.experts.down_proj.copy_(moe.down_proj)
    x = torch.randn(2, 7, 32)
    assert _rel(moe(x), hf(x)) < HF_RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_experts_on_grouped_mm_equal_the_reference(dtype, monkeypatch):
    moe = _moe("bf16", e=8, h=32, i=24, k=3).to(dtype)
    assert not moe.graph_safe()  # the padded path (host sync) by default
    moe.set_recipe(moe.recipe.with_execution(grouped_mm=True))
    assert moe.grouped_mm_applies() and moe.graph_safe()
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(5, 9, 32, dtype=dtype, requires_grad=True)
    tol = MOE_RTOL if dtype == torch.float32 else 1e-2  # bf16: other GEMM kernels, other roundings
    _assert_matches_reference(moe, x, torch.randn(5, 9, 32, dtype=dtype), tol)
    assert len(calls) == 2  # gate_up and down, one call each for all experts (the reference: none)


def test_grouped_mm_needs_aligned_sizes():
    moe = _moe("bf16", h=32, i=12)  # 12 * 2 bytes: not a 16-byte stride
    moe.set_recipe(moe.recipe.with_execution(grouped_mm=True))
    assert not moe.grouped_mm_applies() and not moe.graph_safe()
    x = torch.randn(6, 32)
    assert _rel(moe(x), moe_reference(moe, x)) <= MOE_RTOL  # the padded path serves it
