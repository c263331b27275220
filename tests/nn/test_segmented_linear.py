"""`minite.nn.linear` / `segmented_matmul`: q|k|v and gate|up as one parameter give each
segment a separate Linear's codes, scales and forward bits, in one GEMM launch where it applies, with
the separate linears' gradients; the checkpoint names map to Hugging Face's. CPU: the Triton
interpreter (fp32 models, fp16 operands); GPU: bf16 at a learner-like shape."""

import pytest
import torch

from minite import kernels
from minite.kernels import gemm as kg
from minite.models import Qwen3, tiny_qwen3
from minite.nn import Linear
from minite.nn import segmented_matmul as sm
from minite.nn.linear import SegmentedLinear
from minite.nn.nvfp4_matmul import _scale_bf16
from minite.nn.quantized_weight import quantize_weight
from minite.recipe import QuantSpec, get_recipe

pytestmark = pytest.mark.skipif(not kernels.available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALIGNED = get_recipe("aligned").with_execution(backend="triton")
# the fused backward sums the segments' dX terms in one fp32 pass where autograd adds separate results
FP32_GRAD_RTOL = 1e-5
# bf16 gradients: the same products with bf16 roundings at other places (a few bf16 ulps)
BF16_GRAD_REL_RMS = 2e-2


def _segmented(widths, k, dtype=torch.float32, recipe=ALIGNED):
    torch.manual_seed(0)
    return SegmentedLinear(k, widths, recipe=recipe).to(DEVICE, dtype)


def _separate(seg: SegmentedLinear) -> list[Linear]:
    """Linears holding the segments' rows, under the same recipe."""
    lins = []
    for w in seg.segments():
        lin = Linear(seg.in_features, w.shape[0], recipe=seg.recipe).to(w.device, w.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
        lins.append(lin)
    return lins


def _launches(monkeypatch):
    calls = []
    real = kg.gemm_segments

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)
    monkeypatch.setattr(kg, "gemm_segments", counting)
    return calls


def _run(seg, x, fused: bool, grads: bool = True):
    seg.set_recipe(seg.recipe.with_execution(fused_projections=fused))
    seg.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(grads)
    outs = seg(xi)
    if grads:
        sum((o.float() * (j + 1)).sin().sum() for j, o in enumerate(outs)).backward()
        return outs, xi.grad, seg.weight.grad
    return outs, None, None


@pytest.mark.parametrize("widths", [(64, 32, 32), (96, 96), (48, 16, 32)])
def test_fused_forward_has_each_linears_bits_and_its_gradients(monkeypatch, widths):
    seg = _segmented(widths, 64)
    x = torch.randn(2, 45, 64, device=DEVICE) ** 3
    calls = _launches(monkeypatch)
    fused, dx_f, dw_f = _run(seg, x, True)
    assert len(calls) == 1
    alone, dx_a, dw_a = _run(seg, x, False)
    assert len(calls) == 1
    lins = _separate(seg)
    for f, a, lin, n in zip(fused, alone, lins, widths, strict=True):
        assert f.shape == (2, 45, n) and torch.equal(f, a) and torch.equal(f, lin(x))
    for qw, lin in zip(seg.quantized_weights(), lins):
        want = lin.quantized_weight()
        assert torch.equal(qw.q.codes, want.q.codes) and torch.equal(qw.global_scale, want.global_scale)
    torch.testing.assert_close(dx_f, dx_a, rtol=FP32_GRAD_RTOL, atol=FP32_GRAD_RTOL * dx_a.abs().max())
    torch.testing.assert_close(dw_f, dw_a, rtol=FP32_GRAD_RTOL, atol=FP32_GRAD_RTOL * dw_a.abs().max())


def test_unused_output_gets_zero_weight_rows():
    seg = _segmented((32, 32, 16), 64)
    x = torch.randn(80, 64, device=DEVICE, requires_grad=True)
    q, _, v = seg(x)
    (q.sum() + v.sum()).backward()
    qws = seg.quantized_weights()
    want = (torch.ones(80, 32) @ qws[0].dequantize().cpu() + torch.ones(80, 16) @ qws[2].dequantize().cpu())
    torch.testing.assert_close(x.grad.cpu(), want, rtol=1e-5, atol=1e-5)
    assert not seg.weight.grad[32:64].any() and seg.weight.grad[64:].any()


def test_steps_aside_where_it_does_not_apply(monkeypatch):
    calls = _launches(monkeypatch)
    x = torch.randn(80, 64, device=DEVICE)
    few = torch.randn(64, 64, device=DEVICE)  # decode-sized: the segments' packed-weight path
    rht = QuantSpec(scaling="tensor", hadamard=True)  # not on the kernels
    te = _segmented((32, 32), 64, recipe=get_recipe("te", activation=rht).with_execution(backend="triton"))
    for seg, inp in ((_segmented((32, 32), 64), few), (te, x), (_segmented((32, 32), 64, recipe="bf16"), x)):
        outs = seg(inp)
        assert [o.shape[-1] for o in outs] == [32, 32]
        assert all(torch.equal(o, lin(inp)) for o, lin in zip(outs, _separate(seg)))
    assert calls == []
    unfused = _segmented((32, 32), 64, recipe=ALIGNED.with_execution(fused_projections=False))
    unfused(x)
    assert calls == []
    _segmented((32, 32), 64)(x)
    assert calls == [1]


def _decode_launches(monkeypatch):
    """Calls of the segments' one-launch decode GEMMs: [(kernel, rows)]."""
    from minite.kernels import decode_gemm as kd
    from minite.kernels import grouped_decode as gd

    calls = []

    def counting(real, name):
        def run(a, *rest, **kw):
            calls.append((name, a.shape[0]))
            return real(a, *rest, **kw)
        return run
    for mod, name in ((kd, "decode_gemm_segments"), (gd, "decode_rows_segments")):
        monkeypatch.setattr(mod, name, counting(getattr(mod, name), name))
    return calls


@pytest.mark.parametrize("widths", [(128, 64, 64), (64, 64)])
def test_few_rows_without_grad_run_one_decode_launch_with_each_linears_bits(monkeypatch, widths):
    """At most `decode_max_m` rows and no autograd: the segments' decode layouts as one launch, each
    output bitwise its Linear's; the segments' own layouts become views of the concatenated one."""
    seg, calls = _segmented(widths, 128), _decode_launches(monkeypatch)
    x = torch.randn(3, 7, 128, device=DEVICE) ** 3
    with torch.no_grad():
        outs = seg(x)
        assert calls == [("decode_gemm_segments", 21)]
        for o, lin, n in zip(outs, _separate(seg), widths, strict=True):
            assert o.shape == (3, 7, n) and torch.equal(o, lin(x))
    group = seg._decode
    base = group.weight.codes.untyped_storage().data_ptr()
    for qw in seg.quantized_weights():
        assert qw.decode_weight(group.weight.scales.dtype).codes.untyped_storage().data_ptr() == base
    with_grad = seg(x)  # the weight needs gradients: the segments one by one, the same bits
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(outs, with_grad))


def test_sampler_form_runs_one_decode_launch_at_any_row_count(monkeypatch):
    from minite.nn.sampler_weights import to_sampler_weights

    seg = _segmented((128, 64, 64), 128)
    x = torch.randn(100, 128, device=DEVICE)
    with torch.no_grad():
        want = [lin(x) for lin in _separate(seg)]
        to_sampler_weights(seg)
        calls = _decode_launches(monkeypatch)
        outs = seg(x)
    assert calls == [("decode_rows_segments", 100)]
    assert all(torch.equal(o, w) for o, w in zip(outs, want, strict=True))


@pytest.mark.parametrize("name", ["vllm", "te"])
def test_one_decode_launch_under_static_and_per_tensor_scales(monkeypatch, name):
    """A calibrated static input scale (vLLM's) and a per-tensor one (TE's 'alpha' epilogue): one
    factor for every row, each segment's own weight factor; the segments' Linears' bits."""
    from minite.nn import calibrate

    recipe = get_recipe(name).with_execution(backend="triton")
    seg, calls = _segmented((64, 64, 128), 128, recipe=recipe), _decode_launches(monkeypatch)
    x = torch.randn(6, 128, device=DEVICE) ** 3
    lins = _separate(seg)
    if name == "vllm":
        for m in (seg, *lins):
            with torch.no_grad(), calibrate(m):
                m(x)
    with torch.no_grad():
        outs = seg(x)
        assert all(torch.equal(o, lin(x)) for o, lin in zip(outs, lins, strict=True))
    assert calls == [("decode_gemm_segments", 6)]


def test_segments_off_the_layouts_tiles_run_one_by_one(monkeypatch):
    seg, calls = _segmented((96, 32), 128), _decode_launches(monkeypatch)
    x = torch.randn(5, 128, device=DEVICE)
    with torch.no_grad():
        outs = seg(x)
        assert all(torch.equal(o, lin(x)) for o, lin in zip(outs, _separate(seg)))
    assert calls == []


def test_a_per_tensor_activation_scale_fuses_with_each_linears_bits(monkeypatch):
    """`te`: one amax for the shared input, so the fused GEMM gives each linear's own outputs."""
    calls = _launches(monkeypatch)
    seg = _segmented((32, 16, 16), 64, recipe=get_recipe("te").with_execution(backend="triton"))
    x = torch.randn(80, 64, device=DEVICE)
    fused, _, _ = _run(seg, x, fused=True, grads=False)
    assert calls == [1]
    plain, _, _ = _run(seg, x, fused=False, grads=False)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_copy_is_remade_after_a_weight_update():
    seg = _segmented((32, 16), 64)
    x = torch.randn(70, 64, device=DEVICE)
    seg(x)
    copy = seg._copy
    seg(x)
    assert copy is not None and seg._copy is copy
    with torch.no_grad():
        seg.weight[32:].mul_(-2.0)
    fused, _, _ = _run(seg, x, True, grads=False)
    assert seg._copy is not copy
    assert all(torch.equal(f, lin(x)) for f, lin in zip(fused, _separate(seg)))


def test_refresh_makes_the_copies_the_next_forward_uses():
    from minite.nn import refresh_quantized_weights

    torch.manual_seed(0)
    model = Qwen3(tiny_qwen3(), recipe=ALIGNED).to(DEVICE)
    refresh_quantized_weights(model)
    layer = model.layers[0]
    segs = (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)
    copies = [s._copy for s in segs]
    assert all(c is not None for c in copies)
    model(torch.randint(0, model.config.vocab_size, (1, 70), device=DEVICE))
    assert all(s._copy is c for s, c in zip(segs, copies))
    assert all(a is b for s, c in zip(segs, copies) for a, b in zip(s.quantized_weights(), c.qweights))


def test_back_to_back_parts_make_a_view_not_a_copy():
    """Parts lying back to back in one storage (a stacked quantize launch) become one view; parts
    elsewhere, out of order or of other widths are left to the concatenation."""
    stack = torch.randn(4, 8, 16)
    view = sm._adjacent([stack[1], stack[2]])
    assert view.data_ptr() == stack[1].data_ptr() and torch.equal(view, torch.cat([stack[1], stack[2]]))
    assert sm._adjacent([stack[2], stack[1]]) is None
    assert sm._adjacent([stack[0], stack[2]]) is None
    assert sm._adjacent([stack[0], torch.randn(8, 16)]) is None
    assert sm._adjacent([stack[0, :, :8], stack[0, :, 8:]]) is None
    assert sm._adjacent([stack[0], stack[1], stack[2]]).shape == (24, 16)


def test_bf16_backward_formulas_match_the_separate_linears():
    """`_bf16_grads` (CPU bf16 torch ops) against each linear's lean backward (`_dense_bf16_grads`'
    formulas: dX = S_w (dY @ Wu), dW = bf16(dY * S_x)^T @ Xu), summed over the segments."""
    torch.manual_seed(1)
    m, k, widths = 96, 64, (48, 16, 32)
    qws = [quantize_weight(torch.randn(n, k), ALIGNED.weight) for n in widths]
    sdec = [float(q.global_scale) for q in qws]
    copy = torch.cat([q.unscaled for q in qws])
    seg = sm.SegmentedCopy(tuple(qws), copy, widths, torch.ones(3), tuple(q.global_scale for q in qws),
                           tuple(copy.split(widths)))
    a = (torch.randn(m, k) * 4).to(torch.bfloat16)
    sx = torch.rand(m, 1) + 0.5
    dys = [torch.randn(m, n).to(torch.bfloat16) for n in widths]
    meta = ((sum(widths), k), torch.bfloat16)
    dx, dw = sm._bf16_grads(seg, tuple(sdec), a, sx, dys, True, True, meta)
    want_dx = sum(torch.mm(dy, q.unscaled).mul_(s).float() for dy, q, s in zip(dys, qws, sdec))
    assert dx.dtype == torch.bfloat16
    rel = ((dx.float() - want_dx).norm() / want_dx.norm()).item()
    assert rel < BF16_GRAD_REL_RMS
    for part, dy in zip(dw.split(widths), dys):
        want = torch.mm(_scale_bf16(dy, sx).t(), a).float()
        assert ((part.float() - want).norm() / want.norm()).item() < BF16_GRAD_REL_RMS
    # S_dec not on the host yet (no refresh): the terms scaled on the device, the same within bf16
    dx_dev, dw_dev = sm._bf16_grads(seg, None, a, sx, dys, True, True, meta)
    assert dx_dev.dtype == torch.bfloat16
    assert ((dx_dev.float() - want_dx).norm() / want_dx.norm()).item() < BF16_GRAD_REL_RMS
    assert torch.equal(dw, dw_dev)


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


def test_checkpoint_names_are_hugging_faces():
    from minite.models.checkpoint import from_hf_pieces, hf_tensors

    model = Qwen3(tiny_qwen3(), recipe="bf16")
    cfg = model.config
    w = model.layers[0].self_attn.qkv_proj.weight
    pieces = hf_tensors("layers.0.self_attn.qkv_proj.weight", w, cfg)
    kv = cfg.num_key_value_heads * cfg.head_dim
    assert {k: tuple(t.shape) for k, t in pieces.items()} == {
        "model.layers.0.self_attn.q_proj.weight": (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (kv, cfg.hidden_size),
        "model.layers.0.self_attn.v_proj.weight": (kv, cfg.hidden_size)}
    assert torch.equal(from_hf_pieces("layers.0.self_attn.qkv_proj.weight", list(pieces.values())), w)
    gu = hf_tensors("layers.1.mlp.gate_up_proj.weight", model.layers[1].mlp.gate_up_proj.weight, cfg)
    assert list(gu) == ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bf16_segmented_projections():
    """bf16 at a learner-like shape (4096 rows, q/k/v of 1024 / 256 / 256): bitwise forward, gradients
    within bf16 rounding, the segments' copies views into the concatenated one."""
    from minite.nn import refresh_quantized_weights

    seg = _segmented((1024, 256, 256), 1024, dtype=torch.bfloat16)
    x = (torch.randn(2, 2048, 1024, device="cuda") ** 3).to(torch.bfloat16)
    fused, dx_f, dw_f = _run(seg, x, True)
    copy = seg._copy
    assert copy.host_sdec is None  # no refresh ran: the dX terms scaled on the device
    for j, qw in enumerate(seg.quantized_weights()):
        assert qw.unscaled.data_ptr() == copy.rows[j].data_ptr()
    alone, dx_a, dw_a = _run(seg, x, False)
    assert all(torch.equal(f, a) for f, a in zip(fused, alone))
    for f, a in zip([dx_f, dw_f], [dx_a, dw_a]):
        assert ((f.float() - a.float()).norm() / a.float().norm()).item() < BF16_GRAD_REL_RMS
    # after a refresh S_dec is on the host: the bf16 backward with host scales
    seg.set_recipe(ALIGNED)
    refresh_quantized_weights(seg)
    assert seg._copy.host_sdec is not None
    fused, dx_f, dw_f = _run(seg, x, True)
    for f, a in zip([dx_f, dw_f], [dx_a, dw_a]):
        assert ((f.float() - a.float()).norm() / a.float().norm()).item() < BF16_GRAD_REL_RMS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_refresh_leaves_gate_and_up_in_their_stack():
    """A bf16 model's refresh quantizes gate and up in one stacked launch, back to back: the MLP's
    fused copy is a view of that stack (no concatenation), q/k/v (other widths) are concatenated, and
    both give each separate linear's bits."""
    from minite.nn import refresh_quantized_weights

    torch.manual_seed(0)
    model = Qwen3(tiny_qwen3(), recipe=ALIGNED).to("cuda", torch.bfloat16)
    refresh_quantized_weights(model)
    mlp, attn = model.layers[1].mlp.gate_up_proj, model.layers[1].self_attn.qkv_proj
    h = (torch.randn(300, model.config.hidden_size, device="cuda") ** 3).to(torch.bfloat16)
    for seg in (mlp, attn):
        copy = seg._copy
        fused = seg(h)
        assert seg._copy is copy
        assert all(torch.equal(f, lin(h)) for f, lin in zip(fused, _separate(seg)))
        stacked = copy.copy.untyped_storage().nbytes() > copy.copy.numel() * copy.copy.element_size()
        assert stacked == (seg is mlp)
