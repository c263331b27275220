"""Backend 'triton' of minite.nn against backend 'ref': Linear, MoE experts, a tiny model, CUDA graphs.

Without CUDA the kernels run in the Triton interpreter (tiny shapes, fp32 inputs, fp16 operands;
tests/conftest.py turns it on).
"""

import pytest
import torch

from minite import kernels
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.nn import Linear, MoEExperts, moe_reference
from minite.nn.moe import group_by_expert, sort_by_expert
from minite.nn.nvfp4_matmul import use_grouped_kernels, use_kernels
from minite.nvfp4 import dequantize, quantize  # noqa: E402
from minite.nvfp4 import use_kernels as quantize_uses_kernels  # noqa: E402
from minite.recipe import QuantSpec, get_recipe  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALIGNED_TRITON = get_recipe("aligned").with_execution(backend="triton")
ALIGNED_REF = get_recipe("aligned").with_execution(backend="ref")
# Kernel and reference GEMMs both sum exact 16-block partial sums in fp32, in different orders: each
# may round once per 16-block (at most 2^-24 of sum_k |x_dq| |w_dq| each), so they differ by at most
# GEMM_ROUNDINGS_RTOL * (K / 16) of that sum (observed: bitwise equal on these shapes).
GEMM_ROUNDINGS_RTOL = 2 * 2.0**-24
# Gaussian inputs at these K: every fp32 accumulation is exact (docs/facts.md), so outputs are bitwise.
GAUSSIAN_EQUAL_FRAC = 1.0
# bf16 outputs: one bf16 rounding (at most 2^-7 relative) of values that may differ in the fp32 ulp.
BF16_RTOL = 2.0**-7
# Two tiny models whose GEMMs agree to the bound above; a flipped activation code downstream moves a
# logit by far less than this (observed: bitwise equal on the CPU).
LOGITS_REL_RMS = 1e-2
# Graph replay and eager decode run the same kernels on the same padded shapes.
GRAPH_LOGPROB_TOL = 1e-6
# Sampler vs full forward on the GPU: the GEMMs agree bitwise (aligned config), attention and norms
# only to fp32 rounding, which can flip an activation code now and then (a ~1e-3 log-prob move).
FULL_FORWARD_LOGPROB_TOL = 1e-2


def _pair(module_cls, *args, **kwargs):
    """The same module twice (shared initial weights): backend 'ref' and backend 'triton'."""
    torch.manual_seed(0)
    ref = module_cls(*args, recipe=ALIGNED_REF, **kwargs).to(DEVICE)
    tri = module_cls(*args, recipe=ALIGNED_TRITON, **kwargs).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    return ref, tri


def _gemm_bound(x, lin):
    r = lin.recipe
    xd = dequantize(quantize(x.reshape(-1, x.shape[-1]).float(), **r.activation.kwargs()))
    wd = dequantize(quantize(lin.weight.detach().float(), **r.weight.kwargs()))
    return (xd.abs() @ wd.abs().T).reshape(*x.shape[:-1], -1)


def _assert_gemm_close(out, ref, bound, k, out_rtol=0.0):
    diff = (out.float() - ref.float()).abs()
    rtol = GEMM_ROUNDINGS_RTOL * k / 16
    assert (diff <= rtol * bound + out_rtol * ref.float().abs()).all(), diff.max().item()


def test_quantize_backends_agree_bitwise():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 64, generator=g) ** 3).to(DEVICE)
    for kw in (dict(scaling="row"), dict(scaling="tensor"), dict(scaling="tensor", block=(16, 16), pad=True),
               dict(scaling="tensor", chain="vllm"), dict(scaling="static", static_scale=0.01)):
        a, b = quantize(x, backend="triton", **kw), quantize(x, backend="ref", **kw)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.block_scales.view(torch.uint8),
                                                                b.block_scales.view(torch.uint8))
        assert torch.equal(a.global_scale, b.global_scale) and torch.equal(a.amax, b.amax)
        assert a.shape == b.shape and a.block == b.block


def test_quantize_auto_keeps_cpu_on_the_reference():
    assert not quantize_uses_kernels(torch.zeros(2, 16), "auto")
    assert quantize_uses_kernels(torch.zeros(2, 16), "triton")
    assert not quantize_uses_kernels(torch.zeros(2, 16, device=DEVICE), "ref")
    with pytest.raises(ValueError, match="backend"):
        quantize(torch.zeros(2, 16), backend="cuda")
    x = torch.zeros(2, 16)
    x[1, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x, backend="triton")


def test_only_covered_recipes_use_the_kernels():
    assert use_kernels(ALIGNED_TRITON, DEVICE)
    assert not use_kernels(ALIGNED_REF, DEVICE)
    # 'auto': the kernels on CUDA, the reference on the CPU (also under the interpreter)
    assert use_kernels(get_recipe("aligned"), "cuda") and not use_kernels(get_recipe("aligned"), "cpu")
    for name in ("te", "vllm", "torchao"):
        assert use_kernels(get_recipe(name).with_execution(backend="triton"), DEVICE)
        assert not use_grouped_kernels(get_recipe(name).with_execution(backend="triton"), DEVICE)
    assert use_grouped_kernels(ALIGNED_TRITON, DEVICE)
    assert not use_kernels(get_recipe("bf16").with_execution(backend="triton"), DEVICE)
    for changes in (dict(rounding="stochastic"), dict(hadamard=True)):
        spec = QuantSpec(scaling="tensor", **changes)
        assert not use_kernels(get_recipe("te", activation=spec).with_execution(backend="triton"), DEVICE)


@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5)])
def test_linear_triton_matches_ref(lead):
    ref, tri = _pair(Linear, 64, 48)
    x = torch.randn(*lead, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    a, b = tri(x), ref(x)
    assert a.dtype == b.dtype and a.shape == b.shape
    _assert_gemm_close(a, b, _gemm_bound(x, tri), 64)
    assert (a == b).float().mean().item() >= GAUSSIAN_EQUAL_FRAC


def test_segmented_linear_quantizes_its_input_once(monkeypatch):
    """A q|k|v-like SegmentedLinear (few rows: each segment's own GEMM) quantizes its input once for
    all segments and gives each segment the outputs of a separate Linear with its rows; a quantization
    handed over is used as is."""
    from minite.kernels import nvfp4 as kq
    from minite.nn.linear import SegmentedLinear
    from minite.nn.nvfp4_matmul import quantize_input

    torch.manual_seed(0)
    seg = SegmentedLinear(64, (48, 32, 32), recipe=ALIGNED_TRITON).to(DEVICE)
    lins = [Linear(64, n, recipe=ALIGNED_TRITON).to(DEVICE) for n in (48, 32, 32)]
    with torch.no_grad():
        for lin, w in zip(lins, seg.segments()):
            lin.weight.copy_(w)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want = [lin(x) for lin in lins]
    calls = []
    real = kq.quantize_unscaled
    monkeypatch.setattr(kq, "quantize_unscaled", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = seg(x)
    assert len(calls) == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    xq = quantize_input(x, seg.recipe)
    assert all(torch.equal(a, b) for a, b in zip(seg(x, xq), want)) and len(calls) == 2


@pytest.mark.parametrize("config", [tiny_qwen3, tiny_qwen3_moe])
def test_norms_and_swiglu_hand_their_quantization_to_the_projections(monkeypatch, config):
    """With the fused kernels on, a layer's two norms quantize their outputs for q/k/v and gate/up
    (`kernels.norm.rms_norm_quantize`; in MoE layers each token's row, which the experts' gate/up read
    for every expert the token goes to), its SwiGLU for down (`kernels.swiglu`): three quantizer
    launches per layer fewer (o's stays), the same logits bit for bit as without."""
    from minite.kernels import nvfp4 as kq
    from minite.nn import nvfp4_matmul

    torch.manual_seed(0)
    model = Qwen3(config(), recipe=ALIGNED_TRITON.with_execution(elementwise="triton"))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    model.to(DEVICE, torch.bfloat16)  # 16-bit rows: the norm quantizes in its own launch (`norm_pairs`)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ids = ids.to(DEVICE)
    calls = []
    real = kq.quantize_unscaled
    monkeypatch.setattr(kq, "quantize_unscaled", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = model(ids)
    fused_calls = len(calls)
    monkeypatch.setattr(nvfp4_matmul, "hands_over", lambda *a: False)
    want = model(ids)
    layers = model.config.num_hidden_layers
    # without the handover: qkv, o, gate/up, down
    assert (fused_calls, len(calls) - fused_calls) == (layers, 4 * layers)
    assert torch.equal(got, want)


@pytest.mark.parametrize("config", [tiny_qwen3, tiny_qwen3_moe])
def test_sampler_forward_adds_the_residual_in_its_kernels_with_the_learners_bits(monkeypatch, config):
    """Without gradients (the sampler) the post-attention norm adds the residual in its launch, with them
    (the learner) torch adds; a MoE block's combine adds its residual in both: the same logits bit for
    bit."""
    from minite.kernels import moe_combine as kc
    from minite.kernels import norm as kn

    torch.manual_seed(0)
    model = Qwen3(config(), recipe=ALIGNED_TRITON.with_execution(elementwise="triton"))
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    model.to(DEVICE, torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ids = ids.to(DEVICE)
    fused = {"norm": 0, "combine": 0}
    real_norm, real_combine = kn.add_rms_norm, kc.combine

    def norm(*a):
        fused["norm"] += 1
        return real_norm(*a)

    def combine(ys, inverse, w, residual=None):
        fused["combine"] += residual is not None
        return real_combine(ys, inverse, w, residual)
    monkeypatch.setattr(kn, "add_rms_norm", norm)
    monkeypatch.setattr(kc, "combine", combine)
    layers = model.config.num_hidden_layers
    moe_layers = sum(layer.is_moe for layer in model.layers)
    assert moe_layers == (layers if config is tiny_qwen3_moe else 0)
    learner = model(ids)
    assert fused == {"norm": 0, "combine": moe_layers}
    with torch.no_grad():
        sampler = model(ids)
    assert fused == {"norm": layers, "combine": 2 * moe_layers}
    assert torch.equal(sampler, learner.detach())


def test_linear_triton_heavy_tailed_within_bound_and_batch_invariant():
    ref, tri = _pair(Linear, 128, 40, bias=True)
    x = (torch.randn(9, 128, generator=torch.Generator().manual_seed(3)) ** 3).to(DEVICE)
    x[4] *= 100.0
    _assert_gemm_close(tri(x), ref(x), _gemm_bound(x, tri), 128)
    full = tri(x)
    for rows in (slice(0, 1), slice(2, 5), slice(4, 9)):
        assert torch.equal(tri(x[rows]), full[rows])


def test_linear_triton_k_not_a_multiple_of_the_tile_and_fast_mode():
    ref, tri = _pair(Linear, 48, 24)  # K = 48: zero-padded to the GEMM's K tile
    x = torch.randn(6, 48, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    _assert_gemm_close(tri(x), ref(x), _gemm_bound(x, tri), 48)
    ref, tri = _pair(Linear, 512, 32)  # K a multiple of the decode layout's column group: decode GEMM
    tri.set_recipe(tri.recipe.with_execution(fast=True))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    _assert_gemm_close(tri(x), ref(x), _gemm_bound(x, tri), 512)


VARIANTS = {"alpha": dict(epilogue="alpha"),
            "w16x16": dict(weight=QuantSpec(scaling="tensor", block=(16, 16))),
            "vllm_chain": dict(activation=QuantSpec(scaling="row", chain="vllm"))}
# the interpreter's fp32 -> bf16 cast truncates (docs/facts.md: bf16 is broken there)
if torch.cuda.is_available():
    VARIANTS["bf16_scalar"] = dict(epilogue="bf16_scalar")


@pytest.mark.parametrize("changes", list(VARIANTS.values()), ids=list(VARIANTS))
def test_linear_triton_covers_variants_of_aligned(changes):
    recipe = get_recipe("aligned", **changes).with_execution(backend="ref")
    torch.manual_seed(0)
    ref = Linear(64, 40, recipe=recipe).to(DEVICE)
    tri = Linear(64, 40, recipe=recipe.with_execution(backend="triton")).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    assert use_kernels(tri.recipe, DEVICE)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    assert torch.equal(tri(x), ref(x))


def test_linear_uncovered_recipe_falls_back_to_the_reference():
    torch.manual_seed(0)
    spec = QuantSpec(scaling="tensor", hadamard=True)
    ref = Linear(64, 32, recipe=get_recipe("te", activation=spec).with_execution(backend="ref")).to(DEVICE)
    tri = Linear(64, 32, recipe=get_recipe("te", activation=spec).with_execution(backend="triton")).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64, device=DEVICE)
    assert torch.equal(tri(x), ref(x))


def _calibrated(lin: Linear, x: torch.Tensor) -> Linear:
    lin.input_scale = (x.abs().amax().float() * 1.5) / 2688  # headroom: inputs stay inside the scale
    return lin


@pytest.mark.parametrize("name", ["te", "vllm", "torchao"])
@pytest.mark.parametrize("rows", [3, 80])  # the decode layout and the bf16 copy
def test_linear_engine_emulations_on_the_kernels_match_their_references(name, rows):
    """`te` (per-tensor dynamic scale, 16x16 weights, alpha epilogue), `vllm` (static scale) and
    `torchao` run their forward on the kernels with the reference's bits (Gaussian inputs: every fp32
    accumulation exact) and, like the reference, one global scale for the whole input: a row's output
    depends on the others under `te`, not under the static scale."""
    if name == "torchao" and not torch.cuda.is_available():
        pytest.skip("the bf16_scalar epilogue needs the GPU's bf16 rounding (interpreter truncates)")
    torch.manual_seed(0)
    ref = Linear(64, 48, recipe=get_recipe(name).with_execution(backend="ref")).to(DEVICE)
    tri = Linear(64, 48, recipe=get_recipe(name).with_execution(backend="triton")).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    if name == "vllm":
        _calibrated(ref, x), _calibrated(tri, x)
        tri.input_scale = ref.input_scale.clone()
    assert use_kernels(tri.recipe, DEVICE)
    out = tri(x)
    assert torch.equal(out, ref(x))
    if name == "vllm":
        assert torch.equal(tri(x[:2]), out[:2])
    x2 = x.clone()
    x2[-1] *= 8  # a larger amax elsewhere in the batch
    assert torch.equal(tri(x2), ref(x2))


@pytest.mark.parametrize("backward", ["dequantized", "nvfp4"])
def test_linear_triton_backward(backward):
    torch.manual_seed(0)
    ref = Linear(64, 32, recipe=get_recipe("aligned", backward=backward)).to(DEVICE)
    tri = Linear(64, 32, recipe=ref.recipe.with_execution(backend="triton")).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 64, device=DEVICE)
    grads = []
    for lin in (ref, tri):
        xi = x.clone().requires_grad_()
        lin(xi).square().sum().backward()
        grads.append((xi.grad, lin.weight.grad))
    (dx_r, dw_r), (dx_t, dw_t) = grads
    assert dx_t.shape == x.shape and dw_t.shape == tri.weight.shape
    if backward == "dequantized":  # the same fp32 GEMMs on the same (bitwise) operands
        torch.testing.assert_close(dx_t, dx_r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dw_t, dw_r, rtol=1e-5, atol=1e-6)
    else:  # stochastic rounding: another random stream, same expectation
        assert torch.isfinite(dx_t).all() and torch.isfinite(dw_t).all()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU raises; CUDA marks NaN rows (GPU test)")
def test_linear_triton_non_finite_input_raises_on_cpu():
    _, tri = _pair(Linear, 32, 16)
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        tri(x)


def test_sort_by_expert_agrees_with_the_padded_grouping():
    ids = torch.tensor([[3, 0], [1, 3], [3, 1], [4, 0]])
    s, g = sort_by_expert(ids, 6), group_by_expert(ids, 6)
    assert s.offsets.tolist() == [0, 2, 4, 4, 7, 8, 8]
    assert torch.equal(s.tokens, g.tokens) and torch.equal(s.inverse, g.inverse)
    assert torch.equal(s.experts, g.experts[g.slot])
    assert torch.equal(s.experts[s.inverse].reshape(ids.shape), ids)


def test_sort_by_expert_takes_the_counting_sort_where_the_elementwise_kernels_run(monkeypatch):
    """A decode step's assignments on the counting sort kernel (the same integers); beyond what it
    serves, and where the element-wise kernels do not run, the reference."""
    from minite.execution import Execution
    from minite.kernels import moe_sort as km

    calls = []
    real = km.sort_by_expert
    monkeypatch.setattr(km, "sort_by_expert", lambda *a: calls.append(a[0].numel()) or real(*a))
    ids = torch.randint(0, 16, (40, 4), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    on, off = Execution(elementwise="triton"), Execution("ref", "ref")
    assert all(torch.equal(a, b) for a, b in zip(sort_by_expert(ids, 16, on), sort_by_expert(ids, 16, off)))
    assert calls == [160]
    many = torch.zeros(km.MAX_CHUNKS * km.CHUNK // 4 + 1, 4, dtype=torch.int64, device=DEVICE)
    assert sort_by_expert(many, 16, on).offsets[1].item() == many.numel() and calls == [160]


def test_moe_triton_matches_ref_and_moe_reference():
    ref, tri = _pair(MoEExperts, 4, 64, 32, 2)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    a, b = tri(x), ref(x)
    # SwiGLU between the two GEMMs can move a code of the down projection's input: compare loosely
    assert ((a - b).norm() / b.norm()).item() <= LOGITS_REL_RMS
    # the grouped kernel gives an expert's rows the bits of a per-expert dense GEMM
    assert torch.equal(moe_reference(tri, x), a)
    assert torch.equal(tri(x[:4]), a[:4])


def test_moe_triton_grouped_decode_and_bf16_copy_give_the_same_bits(monkeypatch):
    """Few rows per expert run the grouped decode kernel on the packed weights, many the aligned tile
    on the bf16 copy: the same outputs either way (K = 64: one interpreter K step)."""
    _, tri = _pair(MoEExperts, 4, 64, 32, 2)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    tri.set_recipe(tri.recipe.with_execution(decode_max_rows_per_expert=64))
    decoded = tri(x)
    assert tri.quantized_weight("gate_up_proj").decode_dtypes()
    tri.set_recipe(tri.recipe.with_execution(decode_max_rows_per_expert=0))
    assert torch.equal(tri(x), decoded)


def test_moe_triton_backward_matches_ref():
    ref, tri = _pair(MoEExperts, 4, 64, 32, 2)
    x = torch.randn(6, 64, device=DEVICE)
    grads = []
    for moe in (ref, tri):
        xi = x.clone().requires_grad_()
        moe(xi).square().sum().backward()
        grads.append((xi.grad, moe.gate_up_proj.grad, moe.down_proj.grad))
    for t, r in zip(grads[1], grads[0]):
        torch.testing.assert_close(t, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("decode_rows", [64, 0], ids=["decode_kernel", "bf16_copy"])
def test_grouped_matmul_reads_token_rows_as_the_gathered_rows(decode_rows):
    """`rows`: the tokens quantized once and read through the index give the outputs, input and weight
    gradients of the gathered rows passed in, bit for bit (decode kernel and bf16-copy tile)."""
    from minite.nn.nvfp4_matmul import grouped_nvfp4_matmul

    _, tri = _pair(MoEExperts, 4, 64, 32, 2)
    tri.set_recipe(tri.recipe.with_execution(decode_max_rows_per_expert=decode_rows))
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    s = sort_by_expert(torch.tensor([[0, 2], [3, 1], [2, 0], [1, 3], [0, 3], [2, 1], [3, 0]]).to(DEVICE), 4)
    results = []
    for through_rows in (True, False):
        w = tri.gate_up_proj.detach().clone().requires_grad_()
        xi = x.clone().requires_grad_()
        qw = tri.quantized_weight("gate_up_proj")
        if through_rows:
            y = grouped_nvfp4_matmul(xi, w, qw, tri.recipe, s.offsets, s.experts, rows=s.tokens)
        else:
            y = grouped_nvfp4_matmul(xi[s.tokens], w, qw, tri.recipe, s.offsets, s.experts)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, w.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tiny_model_logits_triton_vs_ref(moe):
    cfg = (tiny_qwen3_moe if moe else tiny_qwen3)(num_hidden_layers=1)
    torch.manual_seed(0)
    ref = Qwen3(cfg, recipe=ALIGNED_REF).to(DEVICE)
    tri = Qwen3(cfg, recipe=ALIGNED_TRITON).to(DEVICE)
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 5), device=DEVICE)
    with torch.no_grad():
        a, b = tri(ids), ref(ids)
    assert ((a - b).norm() / b.norm()).item() <= LOGITS_REL_RMS


def _cuda_pair(module_cls, *args, dtype=torch.float32, **kwargs):
    torch.manual_seed(0)
    ref = module_cls(*args, recipe=ALIGNED_REF, **kwargs).to("cuda", dtype)
    tri = module_cls(*args, recipe=ALIGNED_TRITON, **kwargs).to("cuda", dtype)
    tri.load_state_dict(ref.state_dict())
    return ref, tri


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_aligned_linear_triton_vs_ref(dtype):
    ref, tri = _cuda_pair(Linear, 512, 384, dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = (torch.randn(300, 512, device="cuda", generator=g) ** 3).to(dtype)
    full = tri(x)
    _assert_gemm_close(full, ref(x), _gemm_bound(x, tri), 512, BF16_RTOL if dtype == torch.bfloat16 else 0.0)
    for m in (1, 7, 64):  # the aligned config: rows do not depend on M
        assert torch.equal(tri(x[:m]), full[:m])
    # M <= execution.decode_max_m read the packed weight in the decode layout; 300 rows the bf16 copy
    assert torch.bfloat16 in tri.quantized_weight().decode_dtypes()


def test_aligned_linear_few_rows_take_the_decode_layout_with_the_same_bits(monkeypatch):
    """M <= execution.decode_max_m runs the decode kernel in the aligned K order: the same rows as the
    aligned GEMM on the bf16 copy (interpreter, fp16; the GPU test checks bf16 on heavy-tailed data)."""
    _, tri = _pair(Linear, 128, 48)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    decoded = tri(x)
    assert tri.quantized_weight().decode_dtypes()
    tri.set_recipe(tri.recipe.with_execution(decode_max_m=0))
    assert torch.equal(tri(x), decoded)


@pytest.mark.gpu
def test_gpu_non_finite_rows_become_nan_without_a_sync():
    _, tri = _cuda_pair(Linear, 64, 32)
    x = torch.randn(4, 64, device="cuda")
    clean = tri(x)  # quantizes the weight (a host sync, once per update)
    x[1, 3], x[2, 0] = float("nan"), float("inf")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tri(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isnan(out[1:3]).all()
    assert torch.equal(out[0], clean[0]) and torch.equal(out[3], clean[3])


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpu_tiny_model_logits_triton_vs_ref(moe):
    cfg = (tiny_qwen3_moe if moe else tiny_qwen3)()
    ref, tri = Qwen3(cfg, recipe=ALIGNED_REF).cuda(), Qwen3(cfg, recipe=ALIGNED_TRITON).cuda()
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (3, 17), device="cuda")
    with torch.no_grad():
        a, b = tri(ids), ref(ids)
    assert ((a - b).norm() / b.norm()).item() <= LOGITS_REL_RMS


def _capture(fn, x):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("module", ["linear", "moe"])
def test_gpu_cuda_graph_capture_of_triton_modules(module):
    torch.manual_seed(0)
    if module == "linear":
        m = Linear(64, 48, recipe=ALIGNED_TRITON).cuda()
    else:
        m = MoEExperts(8, 64, 32, 2, recipe=ALIGNED_TRITON).cuda()
    assert m.graph_safe()
    static = torch.randn(4, 64, device="cuda")
    with torch.no_grad():
        graph, out = _capture(m, static)
        for seed in (1, 2):
            new = torch.randn(4, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
            static.copy_(new)
            graph.replay()
            assert torch.equal(out, m(new))


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpu_sampler_graphs_on_for_triton_aligned(moe):
    from minite.sampler import Sampler
    from minite.sampling import SamplingParams
    from tests.sampler.common import full_forward_logprobs, prompts_of, tiny_model, tokens_of

    model = tiny_model(ALIGNED_TRITON, moe=moe).cuda()
    prompts = prompts_of([5, 13, 2])
    params = SamplingParams(n=2, max_tokens=12, top_k=50, seed=5)
    graphed = Sampler(model, max_num_seqs=8, kv_cache_tokens=1024)
    eager = Sampler(model, max_num_seqs=8, kv_cache_tokens=1024, cuda_graphs=False)
    assert graphed.use_graphs
    assert not Sampler(tiny_model(ALIGNED_REF, moe=moe).cuda(), kv_cache_tokens=256).use_graphs
    a, b = graphed.generate(prompts, params), eager.generate(prompts, params)
    assert graphed.stats["graph_steps"] > 0
    assert tokens_of(a) == tokens_of(b)
    for prompt, ra, rb in zip(prompts, a, b):
        for sa, sb in zip(ra.samples, rb.samples):
            assert (sa.logprobs - sb.logprobs).abs().max().item() <= GRAPH_LOGPROB_TOL
            ref = full_forward_logprobs(model, prompt, sa.token_ids, params)
            assert (ref - sa.logprobs).abs().max().item() <= FULL_FORWARD_LOGPROB_TOL


def test_moe_grouped_mm_backward_matches_the_padded_one(monkeypatch):
    """bf16 experts on the kernels: the 'dequantized' backward on torch._grouped_mm (unpadded, no host
    sync) against the padded bmm layout; both bf16 GEMMs, so equal to bf16 rounding."""
    _, tri = _pair(MoEExperts, 8, 64, 32, 2)
    tri = tri.to(torch.bfloat16)
    g = torch.Generator(DEVICE).manual_seed(3)
    x = torch.randn(11, 64, device=DEVICE, generator=g).to(torch.bfloat16)
    grads, calls = [], []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    for on in (False, True):
        tri.set_recipe(tri.recipe.with_execution(grouped_mm=on))
        tri.zero_grad()
        xi = x.clone().requires_grad_()
        tri(xi).float().square().sum().backward()
        grads.append((xi.grad.float(), tri.gate_up_proj.grad.float(), tri.down_proj.grad.float()))
    assert len(calls) == 4  # dX and dW of both projections, only when switched on
    for t, r in zip(grads[1], grads[0]):
        assert ((t - r).norm() / r.norm()).item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["te", "vllm"])
def test_gpu_engine_emulation_models_on_the_kernels_match_their_references(name):
    """The naive pair's forwards on the kernels (bf16 model, 4 layers): the GEMMs sum exact 16-block
    products in another order than the reference's fp32 matmul, so logits are bitwise equal wherever
    those sums are exact (random-weight models: all of them, at these sizes)."""
    from minite.nn.calibrate import calibrate, load_static_scales, static_scales

    cfg = tiny_qwen3(num_hidden_layers=4)
    torch.manual_seed(0)
    ref = Qwen3(cfg, recipe=get_recipe(name).with_execution(backend="ref")).to("cuda", torch.bfloat16)
    tri = Qwen3(cfg, recipe=get_recipe(name).with_execution(backend="triton")).to("cuda", torch.bfloat16)
    tri.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (4, 33), device="cuda")
    if name == "vllm":
        with torch.no_grad(), calibrate(ref):
            ref(ids)
        load_static_scales(tri, static_scales(ref))
    with torch.no_grad():
        a, b = tri(ids), ref(ids)
        assert torch.equal(a, b), (a == b).float().mean().item()
        assert torch.equal(tri(ids[:1]), a[:1]) == (name == "vllm")  # te's scale depends on the batch


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["te", "vllm"])
def test_gpu_non_finite_input_under_one_global_scale_makes_every_row_nan(name):
    """One scale for the whole input: an inf anywhere makes every output row NaN (as the reference
    marks the whole tensor), without a host sync."""
    torch.manual_seed(0)
    lin = Linear(64, 32, recipe=get_recipe(name).with_execution(backend="triton")).cuda()
    x = torch.randn(5, 64, device="cuda")
    if name == "vllm":
        _calibrated(lin, x)
    clean = lin(x)
    assert torch.isfinite(clean).all()
    x[2, 3] = float("inf")
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = lin(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isnan(out).all()
