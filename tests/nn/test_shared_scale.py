"""`fused_scale="shared"`: q|k|v and gate|up quantized under one weight global scale."""

import pytest
import torch

from minite.models import Qwen3, tiny_qwen3
from minite.nn.quantized_weight import deferred_finite_checks
from minite.nn.refresh import refresh_quantized_weights
from minite.nvfp4 import quantize
from minite.recipe import get_recipe


def _model(recipe_name: str, fused_scale: str) -> Qwen3:
    model = Qwen3(tiny_qwen3(), get_recipe(recipe_name, fused_scale=fused_scale))
    model.init_weights(0.05, torch.Generator().manual_seed(0))
    with torch.no_grad():  # segments of very different ranges: the case the shared scale changes
        qkv = model.layers[0].self_attn.qkv_proj
        qkv.segments()[1].mul_(3.0)
        model.layers[0].mlp.gate_up_proj.segments()[1].mul_(0.25)
    return model


def _groups(model):
    for layer in model.layers:
        yield layer.self_attn.qkv_proj
        yield layer.mlp.gate_up_proj


@pytest.mark.parametrize("recipe_name", ["aligned", "te", "vllm"])
def test_segments_share_one_scale_and_their_rows_of_one_quantization(recipe_name):
    model = _model(recipe_name, "shared")
    for lin in _groups(model):
        qws = lin.quantized_weights()
        assert all(torch.equal(qw.global_scale, qws[0].global_scale) for qw in qws)
        whole = quantize(lin.weight.detach(), **lin.recipe.weight.kwargs())
        assert torch.equal(torch.cat([qw.q.codes for qw in qws]), whole.codes)
        assert torch.equal(torch.cat([qw.q.block_scales for qw in qws]).view(torch.uint8),
                           whole.block_scales.view(torch.uint8))
        assert torch.equal(torch.cat([qw.unscaled for qw in qws]).float(), whole.unscaled())
        # the segment holding the group's amax is quantized exactly as on its own
        top = max(range(len(qws)), key=lambda j: lin.segments()[j].abs().max())
        alone = quantize(lin.segments()[top].detach(), **lin.recipe.weight.kwargs())
        assert torch.equal(qws[top].q.codes, alone.codes)


def test_separate_scales_differ_and_the_logits_stay_close():
    shared, separate = _model("aligned", "shared"), _model("aligned", "separate")
    separate.load_state_dict(shared.state_dict())
    qws = separate.layers[0].self_attn.qkv_proj.quantized_weights()
    assert not torch.equal(qws[0].global_scale, qws[1].global_scale)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ls, lp = shared(ids).float(), separate(ids).float()
    assert not torch.equal(ls, lp)
    assert (ls - lp).norm() / lp.norm() < 0.2


def test_an_update_requantizes_the_whole_group():
    model = _model("aligned", "shared")
    qkv = model.layers[1].self_attn.qkv_proj
    before = qkv.quantized_weights()[2]
    with torch.no_grad():
        qkv.segments()[0].mul_(4.0)
    assert refresh_quantized_weights(model) > 0
    after = qkv.quantized_weights()
    assert all(torch.equal(qw.global_scale, after[0].global_scale) for qw in after)
    assert after[2] is not before and not torch.equal(after[2].global_scale, before.global_scale)


def test_the_refresh_brings_each_segments_scale_to_the_host():
    model = _model("aligned", "shared")
    with deferred_finite_checks():
        refresh_quantized_weights(model)
    qws = model.layers[0].self_attn.qkv_proj.quantized_weights()
    hosts = [qw.host_global_scale() for qw in qws]
    assert hosts[0] is not None and hosts[0] == hosts[1] == hosts[2]
    assert hosts[0][0] == float(qws[0].global_scale)


def test_sixteen_by_sixteen_blocks_need_whole_tiles_per_segment():
    model = Qwen3(tiny_qwen3(num_key_value_heads=1, head_dim=8, num_attention_heads=2),
                  get_recipe("te", fused_scale="shared"))
    with pytest.raises(ValueError, match="multiple of 16"):
        model.layers[0].self_attn.qkv_proj.quantized_weights()


def test_unknown_setting_is_refused():
    with pytest.raises(ValueError, match="fused_scale"):
        get_recipe("aligned", fused_scale="max")


@pytest.mark.gpu
def test_shared_scales_on_the_kernels():
    """The CUDA refresh and the one-launch segmented GEMM keep one scale per group, with the CPU
    reference's codes."""
    cpu = _model("aligned", "shared").to(torch.bfloat16)
    gpu = _model("aligned", "shared").to(device="cuda", dtype=torch.bfloat16)
    refresh_quantized_weights(gpu)
    for lc, lg in zip(_groups(cpu), _groups(gpu)):
        qws = lg.quantized_weights()
        assert all(torch.equal(qw.global_scale, qws[0].global_scale) for qw in qws)
        for qc, qg in zip(lc.quantized_weights(), qws):
            assert torch.equal(qc.q.codes, qg.q.codes.cpu())
    ids = torch.randint(0, 128, (2, 80), device="cuda")
    with torch.no_grad():
        assert torch.isfinite(gpu(ids)).all()
