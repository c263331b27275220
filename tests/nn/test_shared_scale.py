"""`fused_scale="shared"`: q/k/v and gate/up quantized under one weight global scale."""

import pytest
import torch

from minite.models import Qwen3, tiny_qwen3
from minite.nn.quantized_weight import refresh_quantized_weights
from minite.nvfp4 import quantize
from minite.recipe import get_recipe


def _model(recipe_name: str, fused_scale: str) -> Qwen3:
    model = Qwen3(tiny_qwen3(), get_recipe(recipe_name, fused_scale=fused_scale))
    model.init_weights(0.05, torch.Generator().manual_seed(0))
    with torch.no_grad():  # members of very different ranges: the case the shared scale changes
        model.layers[0].self_attn.k_proj.weight.mul_(3.0)
        model.layers[0].mlp.up_proj.weight.mul_(0.25)
    return model


def _groups(model):
    for layer in model.layers:
        a, m = layer.self_attn, layer.mlp
        yield (a.q_proj, a.k_proj, a.v_proj)
        yield (m.gate_proj, m.up_proj)


@pytest.mark.parametrize("recipe_name", ["aligned", "te", "vllm"])
def test_members_share_one_scale_and_their_rows_of_one_quantization(recipe_name):
    model = _model(recipe_name, "shared")
    for group in _groups(model):
        qws = [lin.quantized_weight() for lin in group]
        assert all(torch.equal(qw.global_scale, qws[0].global_scale) for qw in qws)
        spec = group[0].recipe.weight
        whole = quantize(torch.cat([lin.weight.detach() for lin in group]), **spec.kwargs())
        assert torch.equal(torch.cat([qw.q.codes for qw in qws]), whole.codes)
        assert torch.equal(torch.cat([qw.q.block_scales for qw in qws]).view(torch.uint8),
                           whole.block_scales.view(torch.uint8))
        assert torch.equal(torch.cat([qw.unscaled for qw in qws]).float(), whole.unscaled())
        # the member holding the group's amax is quantized exactly as on its own
        top = max(group, key=lambda lin: lin.weight.abs().max())
        alone = quantize(top.weight.detach(), **spec.kwargs())
        assert torch.equal(top.quantized_weight().q.codes, alone.codes)


def test_separate_scales_differ_and_the_logits_stay_close():
    shared, separate = _model("aligned", "shared"), _model("aligned", "separate")
    separate.load_state_dict(shared.state_dict())
    a = separate.layers[0].self_attn
    assert not torch.equal(a.q_proj.quantized_weight().global_scale, a.k_proj.quantized_weight().global_scale)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ls, lp = shared(ids).float(), separate(ids).float()
    assert not torch.equal(ls, lp)
    assert (ls - lp).norm() / lp.norm() < 0.2


def test_an_update_requantizes_the_whole_group():
    model = _model("aligned", "shared")
    a = model.layers[1].self_attn
    before = a.v_proj.quantized_weight()
    with torch.no_grad():
        a.q_proj.weight.mul_(4.0)
        a.k_proj.weight.add_(0.0)  # a training step touches every weight
        a.v_proj.weight.add_(0.0)
    assert refresh_quantized_weights(model) > 0
    after = [lin.quantized_weight() for lin in (a.q_proj, a.k_proj, a.v_proj)]
    assert all(torch.equal(qw.global_scale, after[0].global_scale) for qw in after)
    assert after[2] is not before and not torch.equal(after[2].global_scale, before.global_scale)


def test_sixteen_by_sixteen_blocks_need_whole_tiles_per_member():
    model = Qwen3(tiny_qwen3(num_key_value_heads=1, head_dim=8, num_attention_heads=2),
                  get_recipe("te", fused_scale="shared"))
    with pytest.raises(ValueError, match="multiple of 16"):
        model.layers[0].self_attn.k_proj.quantized_weight()


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="fused_scale"):
        get_recipe("aligned", fused_scale="max")


def test_the_refresh_brings_each_members_scale_to_the_host():
    from minite.nn.quantized_weight import deferred_finite_checks

    model = _model("aligned", "shared")
    a = model.layers[0].self_attn
    with deferred_finite_checks():
        from minite.nn.shared_scale import refresh_group

        refresh_group((a.q_proj, a.k_proj, a.v_proj))
    hosts = [lin.quantized_weight().host_global_scale() for lin in (a.q_proj, a.k_proj, a.v_proj)]
    assert hosts[0] is not None and hosts[0] == hosts[1] == hosts[2]
    assert hosts[0][0] == float(a.q_proj.quantized_weight().global_scale)


@pytest.mark.gpu
def test_shared_scales_on_the_kernels():
    """The CUDA refresh (one launch per group, fused projections) keeps one scale per group and the
    forward matches the CPU reference's codes."""
    cpu = _model("aligned", "shared")
    gpu = _model("aligned", "shared").to(device="cuda", dtype=torch.bfloat16)
    refresh_quantized_weights(gpu)
    for gc, gg in zip(_groups(cpu.to(torch.bfloat16)), _groups(gpu)):
        scales = [lin.quantized_weight().global_scale for lin in gg]
        assert all(torch.equal(s, scales[0]) for s in scales)
        for lc, lg in zip(gc, gg):
            assert torch.equal(lc.quantized_weight().q.codes, lg.quantized_weight().q.codes.cpu())
    ids = torch.randint(0, 128, (2, 12), device="cuda")
    with torch.no_grad():
        assert torch.isfinite(gpu(ids)).all()
