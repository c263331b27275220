"""Smoke test of the rollout benchmark's `--tiny` mode (CPU, tiny models, a few tokens)."""

import json

import pytest
import torch

from benchmarks.e2e import bench_rollout as bench


@pytest.mark.slow
def test_bench_rollout_tiny_writes_json(tmp_path):
    out = tmp_path / "rollout.json"
    bench.main(["--tiny", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert {"gpu", "date", "commit"} <= doc["env"].keys()
    rows = doc["rows"]
    assert {(r["model"], r["engine"], r["recipe"]) for r in rows} == {
        (m, e, r) for m in ("dense", "moe")
        for e, r in (("minite", "bf16"), ("minite", "aligned"), ("hf_generate", "bf16"))}
    for r in rows:
        assert r["gen_tokens"] == 3 * 2 * 6 and r["tokens_per_s"] > 0
        if r["engine"] == "hf_generate":
            assert r["hf_logit_max_abs_diff"] < 1e-4  # same weights reached transformers
        else:  # the time outside the decode steps (prefill) is part of the run's time
            assert 0 < r["outside_decode_s"] < r["seconds"]


def test_bench_rollout_sampler_only_runs_build_models_weights(tmp_path):
    """`--sampler-only`: the NVFP4 recipe samples on a model built layer by layer with build_model's
    weights (the same logits as build_model's under that recipe)."""
    config = bench.model_config("moe", bench.parse_args(["--tiny"]))
    full = bench.build_model(config, torch.device("cpu"), torch.float32, 0)
    full.set_recipe("aligned")
    lean = bench.build_sampler_only(config, "aligned", torch.device("cpu"), torch.float32, 0, "auto")
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(lean(ids), full(ids))
    args = ["--tiny", "--no-hf", "--models", "moe", "--recipes", "aligned"]
    full = bench.main(args + ["--out", str(tmp_path / "full.json")])
    lean = bench.main(args + ["--sampler-only", "--out", str(tmp_path / "lean.json")])
    assert [r["sampler_only"] for r in full + lean] == [False, True]
    assert lean[0]["gen_tokens"] == full[0]["gen_tokens"] == 3 * 2 * 6


def test_hugging_face_baseline_on_its_own_weights_runs_the_same_workload():
    """Where two copies of the weights do not fit (the full MoE), HF generate gets its own random
    weights of the shape: the same tokens generated, no mapping check."""
    args = bench.parse_args(["--tiny"])
    config = bench.model_config("moe", args)
    prompts = bench.workload_prompts(config, args.prompts, args)
    row = bench.run_hf(None, config, prompts, args, torch.device("cpu"), torch.float32)
    assert row["hf_weights"] == "own random" and row["hf_logit_max_abs_diff"] is None
    assert row["gen_tokens"] == args.prompts * args.samples * args.new_tokens


def test_decode_roofline_of_the_dense_shape():
    """512 sequences at the mean context of 128-token prompts and 512 new tokens: 22.6 GB of bf16 KV
    reads and 3.44 GB of weights; 4-bit weights and KV shrink the bytes, not the FLOPs."""
    from benchmarks.e2e.decode_roofline import decode_step
    from minite.models.presets import qwen3_1_7b

    bf16 = decode_step(qwen3_1_7b(), 512, 128 + 256.5)
    assert abs(bf16["kv_gb"] - 22.58) < 0.01 and abs(bf16["weight_gb"] - 3.44) < 0.01
    assert bf16["overlap_ms"] <= bf16["roofline_ms"] == pytest.approx(
        bf16["gemm_roofline_ms"] + bf16["attention_roofline_ms"] + bf16["logits_roofline_ms"])
    fp4 = decode_step(qwen3_1_7b(), 512, 128 + 256.5, "nvfp4", "nvfp4")
    assert fp4["tflop"] == bf16["tflop"] and fp4["kv_gb"] < bf16["kv_gb"] / 3 < fp4["kv_gb"] * 1.2
    assert fp4["roofline_ms"] < bf16["roofline_ms"]


def test_warm_up_reaches_every_table_width_widest_first():
    """The warm-up's runs decode at every block-table width bucket of the timed run, the widest first
    (the decode graphs' buffers are sized by the first run; a wider later run would drop them)."""
    from minite.sampler.graphs import bucket_width

    args = bench.parse_args(["--prompt-len", "20", "--new-tokens", "60", "--samples", "2"])
    calls = []

    class Recorder:
        block_size = 16

        def generate(self, prompts, params):
            calls.append((len(prompts), {len(p) for p in prompts}, params.n, params.max_tokens))

    bench.warm_up(Recorder(), bench.model_config("dense", bench.parse_args(["--tiny"])), 3, args)
    assert all(n == 3 and s == 2 for n, _, s, _ in calls)  # the timed run's rows
    lengths = [next(iter(ls)) for _, ls, _, _ in calls]
    assert lengths == sorted(lengths, reverse=True)
    widths = {bucket_width(-(-(length + k) // 16)) for length in lengths for k in range(1, calls[0][3] + 1)}
    timed = {bucket_width(-(-c // 16)) for c in range(21, 81)}
    assert timed <= widths
    assert bucket_width(-(-(lengths[0] + calls[0][3]) // 16)) == max(timed)  # buffers sized to the run


def test_sweep_rollout_batch_tiny(tmp_path):
    """The batch-size sweep on tiny models: a row per recipe and batch, the ratio to bf16 at the same
    batch, the JSON's environment and the plot (also redrawn from the JSON)."""
    from benchmarks.e2e import sweep_rollout_batch as sweep

    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    # --tiny: 2 samples per prompt, 6 new tokens, prompts of 5
    sweep.main(["--tiny", "--model", "moe", "--recipes", "bf16,aligned", "--sequences", "2,4",
                "--out", str(out), "--plot", str(png)])
    doc = json.loads(out.read_text())
    assert {"gpu", "date", "commit"} <= doc["env"].keys()
    rows = doc["rows"]
    assert [(r["recipe"], r["sequences"]) for r in rows] == [("bf16", 2), ("bf16", 4), ("aligned", 2),
                                                             ("aligned", 4)]
    assert all(r["gen_tokens"] == r["sequences"] * 6 and r["vs_bf16"] > 0 for r in rows)
    assert [r["vs_bf16"] for r in rows[:2]] == [1.0, 1.0]
    assert png.stat().st_size > 0
    png.unlink()
    sweep.main(["--plot-from", str(out), "--plot", str(png)])
    assert png.stat().st_size > 0
    with pytest.raises(SystemExit, match="multiples"):
        sweep.main(["--tiny", "--sequences", "3"])
