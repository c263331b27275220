"""Report files from hand-built sections, the training-run report, and `minite diagnose` end to end."""

import json

import pytest

from minite.cli import main
from minite.diagnostics.report import write_report, write_training_report

PNG = b"\x89PNG\r\n\x1a\n"
SECTIONS = {
    "metrics": {"kl": 0.01, "k3_kl": 0.02},
    "localization": {"side_a": "te/packed", "side_b": "vllm/alone", "first_divergent": "layers.0.q_proj",
                     "ops": [{"op": "layers.0.input_layernorm", "layer": 0, "kind": "input_layernorm",
                              "rel_diff": 0.0},
                             {"op": "layers.0.q_proj", "layer": 0, "kind": "q_proj", "rel_diff": 0.1},
                             {"op": "layers.0.output", "layer": 0, "kind": "output", "rel_diff": 0.2},
                             {"op": "lm_head", "layer": None, "kind": "lm_head", "rel_diff": 0.3}]},
    "attribution": {"metric": "k3_kl", "initial": {"k3_kl": 0.02}, "residual": {"k3_kl": 0.0}, "rows": [
        {"knob": "weight_block", "status": "switched", "from": "16x16", "to": "1x16", "closed": 0.015,
         "closed_frac": 0.75, "alone_closed_frac": 0.7},
        {"knob": "scale_chain", "status": "switched", "from": "te/te", "to": "vllm/vllm", "closed": 0.005,
         "closed_frac": 0.25, "alone_closed_frac": 0.2},
        {"knob": "attention_kernel", "status": "not available", "reason": "one implementation"}]},
    "direction": {"share_amp_pos": 0.1, "share_amp_neg": 0.2, "share_contracting": 0.3, "share_neutral": 0.4,
                  "mass_amp_pos": 1.0, "mass_amp_neg": 2.0, "mass_contracting": 3.0, "mass_neutral": 0.0,
                  "imbalance": 2.0, "tau": 0.05, "tail_concentration": 1.0, "segment_len": 8,
                  "segment_profile": [{"segment": 0, "tokens": 8, "tail": 2, "amp_tail": 1,
                                       "mean_abs_gap": 0.1}]},
    "heatmap": [{"row": 0, "tokens": ["1", "+", "\n"], "gap": [0.1, -0.2, 0.0], "advantage": 1.0}],
}


def test_write_report_all_sections(tmp_path):
    paths = write_report(tmp_path, SECTIONS, deltas=[0.0, 1e-3, -0.2, 0.5])
    for name in ("delta_hist", "layer_divergence", "attribution_waterfall", "regions", "heatmap"):
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG
    assert json.loads(paths["json"].read_text())["attribution"]["rows"][0]["knob"] == "weight_block"
    html = paths["html"].read_text()
    assert html.count("data:image/png;base64,") == 5 and "not available" in html


def test_report_with_only_bitwise_equal_deltas(tmp_path):
    write_report(tmp_path, {"metrics": {"kl": 0.0}}, deltas=[0.0, 0.0])
    assert (tmp_path / "delta_hist.png").exists() and not (tmp_path / "regions.png").exists()


def test_training_report_curves(tmp_path):
    history = [{"step": s, "kl": 0.1 / (s + 1), "mismatch/k3_kl": 0.01 * s, "loss": 1.0} for s in range(5)]
    paths = write_training_report(tmp_path, history)
    assert (tmp_path / "curves.png").read_bytes()[:8] == PNG
    curves = json.loads(paths["json"].read_text())["curves"]
    assert curves["step"] == [0, 1, 2, 3, 4] and curves["k3_kl"][1] == 0.01 and "loss" not in curves


def _run_records(steps: int = 6, aligned: bool = False) -> list[dict]:
    """What a training run logs: warm-up, RL steps (an aligned pair logs exact zeros) and evaluations."""
    records = [{"kind": "warmup", "step": 1, "nll": 3.0}, {"kind": "eval", "step": 0, "eval/accuracy": 0.1,
                                                          "eval/sampled_reward": 0.05}]
    for s in range(1, steps + 1):
        gap = 0.0 if aligned else 1e-4 * s
        records.append({"kind": "rl", "step": s, "reward": 0.1 * s, "mismatch/kl": gap * (-1) ** s,
                        "mismatch/k3_kl": gap / 2, "mismatch/logprob_abs_diff_mean": gap,
                        "mismatch/logprob_abs_diff_max": 10 * gap, "mismatch/chi2_token": gap,
                        "mismatch/ess": 1 - gap, "triage/imbalance": 1.0,
                        "rollout/tokens_per_s": 300.0 + s, "learner/tokens_per_s": 5000.0 - s})
        if s % 3 == 0:
            records.append({"kind": "eval", "step": s, "eval/accuracy": 0.1 + 0.1 * s,
                            "eval/sampled_reward": 0.1 * s})
    return records


@pytest.mark.parametrize("aligned", [False, True], ids=["naive", "aligned"])
def test_run_report_shows_reward_accuracy_mismatch_throughput_and_summary(tmp_path, aligned):
    from minite.rl.run_logging import write_report as write_run_report

    records = _run_records(aligned=aligned)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_run_report(tmp_path, {"wall_seconds": 12.5})
    html = (tmp_path / "report.html").read_text()
    assert "<h2>summary</h2>" in html and "<td>reward_last</td><td>0.6</td>" in html
    assert "<td>eval_accuracy_last</td><td>0.7</td>" in html and "<td>wall_seconds</td><td>12.5</td>" in html
    assert "<h3>training.png</h3>" in html and "held-out split" in html and "tokens per second" in html
    assert "<h3>curves.png</h3>" in html and "drawn as |kl|" in html and "0..1 axis" in html
    assert html.count("data:image/png;base64,") == 2
    for name in ("report.png", "training.png", "curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG and (tmp_path / name).stat().st_size > 20_000
    training = json.loads((tmp_path / "report.json").read_text())["training"]
    assert training["eval_step"] == [0, 3, 6] and training["eval_accuracy"][-1] == pytest.approx(0.7)
    assert training["learner_tokens_per_s"][0] == 4999.0 and summary["learner_tokens_per_s_mean"] > 4990
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary file left


def test_curve_panels_use_readable_scales():
    import matplotlib.pyplot as plt

    from minite.diagnostics import report

    fig, axes = plt.subplots(1, 4)
    steps = [1, 2, 3]
    titles = [report._draw_curve(axes[0], "k3_kl", steps, [0.0, 1e-6, 1e-5]),
              report._draw_curve(axes[1], "kl", steps, [-1e-4, 2e-4, -3e-4]),
              report._draw_curve(axes[2], "ess", steps, [0.99999998, 1.0, 0.99999999]),
              report._draw_curve(axes[3], "logprob_abs_diff_max", steps, [0.0, 0.0, 0.0])]
    assert titles[0] == "k3_kl (log; 0 drawn at 1e-07)" and axes[0].get_yscale() == "log"
    assert titles[1] == "|kl| (log)" and axes[1].get_yscale() == "log"
    assert [tuple(line.get_ydata()) for line in axes[1].get_lines()] == [(1e-4, 2e-4, 3e-4), (1e-4, 3e-4)]
    assert titles[2].startswith("ess (0..1") and axes[2].get_ylim() == (0, 1.02)
    assert axes[3].get_yscale() == "log" and "bitwise equal" in axes[3].texts[0].get_text()
    plt.close(fig)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_diagnose_cli_writes_report(tmp_path, capsys, preset):
    out = tmp_path / "report"
    args = ["diagnose", "--preset", preset, "--out", str(out), "--n-prompts", "2", "--samples", "2",
            "--max-tokens", "6", "--warmup-steps", "2"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "first divergent op layers.0.q_proj" in text and "weight_block" in text
    for name in ("delta_hist", "layer_divergence", "attribution_waterfall", "regions", "heatmap"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["learner"] == "te/packed" and report["metrics"]["n_tokens"] > 0
    assert "base64" in (out / "report.html").read_text()


def test_diagnose_cli_prompts_file_aligned(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("1+2=\n3+4=\n")
    args = ["diagnose", "--preset", "tiny-qwen3", "--prompts", str(prompts), "--out", str(tmp_path / "r"),
            "--learner-recipe", "aligned", "--sampler-recipe", "aligned", "--samples", "2",
            "--max-tokens", "4", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["metrics"]["bitwise_equal_frac"] == 1 and report["metrics"]["k3_kl"] == 0
    assert report["localization"]["first_divergent"] is None and "direction" not in report


def test_diagnose_cli_attributes_a_gap_to_the_kv_cache(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("1+2=\n3+4=\n")
    args = ["diagnose", "--preset", "tiny-qwen3", "--prompts", str(prompts), "--out", str(tmp_path / "r"),
            "--learner-recipe", "aligned", "--sampler-recipe", "aligned", "--sampler-kv-cache", "fp8",
            "--sampler-engine", "forward", "--samples", "2", "--max-tokens", "4", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["knob"]: r for r in report["attribution"]["rows"]}
    assert rows["kv_cache"]["status"] == "switched" and rows["kv_cache"]["to"] == "fp8"
    assert report["attribution"]["residual"]["k3_kl"] == 0
