"""Learner.step: micro-batching == one batch, AdamW on fp32 masters == torch.optim.AdamW on an fp32
copy, clipping, activation checkpointing, corrections computed on the whole batch, skipped steps."""

from dataclasses import replace
from functools import partial

import pytest
import torch

from minite.learner import Learner
from minite.recipe import get_recipe
from minite.rl.corrections import token_tis
from minite.rl.losses import LossConfig, policy_loss
from minite.sampling import SamplingParams
from tests.learner.helpers import random_batch, tiny_model

GRAD_RTOL, GRAD_ATOL = 1e-5, 1e-7
PARAMS = SamplingParams(temperature=0.9)  # random tokens: no truncation, finite log-probs
TRITON = get_recipe("aligned").with_execution(backend="triton")


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch(model):
    batch = random_batch(params=PARAMS)
    return replace(batch, old_logprobs=Learner(model).logprobs(batch))


@pytest.mark.parametrize("moe,aggregation", [(False, "token_mean"), (True, "seq_mean")],
                         ids=["dense-token_mean", "moe-seq_mean"])
def test_micro_batching_accumulates_the_one_batch_gradient(moe, aggregation):
    loss_fn = partial(policy_loss, cfg=LossConfig(aggregation=aggregation))
    grads, metrics = [], []
    for tokens in (10_000, 9):
        model = tiny_model(moe, "aligned")
        batch = _batch(model)
        learner = Learner(model, lr=1e-3, micro_batch_tokens=tokens, release_grads=False)
        metrics.append(learner.step(batch, loss_fn, aggregation=aggregation))
        grads.append(_grads(model))
    assert metrics[0]["micro_batches"] == 1 and metrics[1]["micro_batches"] > 3
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"], rel=1e-5, abs=1e-7)
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_whole_batch_correction_is_sliced_per_micro_batch():
    model = tiny_model(False, "aligned")
    batch = random_batch(params=PARAMS)
    old = Learner(model).logprobs(batch)
    batch = replace(batch, old_logprobs=old + 0.1 * torch.randn_like(old))
    rl_full = batch.to_rl_batch(old)
    correction = token_tis(rl_full, cap=1.05)
    grads = []
    for tokens in (10_000, 9):
        model = tiny_model(False, "aligned")
        learner = Learner(model, micro_batch_tokens=tokens, release_grads=False)
        learner.step(batch, partial(policy_loss, cfg=LossConfig()), correction=correction)
        grads.append(_grads(model))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=name)


def test_adamw_on_fp32_masters_matches_torch_adamw_on_fp32_copy():
    model = tiny_model(False, "aligned", dtype=torch.bfloat16)
    ref = {n: p.detach().float().clone().requires_grad_() for n, p in model.named_parameters()}
    hyper = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
    groups = [{"params": [p for p in ref.values() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in ref.values() if p.dim() < 2], "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, **hyper, fused=True)  # the implementation MasterAdamW runs
    learner = Learner(model, weight_decay=0.1, max_grad_norm=None, micro_batch_tokens=12, release_grads=False,
                      **hyper)
    batch = random_batch(params=PARAMS)
    for _ in range(2):
        learner.step(batch, partial(policy_loss, cfg=LossConfig()))
        for n, p in model.named_parameters():
            assert p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16
            ref[n].grad = p.grad.float()
        ref_opt.step()
        for (n, p), master in zip(model.named_parameters(), learner.optimizer.masters):
            assert master.dtype == torch.float32
            assert torch.equal(master, ref[n].detach()), n
            assert torch.equal(p.detach(), master.to(torch.bfloat16)), n


def test_clipping_scales_gradients_to_max_norm_and_reports_the_norm():
    model = tiny_model(False, "aligned")
    batch = _batch(model)
    learner = Learner(model, lr=0.0, max_grad_norm=1e-3, release_grads=False)
    out = learner.step(batch, partial(policy_loss, cfg=LossConfig()))
    clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in learner.optimizer.masters]))
    assert out["grad_norm"] > 1e-2 and out["clip_coef"] == pytest.approx(1e-3 / out["grad_norm"], rel=1e-4)
    assert clipped.item() == pytest.approx(1e-3, rel=1e-4)
    unclipped = Learner(tiny_model(False, "aligned"), lr=0.0, max_grad_norm=1e3).step(
        batch, partial(policy_loss, cfg=LossConfig()))
    assert unclipped["clip_coef"] == 1.0
    assert unclipped["grad_norm"] == pytest.approx(out["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_activation_checkpointing_gives_the_same_gradients(moe):
    grads = []
    for ckpt in (False, True):
        model = tiny_model(moe, "aligned")
        learner = Learner(model, activation_checkpointing=ckpt, release_grads=False)
        learner.step(_batch(model), partial(policy_loss, cfg=LossConfig()))
        grads.append(_grads(model))
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name


def test_activation_checkpointing_on_the_kernels_gives_the_same_gradients(monkeypatch):
    """Triton backend and the attention kernel forced on (interpreter on the CPU): the checkpointed
    forward, which shares one forward scope across layers, and the plain one give the same gradients."""
    import sys

    from minite import kernels
    from minite.recipe import get_recipe

    if not kernels.available():
        pytest.skip("Triton is not installed")
    attention = sys.modules["minite.nn.attention"]
    layouts = []
    real = attention.PackedLayout.__init__
    monkeypatch.setattr(attention.PackedLayout, "__init__", lambda self, *a, **k: layouts.append(1) or
                        real(self, *a, **k))
    grads, built = [], []
    for ckpt in (False, True):
        model = tiny_model(False, get_recipe("aligned").with_execution(backend="triton", attention="triton"))
        learner = Learner(model, activation_checkpointing=ckpt, release_grads=False)
        batch = _batch(model)
        layouts.clear()
        out = learner.step(batch, partial(policy_loss, cfg=LossConfig()))
        grads.append(_grads(model))
        built.append((len(layouts), out["micro_batches"]))
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
    # one attention layout per micro-batch, checkpointed or not (the recompute reuses the forward's)
    assert all(n == mb for n, mb in built), built


def test_non_finite_gradient_skips_the_step():
    model = tiny_model(False, "aligned")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    nan_loss = lambda rl: (rl.logprobs.sum() * float("nan"), {})
    out = Learner(model, lr=1.0).step(_batch(model), nan_loss)
    assert out["skipped"] == 1.0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_step_trains_and_reports_metrics():
    model = tiny_model(False, "aligned")
    batch = _batch(model)
    learner = Learner(model, lr=3e-3, micro_batch_tokens=16)
    first = learner.step(batch, partial(policy_loss, cfg=LossConfig()))
    for key in ("loss", "loss/pg", "loss/clip_frac", "grad_norm", "lr", "tokens_per_s", "micro_batches"):
        assert key in first
    lp0 = (batch.old_logprobs * batch.advantages[:, None] * batch.mask()).sum()
    lp1 = (learner.logprobs(batch) * batch.advantages[:, None] * batch.mask()).sum()
    assert lp1 > lp0  # the policy gradient step raised the advantage-weighted log-likelihood
    with pytest.raises(ValueError, match="advantages"):
        learner.step(replace(batch, advantages=None), partial(policy_loss, cfg=LossConfig()))


@pytest.mark.parametrize("release", [True, False])
def test_step_frees_the_gradients_unless_asked_to_keep_them(release):
    """release_grads frees the parameters' and the masters' grads after the step; it changes nothing
    else (the next step zeroes them first anyway)."""
    params = []
    for keep in (True, release):
        model = tiny_model(False, "aligned", dtype=torch.bfloat16)
        batch = _batch(model)
        learner = Learner(model, lr=1e-2, release_grads=not keep)
        for _ in range(2):
            learner.step(batch, partial(policy_loss, cfg=LossConfig()))
        grads = [p.grad for p in model.parameters()] + [m.grad for m in learner.optimizer.masters]
        assert all(g is not None for g in grads) if keep else all(g is None for g in grads)
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


@pytest.mark.parametrize("freeze", [True, False])
def test_learner_freezes_the_collector_once_after_its_first_step(freeze):
    import gc

    gc.unfreeze()
    try:
        model = tiny_model()
        batch = _batch(model)
        learner = Learner(model, lr=1e-3, micro_batch_tokens=64, freeze_gc=freeze)
        learner.step(batch, partial(policy_loss, cfg=LossConfig()))
        frozen = gc.get_freeze_count()
        assert (frozen > 0) == freeze
        learner.step(batch, partial(policy_loss, cfg=LossConfig()))
        assert gc.get_freeze_count() <= frozen  # no second freeze (frozen objects may still be freed)
    finally:
        gc.unfreeze()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_micro_batch_runs_without_host_syncs():
    """Packing, the forward on the kernels, the loss and the backward of a micro-batch never wait on
    the GPU (the learner's only syncs are the weight refresh's and the metrics' read)."""
    from minite.learner.logprobs import sequence_logprobs
    from minite.nn import refresh_quantized_weights

    model = tiny_model(recipe=TRITON, dtype=torch.bfloat16).cuda()
    refresh_quantized_weights(model)
    batch = random_batch(params=PARAMS, lengths=((40, 50), (30, 70), (60, 20)))
    loss_fn = partial(policy_loss, cfg=LossConfig())
    sequence_logprobs(model, batch)  # warm-up: kernel compilation, pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp = sequence_logprobs(model, batch)
        loss, _ = loss_fn(batch.to_rl_batch(lp))
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_norm", [1e-4, 1e4], ids=["clipped", "unclipped"])
def test_gpu_optimizer_step_queues_without_host_syncs(max_norm):
    """The update (master grads, norm, clip, fused AdamW, copy back) never waits on the GPU, and it
    equals torch's AdamW after torch's clip_grad_norm_."""
    from minite.learner import MasterAdamW

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(32, device="cuda"))]
    ref = [p.detach().float().clone().requires_grad_() for p in params]
    opt = MasterAdamW(params, lr=1e-2, max_grad_norm=max_norm)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0, fused=True)
    for step in range(2):  # the first one compiles and warms up
        for p, r in zip(params, ref):
            p.grad = torch.randn_like(p)
            r.grad = p.grad.float().clone()  # a copy: the clip below scales it in place
        norm = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if step else 0)
        try:
            out = opt.step_queued()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref_opt.step()
    assert out["skipped"].item() == 0 and out["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-5)
    assert out["clip_coef"].item() == pytest.approx(min(1.0, max_norm / norm.item()), rel=1e-5)
    for m, r in zip(opt.masters, ref):
        torch.testing.assert_close(m, r.detach())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_released_gradients_give_their_memory_back():
    """After a step with release_grads the allocated memory is smaller than with kept grads by at least
    the grads' bytes: 2 (bf16 grad) + 4 (fp32 master grad) a bf16 parameter."""

    allocated = []
    for release in (False, True):
        model = tiny_model(recipe=TRITON, dtype=torch.bfloat16).cuda()
        batch = _batch(model)
        learner = Learner(model, lr=1e-3, release_grads=release)
        learner.step(batch, partial(policy_loss, cfg=LossConfig()))
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
        del learner, model, batch
    grad_bytes = 6 * sum(p.numel() for p in tiny_model(dtype=torch.bfloat16).parameters())
    assert allocated[0] - allocated[1] >= grad_bytes, (allocated, grad_bytes)


EXIT_SCRIPT = """
from functools import partial
import torch
import minite.kernels.gemm  # Triton's extension objects alive, as in `minite train`
from minite.learner import Learner, SequenceBatch
from minite.models import Qwen3, tiny_qwen3
from minite.rl.losses import LossConfig, policy_loss
g = torch.Generator().manual_seed(0)
batch = SequenceBatch.from_samples([torch.randint(2, 100, (4,), generator=g)],
                                   [torch.randint(2, 100, (5,), generator=g)], advantages=torch.ones(1))
Learner(Qwen3(tiny_qwen3(), recipe="aligned"), lr=1e-3).step(batch, partial(policy_loss, cfg=LossConfig()))
print("stepped")
"""


def test_the_frozen_collector_is_released_at_exit():
    """Objects still frozen at exit are never freed; Triton 3.9's nanobind then prints hundreds of
    'leaked' lines after every `minite train` (the learner unfreezes at exit)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, env=env,
                         cwd=root, timeout=600)
    assert run.returncode == 0 and "stepped" in run.stdout, run.stderr[-2000:]
    assert "leaked" not in run.stderr, run.stderr[-2000:]


def test_learner_quantizes_the_weights_with_host_scales_at_construction():
    """The first step's backward takes the paths of the later ones (the NVFP4 linears' lean bf16 backward
    and the fused projections' need S_dec on the host, which the refresh brings)."""
    from minite.nn import Linear
    from minite.nn.linear import SegmentedLinear

    model = tiny_model()
    Learner(model)
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.recipe.fp4]
    qws = [q for m in linears for q in (m.quantized_weights() if isinstance(m, SegmentedLinear)
                                         else [m.quantized_weight()])]
    assert linears and all(q.host_global_scale() is not None for q in qws)


def test_a_skipped_step_leaves_moments_and_step_count_alone():
    """A non-finite gradient norm skips the update on the device (AdamW's found_inf): the masters,
    the moments and the step count stay as they were, and the next finite step runs normally."""
    from minite.learner import MasterAdamW

    p = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = MasterAdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    state = {k: v.clone() for k, v in opt.optimizer.state[opt.masters[0]].items()}
    before = opt.masters[0].detach().clone()
    p.grad = torch.full_like(p, float("inf"))
    out = opt.step_queued()
    assert torch.is_tensor(out["grad_norm"]) and out["skipped"].item() == 1 and out["clip_coef"].item() == 0
    assert torch.equal(opt.masters[0], before)
    for k, v in opt.optimizer.state[opt.masters[0]].items():
        assert torch.equal(v, state[k]), k
    p.grad = torch.randn_like(p)
    assert opt.step()["skipped"] == 0 and not torch.equal(opt.masters[0], before)


def test_learner_weights_micro_batches_by_the_losses_aggregations():
    """The learner knows the aggregations from `minite.loss_batch` (it does not import rl): the same
    names the losses average with; an unknown one is refused before any work."""
    from minite import loss_batch
    from minite.rl import losses

    assert loss_batch.AGGREGATIONS == losses.AGGREGATIONS
    model = tiny_model()
    with pytest.raises(ValueError, match="aggregation='sum' is not supported"):
        Learner(model).step(_batch(model), partial(policy_loss, cfg=LossConfig()), aggregation="sum")
