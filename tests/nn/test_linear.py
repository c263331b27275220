import pytest
import torch
import torch.nn.functional as F

from minite.nn import Linear, calibrate, refresh_quantized_weights
from minite.nn.quantized_weight import deferred_finite_checks, quantize_weight
from minite.nvfp4 import dequantize, quantize
from minite.ref.gemm import nvfp4_gemm
from minite.ref.hadamard import apply_rht

# Our epilogue applies S_dec_x * S_dec_w to the fp32 sum of unscaled products; the reference below
# scales each operand first. Each term then differs by <= 3 fp32 roundings (two operand scalings,
# one product) and the two fp32 accumulations differ by <= K roundings of partial sums, so we bound
# |ours - ref| by FWD_RTOL * sum_k |x_dq| |w_dq| (~16 ulps of fp32; observed < 4 ulps).
FWD_RTOL = 2.0**-20
# bf16_scalar (torchao) rounds the accumulator and the scale to bf16 before the product.
BF16_SCALAR_RTOL = 2.0**-7
# dequantized backward runs the very GEMMs of the straight-through reference in fp32.
GRAD_RTOL = 1e-6
RECIPES = ["aligned", "te", "torchao"]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _qkw(spec):
    return spec.kwargs()


def test_bf16_recipe_is_plain_linear():
    lin = Linear(32, 16, bias=True, recipe="bf16")
    x = torch.randn(2, 3, 32)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 5)])
def test_forward_equals_reference_gemm_bitwise(recipe, lead):
    lin = Linear(64, 48, recipe=recipe)
    x = torch.randn(*lead, 64)
    r = lin.recipe
    xq = quantize(x.reshape(-1, 64), **_qkw(r.activation))
    wq = quantize(lin.weight.detach(), **_qkw(r.weight))
    ref = nvfp4_gemm(xq, wq, r.epilogue).reshape(*lead, 48)
    assert torch.equal(lin(x), ref)


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_equals_product_of_dequantized_operands(recipe):
    lin = Linear(128, 32, recipe=recipe)
    x = torch.randn(9, 128) ** 3  # heavy-tailed rows
    r = lin.recipe
    xd = dequantize(quantize(x, **_qkw(r.activation)))
    wd = dequantize(quantize(lin.weight.detach(), **_qkw(r.weight)))
    ref = xd @ wd.T
    bound = xd.abs() @ wd.abs().T
    rtol = BF16_SCALAR_RTOL if r.epilogue == "bf16_scalar" else FWD_RTOL
    assert ((lin(x) - ref).abs() <= rtol * bound).all()


def test_aligned_is_batch_invariant_and_te_is_not():
    x = torch.randn(8, 64)
    x[5] *= 100.0  # an outlier token in the batch
    aligned, te = Linear(64, 32, recipe="aligned"), Linear(64, 32, recipe="te")
    te.weight.data.copy_(aligned.weight.data)
    assert torch.equal(aligned(x[:3]), aligned(x)[:3])
    assert not torch.equal(te(x[:3]), te(x)[:3])


def test_set_recipe_after_construction():
    lin = Linear(32, 16, recipe="bf16")
    x = torch.randn(4, 32)
    plain = lin(x)
    lin.set_recipe("aligned")
    xq, wq = quantize(x, scaling="row"), quantize(lin.weight.detach())
    assert torch.equal(lin(x), nvfp4_gemm(xq, wq, "sdec"))
    assert not torch.equal(lin(x), plain)


def test_bias_is_added_after_the_epilogue():
    lin = Linear(32, 16, bias=True)
    x = torch.randn(3, 32)
    ref = nvfp4_gemm(quantize(x, scaling="row"), quantize(lin.weight.detach())) + lin.bias
    assert torch.equal(lin(x), ref)


def test_bad_inputs_raise():
    lin = Linear(24, 16)
    with pytest.raises(ValueError, match="divisible by 16"):
        lin(torch.randn(2, 24))
    lin = Linear(32, 16)
    x = torch.randn(2, 32)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        lin(x)


@pytest.mark.parametrize("recipe", RECIPES)
def test_dequantized_backward_is_straight_through(recipe):
    lin = Linear(64, 32, bias=True, recipe=recipe)
    x = torch.randn(2, 5, 64, requires_grad=True)
    g = torch.randn(2, 5, 32)
    lin(x).backward(g)
    r = lin.recipe
    xd = dequantize(quantize(x.detach().reshape(-1, 64), **_qkw(r.activation))).requires_grad_()
    wd = dequantize(quantize(lin.weight.detach(), **_qkw(r.weight))).requires_grad_()
    b = lin.bias.detach().clone().requires_grad_()
    (xd @ wd.T + b).backward(g.reshape(-1, 32))
    assert _rel(x.grad.reshape(-1, 64), xd.grad) <= GRAD_RTOL
    assert _rel(lin.weight.grad, wd.grad) <= GRAD_RTOL
    assert torch.equal(lin.bias.grad, b.grad)


def test_nvfp4_backward_unbiased_in_expectation():
    """Average of SR_PASSES stochastic-rounding backward passes vs the exact expectation over the
    rounding. One pass is off by ~14 % (relative Frobenius); the mean must be off by at most
    SR_TOL = 3 * 0.14 / sqrt(SR_PASSES) (3 sigma of pure sampling noise, no bias).

    The expectation keeps the deterministic parts: W and X^T quantized with RNE (X^T along the
    tokens, with RHT), and E4M3 RNE block scales that round down clip ~3 % of elements at 6 (TE's
    chain does the same). That clipping makes the mean differ from the straight-through gradient
    by ~1 %; SAT_BIAS bounds that gap for dgrad.
    """
    sr_passes, sat_bias = 200, 0.03
    sr_tol = 3 * 0.14 / sr_passes**0.5
    m, k, n = 40, 32, 32  # m not a multiple of 16: wgrad pads the tokens
    lin = Linear(k, n, recipe="aligned")
    lin.set_recipe(lin.recipe.replace(backward="nvfp4"))
    x, g = torch.randn(m, k), torch.randn(m, n)
    wd = lin.quantized_weight().dequantize()
    dx_exp = _sr_expectation(g) @ wd
    xt = F.pad(x.T, (0, -m % 16))
    dw_exp = _sr_expectation(apply_rht(F.pad(g.T, (0, -m % 16)))) @ dequantize(quantize(xt, hadamard=True)).T
    dx_sum, dw_sum = torch.zeros(m, k), torch.zeros(n, k)
    for i in range(sr_passes):
        xr = x.clone().requires_grad_()
        lin.weight.grad = None
        lin(xr).backward(g)
        dx_sum += xr.grad
        dw_sum += lin.weight.grad
        if i == 0:
            single = min(_rel(xr.grad, dx_exp), _rel(lin.weight.grad, dw_exp))
    assert single > 0.05
    assert _rel(dx_sum / sr_passes, dx_exp) < sr_tol
    assert _rel(dw_sum / sr_passes, dw_exp) < sr_tol
    assert _rel(dx_sum / sr_passes, g @ wd) < sat_bias


def _sr_expectation(t):
    """E[dequantize(quantize(t, rounding='stochastic'))] (per-tensor te chain, 1x16): SR is unbiased
    between grid points and saturates at 6 times the block's decode scale."""
    q = quantize(t)
    step = q.block_scales.float().repeat_interleave(16, -1) * q.global_scale
    v = torch.where(step > 0, t / torch.where(step > 0, step, 1.0), 0.0)
    return v.clamp(-6.0, 6.0) * step


def test_quantized_weight_is_cached_and_invalidated():
    lin = Linear(32, 16)
    qw = lin.quantized_weight()
    lin(torch.randn(2, 32))
    assert lin.quantized_weight() is qw
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(2, 32)).sum().backward()
    opt.step()
    qw2 = lin.quantized_weight()
    assert qw2 is not qw
    assert torch.equal(qw2.unscaled.float() * qw2.global_scale, dequantize(quantize(lin.weight.detach())))
    lin.weight.data.mul_(2.0)  # .data bypasses the version counter: explicit refresh needed
    assert lin.quantized_weight() is qw2
    assert refresh_quantized_weights(torch.nn.Sequential(lin)) == 1
    assert lin.quantized_weight() is not qw2
    lin.set_recipe("te")
    assert lin.quantized_weight().q.block == (16, 16)


def test_quantized_weight_matches_container_and_is_exact_in_bf16():
    lin = Linear(64, 32, recipe="te")
    qw = lin.quantized_weight()
    assert qw.unscaled.dtype == torch.bfloat16
    assert torch.equal(qw.unscaled.float(), qw.q.unscaled())
    assert torch.equal(qw.dequantize(), dequantize(qw.q))


def test_static_scale_needs_calibration():
    lin = Linear(32, 16, recipe="vllm")
    x = torch.randn(6, 32)
    with pytest.raises(RuntimeError, match="never calibrated"):
        lin(x)
    with calibrate(lin):
        assert torch.equal(lin(x[:3]), F.linear(x[:3], lin.weight))
        lin(x[3:])
    assert torch.equal(lin.input_scale, x.abs().amax() / 2688.0)
    r = lin.recipe
    xq = quantize(x, static_scale=lin.input_scale, **_qkw(r.activation))
    wq = quantize(lin.weight.detach(), **_qkw(r.weight))
    assert torch.equal(lin(x), nvfp4_gemm(xq, wq, r.epilogue))
    assert "input_scale" not in lin.state_dict()


def test_failed_calibration_stores_nothing():
    lin = Linear(32, 16, recipe="vllm")
    with pytest.raises(KeyError), calibrate(lin):
        lin(torch.randn(2, 32))
        raise KeyError("boom")
    assert lin.input_scale is None


@pytest.mark.parametrize("recipe", ["aligned", "te"])
def test_bf16_dequantized_backward_runs_bf16_gemms_close_to_straight_through(recipe, monkeypatch):
    """bf16 models: the backward GEMMs run in bf16 on the unscaled operands (scales around them);
    against the fp32 straight-through gradient the error is of bf16's order, no more."""
    torch.manual_seed(1)
    lin = Linear(256, 128, recipe=recipe).to(torch.bfloat16)
    x = torch.randn(3, 40, 256, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(3, 40, 128, dtype=torch.bfloat16)
    dtypes = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: dtypes.append(a.dtype) or real_mm(a, b))
    lin(x).backward(g)
    monkeypatch.undo()
    assert dtypes == [torch.bfloat16, torch.bfloat16]  # dgrad and wgrad, nothing in fp32
    r = lin.recipe
    xd = dequantize(quantize(x.detach().float().reshape(-1, 256), **_qkw(r.activation))).requires_grad_()
    wd = dequantize(quantize(lin.weight.detach().float(), **_qkw(r.weight))).requires_grad_()
    (xd @ wd.T).backward(g.float().reshape(-1, 128))
    assert x.grad.dtype == lin.weight.grad.dtype == torch.bfloat16
    # measured 2.4e-3 for both: the bf16 rounding of the gradients themselves (2^-9 relative)
    assert _rel(x.grad.float().reshape(-1, 256), xd.grad) <= 5e-3
    assert _rel(lin.weight.grad.float(), wd.grad) <= 5e-3


@pytest.mark.parametrize("recipe", ["aligned", "te"])
def test_refresh_brings_the_weight_scales_to_the_host_and_dgrad_keeps_its_bits(recipe):
    """After refresh_quantized_weights every weight knows its S_dec as host floats (fetched with the
    refresh's one sync); the bf16 backward then takes its lean path (`_dense_bf16_grads`: dX scaled
    by that Python float instead of the fp32 tensor, 2D GEMMs): the same bits for dX and dW."""
    torch.manual_seed(3)
    lin = Linear(64, 48, recipe=recipe).to(torch.bfloat16)
    x = torch.randn(2, 40, 64, dtype=torch.bfloat16)
    g = torch.randn(2, 40, 48, dtype=torch.bfloat16)
    grads = []
    for refresh in (False, True):
        lin.refresh_quantized_weight() if not refresh else refresh_quantized_weights(lin)
        qw = lin.quantized_weight()
        assert (qw.host_global_scale() is not None) == refresh
        xr = x.clone().requires_grad_()
        lin.weight.grad = None
        lin(xr).backward(g)
        grads.append((xr.grad, lin.weight.grad))
    assert qw.host_global_scale() == (qw.global_scale.item(),)
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("stack_bytes", [1 << 29, 1])
def test_refresh_quantizes_same_shape_weights_together_with_the_same_bits(stack_bytes, monkeypatch):
    """refresh_quantized_weights stacks the 2D weights of one shape and spec into one quantize launch
    (chunked by STACK_BYTES, the segments of segmented projections apart from the others and in whole
    multiples of SEGMENT_STACK_MULTIPLE); every weight (a segment too) gets bitwise its own
    `quantize_weight`, host S_dec included."""
    from minite import kernels
    from minite.models import Qwen3, tiny_qwen3
    from minite.nn import quantized_weight as qwm
    from minite.nn import refresh
    from minite.nn.linear import SegmentedLinear

    if not kernels.available():
        pytest.skip("Triton is not installed")
    model = Qwen3(tiny_qwen3(), recipe="aligned").to(torch.bfloat16)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(1))
    launches = []
    real = qwm._quantize_at_once
    monkeypatch.setattr(qwm, "_quantize_at_once",
                        lambda w, spec: launches.append(w.shape[0]) or real(w, spec))
    monkeypatch.setattr(refresh, "STACK_BYTES", stack_bytes)
    one_launch = qwm._one_launch  # the kernels' path on the CPU too (interpreter), as on CUDA
    monkeypatch.setattr(qwm, "_one_launch", lambda w, spec, backend: one_launch(w, spec, "triton"))
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.recipe.fp4]
    # (weight, its quantized weight after the refresh, whether it is a segment)
    units = []
    assert refresh_quantized_weights(model) >= len(linears)
    for m in linears:
        if isinstance(m, SegmentedLinear):
            units += [(w, q, True) for w, q in zip(m.segments(), m.quantized_weights())]
        else:
            units.append((m.weight, m.quantized_weight(), False))
    shapes = {(tuple(w.shape), seg) for w, _, seg in units}
    assert sum(launches) == len(units)
    # stack_bytes 1: one weight a launch, but segments in whole multiples (a module's unsplit)
    seg_counts = [sum(1 for w, _, seg in units if (tuple(w.shape), seg) == key) for key in shapes if key[1]]
    per_weight = len(units) - sum(seg_counts) + sum(
        -(-n // refresh.SEGMENT_STACK_MULTIPLE) for n in seg_counts)
    assert len(launches) == (len(shapes) if stack_bytes > 1 else per_weight)
    for w, got, _ in units:
        want = quantize_weight(w, got.spec)
        assert got.key == want.key and got.host_global_scale() == (want.global_scale.item(),)
        for a, b in [(got.q.codes, want.q.codes), (got.q.block_scales.view(torch.uint8),
                                                   want.q.block_scales.view(torch.uint8)),
                     (got.q.global_scale, want.q.global_scale), (got.q.amax, want.q.amax),
                     (got.unscaled, want.unscaled)]:
            assert a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_refresh_checks_all_weights_for_non_finite_values_at_once(bad, monkeypatch):
    """refresh_quantized_weights checks every weight with one host sync at the end (a non-finite
    weight has a non-finite amax), not one per weight; a non-finite weight still raises."""
    from minite import nvfp4
    from minite.models import Qwen3, tiny_qwen3_moe
    from minite.nn import refresh_quantized_weights

    model = Qwen3(tiny_qwen3_moe(), recipe="aligned").float()
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(0))
    checks = []
    real = nvfp4._check_finite
    monkeypatch.setattr(nvfp4, "_check_finite", lambda x: checks.append(1) or real(x))
    assert refresh_quantized_weights(model) > 0 and not checks
    with torch.no_grad():
        model.layers[1].mlp.down_proj[2, 3, 4] = bad
    with pytest.raises(ValueError, match="inf or NaN"):
        refresh_quantized_weights(model)


@pytest.mark.parametrize("recipe", ["aligned", "te", "vllm", "torchao"])
@pytest.mark.parametrize("shape", [(48, 64), (3, 32, 64)], ids=["dense", "experts"])
def test_weight_quantized_in_one_launch_equals_the_per_tensor_reference(recipe, shape):
    """The kernel path quantizes a weight (or all experts) in one launch, values included: bitwise the
    reference's per-tensor quantization (interpreter on the CPU)."""
    from minite import kernels
    from minite.nn.quantized_weight import _one_launch
    from minite.recipe import get_recipe

    if not kernels.available():
        pytest.skip("Triton is not installed")
    spec = get_recipe(recipe).weight
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w[..., 3, :16] *= 40.0  # heavy rows
    if len(shape) == 3:
        w[1] = 0.0  # an all-zero expert
    assert _one_launch(w, spec, "triton")
    got, want = quantize_weight(w, spec, backend="triton"), quantize_weight(w, spec, backend="ref")
    for a, b in [(got.q.codes, want.q.codes), (got.q.global_scale, want.q.global_scale),
                 (got.q.amax, want.q.amax), (got.unscaled, want.unscaled)]:
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(got.q.block_scales.view(torch.uint8), want.q.block_scales.view(torch.uint8))
    assert got.q.shape == want.q.shape and got.q.block == want.q.block and got.q.chain == want.q.chain
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"), deferred_finite_checks():
        quantize_weight(w, spec, backend="triton")
