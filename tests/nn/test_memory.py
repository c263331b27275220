"""`minite.nn.memory`: the bytes a model holds by kind, counted on its tensors, equal the ones computed
from its shapes (tiny models, bf16)."""

import pytest
import torch

from benchmarks.e2e import bench_memory
from minite.kernels import available
from minite.learner.optimizer import MasterAdamW
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.nn.memory import memory_by_kind, memory_from_shapes
from minite.nn.refresh import refresh_quantized_weights
from minite.nn.sampler_weights import to_sampler_weights
from minite.recipe import get_recipe

CONFIGS = {"dense": tiny_qwen3, "moe": tiny_qwen3_moe}
COUNTED = ("bf16_parameters", "nvfp4_codes", "block_scales", "decode_layouts", "unscaled_copies")


def model(kind: str, recipe) -> Qwen3:
    m = Qwen3(CONFIGS[kind](), recipe).to(torch.bfloat16)
    m.init_weights(generator=torch.Generator().manual_seed(0))
    return m


@pytest.mark.skipif(not available(), reason="Triton kernels unavailable (the decode layouts)")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sampler_only_counts_equal_the_shapes(kind):
    m = to_sampler_weights(model(kind, get_recipe("aligned").with_execution(backend="triton")))
    got, want = memory_by_kind(m), memory_from_shapes(m, sampler_only=True)
    assert {k: got[k] for k in COUNTED} == {k: want[k] for k in COUNTED}
    assert got["unscaled_copies"] == 0 and got["decode_layouts"] > got["nvfp4_codes"] > 0
    assert 0 < got["global_scales"] <= want["global_scales"]  # views share storage


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("recipe", ["aligned", "te"])
def test_a_learners_counts_equal_the_shapes(kind, recipe):
    m = model(kind, get_recipe(recipe).with_execution(backend="ref"))
    refresh_quantized_weights(m)
    opt = MasterAdamW(m.parameters(), lr=0.0)
    for p, master in zip(opt.params, opt.masters):
        p.grad, master.grad = torch.zeros_like(p), torch.zeros_like(master)
    opt.optimizer.step()
    got, want = memory_by_kind(m, opt), memory_from_shapes(m, learner=True, decode=False)
    kinds = (*COUNTED, "fp32_masters", "optimizer_state", "gradients")
    assert {k: got[k] for k in kinds} == {k: want[k] for k in kinds}
    n = sum(p.numel() for p in m.parameters())
    assert got["unscaled_copies"] > 0 and got["fp32_masters"] == 4 * n and got["optimizer_state"] == 8 * n


def test_bench_memory_computed_rows_at_full_depth(tmp_path):
    """The computed table on the real shapes (meta device): the sampler-only MoE model at all 48 layers
    and what the colocated aligned model adds over bf16."""
    rows = bench_memory.main(["--computed", "--out", str(tmp_path / "m.json")])
    by = {(r["model"], r["deployment"]): r for r in rows}
    lean = by[("moe", "aligned sampler-only")]
    assert lean["layers"] == 48 and 30 < lean["sampler_own_weights_gb"] < 40  # 0.5625 + 0.625 B per weight
    assert by[("moe", "bf16")]["learner_weights_gb"] == pytest.approx(61.06, abs=0.01)
    assert by[("dense", "aligned")]["sampler_own_weights_gb"] == 0.0  # colocated: one model
    assert (tmp_path / "m.json").exists()


@pytest.mark.slow
def test_bench_memory_tiny_measures_every_deployment(tmp_path):
    rows = bench_memory.main(["--tiny", "--out", str(tmp_path / "m.json")])
    assert len(rows) == 8 and all(r["total_gb"] > 0 for r in rows)
