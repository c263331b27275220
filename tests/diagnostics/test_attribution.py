"""Attribution on a tiny model: the perturbed knob gets the credit, the readings add up, nothing is faked."""

import pytest
import torch

from minite import kernels
from minite.diagnostics.attribution import KNOBS, attribute, format_table
from minite.diagnostics.localize import Sequences, Side
from minite.models import Qwen3, tiny_qwen3
from minite.recipe import QuantSpec, get_recipe


@pytest.fixture(scope="module")
def model_and_seqs():
    model = Qwen3(tiny_qwen3(), recipe="aligned")
    model.init_weights(std=0.1, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, 128, (t,), generator=g).tolist() for t in (12, 9, 14, 10)]
    seqs = Sequences(tokens, [3, 2, 4, 3])
    return model.to(torch.bfloat16), seqs


def _rows(att):
    return {r["knob"]: r for r in att.rows}


def test_activation_scale_policy_gets_the_credit(model_and_seqs):
    model, seqs = model_and_seqs
    # Learner differs from the aligned sampler in its activation scale (per-tensor, batch-dependent)
    # and in its epilogue (TE's alpha: a last-ulp effect at most).
    learner = get_recipe("aligned").replace(activation=QuantSpec(scaling="tensor"), epilogue="alpha")
    att = attribute(model, Side(learner), Side("aligned"), seqs)
    rows = _rows(att)
    assert att.initial["k3_kl"] > 0 and att.residual["k3_kl"] == 0
    assert att.residual["bitwise_equal_frac"] == 1
    switched = [r for r in att.rows if r["status"] == "switched"]
    assert {r["knob"] for r in switched} == {"activation_scale", "gemm_epilogue"}
    best = max(switched, key=lambda r: r["closed_frac"])
    assert best["knob"] == "activation_scale" and best["from"] == "tensor" and best["to"] == "row"
    assert best["alone_closed_frac"] > 0.9
    assert sum(r["closed"] for r in switched) + att.residual["k3_kl"] == pytest.approx(att.initial["k3_kl"])
    assert rows["weight_block"]["status"] == "same" and rows["batch_composition"]["status"] == "same"


def test_unavailable_knobs_are_listed_not_faked(model_and_seqs):
    model, seqs = model_and_seqs
    att = attribute(model, Side("aligned", "packed"), Side("aligned", "alone"), seqs)
    rows = _rows(att)
    assert [r["knob"] for r in att.rows] == [k.name for k in KNOBS]
    for name in ("attention_kernel", "sampler_path"):
        assert rows[name]["status"] == "not available" and rows[name]["reason"]
    if not kernels.available():  # other test modules may have turned the Triton interpreter on
        assert rows["gemm_kernel"]["status"] == "not available"
    # aligned is batch invariant: switching the batch composition closes nothing, the gap is 0
    assert rows["batch_composition"]["status"] == "switched" and rows["batch_composition"]["closed"] == 0
    assert att.initial["k3_kl"] == 0 and att.initial["bitwise_equal_frac"] == 1
    table = format_table(att)
    assert "not available" in table and "batch_composition" in table


@pytest.mark.slow
def test_naive_te_vllm_closes_fully(model_and_seqs):
    model, seqs = model_and_seqs
    att = attribute(model, Side("te", "packed"), Side("vllm", "alone"), seqs, metric="logprob_abs_diff_mean")
    rows = _rows(att)
    assert att.initial["logprob_abs_diff_mean"] > 0 and att.residual["logprob_abs_diff_mean"] == 0
    assert {"activation_scale", "weight_block", "scale_chain", "batch_composition"} <= {
        r["knob"] for r in att.rows if r["status"] == "switched"}
    assert rows["gemm_epilogue"]["status"] == "same"  # both use TE's alpha


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_quantized_kv_cache_gets_the_credit_for_its_gap(model_and_seqs, fmt):
    model, seqs = model_and_seqs
    att = attribute(model, Side("aligned"), Side(get_recipe("aligned", kv_cache=fmt)), seqs)
    rows = _rows(att)
    assert att.initial["k3_kl"] > 0 and att.residual["k3_kl"] == 0
    assert [r["knob"] for r in att.rows if r["status"] == "switched"] == ["kv_cache"]
    kv = rows["kv_cache"]
    assert kv["from"] == "bf16" and kv["to"] == fmt and kv["closed_frac"] == pytest.approx(1.0)
