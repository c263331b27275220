"""`minite.nn.fused_projections`: q/k/v and gate/up as one GEMM give each linear's own forward bits and
its gradients; it steps aside where it does not apply. CPU: the Triton interpreter (fp32 models, fp16
operands); GPU: bf16 at a learner-like shape."""

import pytest
import torch

from minite import kernels
from minite.kernels import gemm as kg
from minite.models import Qwen3, tiny_qwen3
from minite.nn import Linear
from minite.nn import fused_projections as fp
from minite.nn.forward_scope import forward_scope
from minite.nn.nvfp4_matmul import _scale_bf16
from minite.nn.quantized_weight import quantize_weight
from minite.recipe import QuantSpec, get_recipe

pytestmark = pytest.mark.skipif(not kernels.available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALIGNED = get_recipe("aligned").with_execution(backend="triton")
# the fused backward sums the weights' dX terms in one fp32 pass where autograd adds separate results
FP32_GRAD_RTOL = 1e-5
# bf16 gradients: the same products with bf16 roundings at other places (a few bf16 ulps)
BF16_GRAD_REL_RMS = 2e-2


class _Owner(torch.nn.Module):
    def __init__(self, widths, k, dtype=torch.float32, recipe=ALIGNED, bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.lins = torch.nn.ModuleList(Linear(k, n, bias=bias, recipe=recipe).to(DEVICE, dtype)
                                        for n in widths)

    def forward(self, x):
        return fp.project(x, tuple(self.lins), self)

    def set_fused(self, fused: bool) -> None:
        recipe = self.lins[0].recipe.with_execution(fused_projections=fused)
        for lin in self.lins:
            lin.set_recipe(recipe)


def _launches(monkeypatch):
    calls = []
    real = kg.gemm_segments

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(kg, "gemm_segments", counting)
    return calls


def _run(owner, x, fused: bool, grads: bool = True):
    owner.set_fused(fused)
    owner.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(grads)
    outs = owner(xi)
    if grads:
        sum((o.float() * (j + 1)).sin().sum() for j, o in enumerate(outs)).backward()
        return outs, xi.grad, [lin.weight.grad for lin in owner.lins]
    return outs, None, None


@pytest.mark.parametrize("widths", [(64, 32, 32), (96, 96), (48, 16, 32)])
@pytest.mark.parametrize("scope", [False, True])
def test_fused_forward_has_each_linears_bits_and_its_gradients(monkeypatch, widths, scope):
    owner = _Owner(widths, 64)
    x = torch.randn(2, 45, 64, device=DEVICE) ** 3
    calls = _launches(monkeypatch)
    with forward_scope() if scope else torch.enable_grad():
        fused, dx_f, dw_f = _run(owner, x, True)
    assert len(calls) == 1
    with forward_scope() if scope else torch.enable_grad():
        alone, dx_a, dw_a = _run(owner, x, False)
    assert len(calls) == 1
    for f, a, n in zip(fused, alone, widths):
        assert f.shape == (2, 45, n) and torch.equal(f, a)
    torch.testing.assert_close(dx_f, dx_a, rtol=FP32_GRAD_RTOL, atol=FP32_GRAD_RTOL * dx_a.abs().max())
    for f, a in zip(dw_f, dw_a):
        torch.testing.assert_close(f, a, rtol=FP32_GRAD_RTOL, atol=FP32_GRAD_RTOL * a.abs().max())


def test_unused_output_and_frozen_weights():
    owner = _Owner((32, 32, 16), 64)
    owner.lins[1].weight.requires_grad_(False)
    x = torch.randn(80, 64, device=DEVICE, requires_grad=True)
    q, _, v = owner(x)
    (q.sum() + v.sum()).backward()
    want = (torch.ones(80, 32) @ owner.lins[0].quantized_weight().dequantize().cpu()
            + torch.ones(80, 16) @ owner.lins[2].quantized_weight().dequantize().cpu())
    torch.testing.assert_close(x.grad.cpu(), want, rtol=1e-5, atol=1e-5)
    assert owner.lins[1].weight.grad is None and owner.lins[2].weight.grad is not None


def test_steps_aside_where_it_does_not_apply(monkeypatch):
    calls = _launches(monkeypatch)
    x = torch.randn(80, 64, device=DEVICE)
    few = torch.randn(64, 64, device=DEVICE)  # decode-sized: the linears' packed-weight path
    rht = QuantSpec(scaling="tensor", hadamard=True)  # not on the kernels
    te = _Owner((32, 32), 64, recipe=get_recipe("te", activation=rht).with_execution(backend="triton"))
    biased = _Owner((32, 32), 64, bias=True)
    hooked = _Owner((32, 32), 64)
    seen = []
    hooked.lins[0].register_forward_hook(lambda *a: seen.append(1))
    for owner, inp in ((_Owner((32, 32), 64), few), (te, x), (biased, x), (hooked, x),
                       (_Owner((32, 32), 64, recipe="bf16"), x)):
        outs = owner(inp)
        assert [o.shape[-1] for o in outs] == [32, 32]
    assert calls == [] and seen == [1]
    unfused = _Owner((32, 32), 64)
    unfused.set_fused(False)
    unfused(x)
    assert calls == []
    _Owner((32, 32), 64)(x)
    assert calls == [1]


def test_a_per_tensor_activation_scale_fuses_with_each_linears_bits(monkeypatch):
    """`te`: one amax for the shared input, so the fused GEMM gives each linear's own outputs."""
    calls = _launches(monkeypatch)
    owner = _Owner((32, 16, 16), 64, recipe=get_recipe("te").with_execution(backend="triton"))
    x = torch.randn(80, 64, device=DEVICE)
    fused, _, _ = _run(owner, x, fused=True, grads=False)
    assert calls == [1]
    plain, _, _ = _run(owner, x, fused=False, grads=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_copy_is_remade_after_a_weight_update():
    owner = _Owner((32, 16), 64)
    x = torch.randn(70, 64, device=DEVICE)
    first = owner(x)
    group = next(iter(owner._fused_projection_copies.values()))
    assert owner(x)[0].data_ptr() != first[0].data_ptr()
    assert next(iter(owner._fused_projection_copies.values())) is group
    with torch.no_grad():
        owner.lins[1].weight.mul_(-2.0)
    fused, _, _ = _run(owner, x, True, grads=False)
    alone, _, _ = _run(owner, x, False, grads=False)
    assert next(iter(owner._fused_projection_copies.values())) is not group
    assert all(torch.equal(f, a) for f, a in zip(fused, alone))


def test_with_unscaled_shares_the_caches_but_not_the_old_copies():
    qw = quantize_weight(torch.randn(32, 64), ALIGNED.weight)
    qw.operand(torch.float16, 32)
    qw.cached("epilogue", lambda: 1)
    view = torch.cat([torch.zeros(8, 64, dtype=qw.unscaled.dtype), qw.unscaled])[8:]
    new = qw.with_unscaled(view)
    assert new.unscaled is view and new.key == qw.key and new.cached("epilogue", lambda: 2) == 1
    assert (torch.float16, 32) not in new._operands
    qw._operands["host_global_scale"] = (1.5,)  # what the refresh's sync fills in later
    assert new.host_global_scale() == (1.5,)
    with pytest.raises(ValueError, match="with_unscaled"):
        qw.with_unscaled(view[:4])


def test_refresh_makes_the_groups_the_next_forward_uses():
    from minite.nn import refresh_quantized_weights

    torch.manual_seed(0)
    model = Qwen3(tiny_qwen3(), recipe=ALIGNED).to(DEVICE)
    refresh_quantized_weights(model)
    layer = model.layers[0]
    groups = [dict(m._fused_projection_copies) for m in (layer.self_attn, layer.mlp)]
    assert [len(g) for g in groups] == [1, 1]
    model(torch.randint(0, model.config.vocab_size, (1, 70), device=DEVICE))
    assert [dict(m._fused_projection_copies) for m in (layer.self_attn, layer.mlp)] == groups
    group = next(iter(groups[0].values()))
    assert all(lin.quantized_weight() is qw for lin, qw in zip(layer.self_attn.fused_projection_groups()[0],
                                                               group.qweights))


def test_back_to_back_parts_make_a_view_not_a_copy():
    """Parts lying back to back in one storage (a stacked quantize launch) become one view; parts
    elsewhere, out of order or of other widths are left to the concatenation."""
    stack = torch.randn(4, 8, 16)
    view = fp._adjacent([stack[1], stack[2]])
    assert view.data_ptr() == stack[1].data_ptr() and torch.equal(view, torch.cat([stack[1], stack[2]]))
    assert fp._adjacent([stack[2], stack[1]]) is None
    assert fp._adjacent([stack[0], stack[2]]) is None
    assert fp._adjacent([stack[0], torch.randn(8, 16)]) is None
    assert fp._adjacent([stack[0, :, :8], stack[0, :, 8:]]) is None
    assert fp._adjacent([stack[0], stack[1], stack[2]]).shape == (24, 16)


def test_bf16_backward_formulas_match_the_separate_linears():
    """`_bf16_grads` (CPU bf16 torch ops) against each linear's lean backward (`_dense_bf16_grads`'
    formulas: dX = S_w (dY @ Wu), dW = bf16(dY * S_x)^T @ Xu), summed over the weights."""
    torch.manual_seed(1)
    m, k, widths = 96, 64, (48, 16, 32)
    qws = [quantize_weight(torch.randn(n, k), ALIGNED.weight) for n in widths]
    sdec = [float(q.global_scale) for q in qws]
    copy = torch.cat([q.unscaled for q in qws])
    group = fp._Group(tuple(qws), copy, widths, torch.ones(3), tuple(q.global_scale for q in qws),
                      tuple(copy.split(widths)))
    a = (torch.randn(m, k) * 4).to(torch.bfloat16)
    sx = torch.rand(m, 1) + 0.5
    dys = [torch.randn(m, n).to(torch.bfloat16) for n in widths]
    dx, dws = fp._bf16_grads(group, tuple(sdec), a, sx, dys, True, [True] * 3)
    want_dx = sum(torch.mm(dy, q.unscaled).mul_(s).float() for dy, q, s in zip(dys, qws, sdec))
    assert dx.dtype == torch.bfloat16
    rel = ((dx.float() - want_dx).norm() / want_dx.norm()).item()
    assert rel < BF16_GRAD_REL_RMS
    for dw, dy in zip(dws, dys):
        want = torch.mm(_scale_bf16(dy, sx).t(), a).float()
        assert ((dw.float() - want).norm() / want.norm()).item() < BF16_GRAD_REL_RMS
    # S_dec not on the host yet (no refresh): the terms scaled on the device, the same within bf16
    dx_dev, dws_dev = fp._bf16_grads(group, None, a, sx, dys, True, [True] * 3)
    assert dx_dev.dtype == torch.bfloat16
    assert ((dx_dev.float() - want_dx).norm() / want_dx.norm()).item() < BF16_GRAD_REL_RMS
    assert all(torch.equal(x, y) for x, y in zip(dws, dws_dev))


def test_tiny_model_logits_and_grads_fused_or_not(monkeypatch):
    torch.manual_seed(0)
    model = Qwen3(tiny_qwen3(), recipe=ALIGNED).to(DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), device=DEVICE)
    calls = _launches(monkeypatch)
    got = []
    for fused in (True, False):
        model.set_recipe(ALIGNED.with_execution(fused_projections=fused))
        model.zero_grad(set_to_none=True)
        logits = model(ids)
        logits.float().logsumexp(-1).sum().backward()
        got.append((logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert torch.equal(got[0][0], got[1][0])
    for a, b in zip(got[0][1], got[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_fused_projections():
    """bf16 at a learner-like shape (4096 rows, q/k/v of 1024 / 256 / 256): bitwise forward, gradients
    within bf16 rounding, the members' copies views into the concatenated one."""
    owner = _Owner((1024, 256, 256), 1024, dtype=torch.bfloat16)
    x = (torch.randn(2, 2048, 1024, device="cuda") ** 3).to(torch.bfloat16)
    with forward_scope():
        fused, dx_f, dw_f = _run(owner, x, True)
    group = next(iter(owner._fused_projection_copies.values()))
    assert group.host_sdec is None  # no refresh ran: the dX terms scaled on the device
    for j, lin in enumerate(owner.lins):
        assert lin.quantized_weight().unscaled.data_ptr() == group.rows[j].data_ptr()
    with forward_scope():
        alone, dx_a, dw_a = _run(owner, x, False)
    assert all(torch.equal(f, a) for f, a in zip(fused, alone))
    for f, a in zip([dx_f, *dw_f], [dx_a, *dw_a]):
        assert ((f.float() - a.float()).norm() / a.float().norm()).item() < BF16_GRAD_REL_RMS
    # after a refresh S_dec is on the host: the bf16 backward
    from minite.nn import refresh_quantized_weights

    refresh_quantized_weights(owner)
    with forward_scope():
        fused, dx_f, dw_f = _run(owner, x, True)
    assert next(iter(owner._fused_projection_copies.values())).host_sdec is not None
    for f, a in zip([dx_f, *dw_f], [dx_a, *dw_a]):
        assert ((f.float() - a.float()).norm() / a.float().norm()).item() < BF16_GRAD_REL_RMS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_refresh_leaves_gate_and_up_in_their_stack():
    """A bf16 model's refresh quantizes gate and up in one stacked launch, back to back: the MLP's
    fused copy is a view of that stack (no concatenation), q/k/v (other widths) are concatenated, and
    both give each linear's own bits."""
    from minite.nn import refresh_quantized_weights

    torch.manual_seed(0)
    model = Qwen3(tiny_qwen3(), recipe=ALIGNED).to("cuda", torch.bfloat16)
    refresh_quantized_weights(model)
    mlp, attn = model.layers[1].mlp, model.layers[1].self_attn
    h = (torch.randn(300, model.config.hidden_size, device="cuda") ** 3).to(torch.bfloat16)
    for owner in (mlp, attn):
        group_lins = owner.fused_projection_groups()[0]
        group = fp._group(owner, group_lins, ALIGNED, h.device)
        with forward_scope():
            fused = fp.project(h, group_lins, owner)
        with forward_scope():
            alone = [lin(h) for lin in group_lins]
        assert all(torch.equal(f, a) for f, a in zip(fused, alone))
        stacked = group.copy.untyped_storage().nbytes() > group.copy.numel() * group.copy.element_size()
        assert stacked == (owner is mlp)
