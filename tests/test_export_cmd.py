"""`minite export` from a Hugging Face directory, a run folder or a checkpoint; `minite quantize
--file` on what it wrote."""

import json

import pytest
import torch

from minite.cli import main
from minite.models import Qwen3, load_pretrained, save_pretrained
from minite.models.config import tiny_qwen3


@pytest.fixture
def hf_dir(tmp_path):
    model = Qwen3(tiny_qwen3(), "bf16")
    model.init_weights(0.05, torch.Generator().manual_seed(0))
    save_pretrained(model.to(torch.bfloat16), tmp_path / "hf")
    return tmp_path / "hf"


def test_export_an_hf_directory_and_load_it(hf_dir, tmp_path, capsys):
    out = tmp_path / "ct"
    assert main(["export", str(hf_dir), "--format", "compressed-tensors", "--recipe", "vllm",
                 "--fused-scale", "shared", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"  # calibrated
    source, loaded = load_pretrained(hf_dir, recipe="aligned"), load_pretrained(out, recipe="aligned")
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        assert (source(ids).float() - loaded(ids).float()).abs().max() < 1.0
    assert main(["export", str(hf_dir), "--format", "modelopt", "--out", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_export_takes_a_runs_latest_checkpoint_and_recipe(hf_dir, tmp_path, capsys):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000002")
    (step / "state.pt").write_bytes(b"")
    (hf_dir).rename(step / "model")
    (run / "config.toml").write_text('[recipe]\nname = "te"\noverrides = { fused_scale = "shared" }\n')
    for src in (run, step):
        out = tmp_path / f"mo-{src.name}"
        assert main(["export", str(src), "--format", "modelopt", "--out", str(out)]) == 0
        assert "recipe te (fused_scale=shared)" in capsys.readouterr().err
        assert json.loads((out / "minite_nvfp4.json").read_text())["weight_block"] == [16, 16]
    assert main(["export", str(tmp_path), "--format", "modelopt", "--out", str(tmp_path / "x")]) == 2
    assert "neither a Hugging Face model directory" in capsys.readouterr().err


def test_quantize_reports_a_quantized_checkpoint_as_stored(hf_dir, tmp_path, capsys):
    out = tmp_path / "mo"
    assert main(["export", str(hf_dir), "--format", "modelopt", "--out", str(out)]) == 0
    assert "warning: fused projections carry separate weight global scales" in capsys.readouterr().err
    assert main(["quantize", "--file", str(out / "model.safetensors"), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["tensors"]}
    q = rows["model.layers.0.self_attn.q_proj"]
    assert q["stored"] == "modelopt" and q["shape"] == [64, 64] and "sqnr_db" not in q
    assert not any(n.endswith(("weight_scale", "weight_scale_2", "input_scale")) for n in rows)
    assert "model.embed_tokens.weight" in rows and "sqnr_db" in rows["model.embed_tokens.weight"]
    assert main(["quantize", "--file", str(out / "model.safetensors")]) == 0
    assert "stored" in capsys.readouterr().out
