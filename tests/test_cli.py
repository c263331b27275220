import json

import pytest
import torch
from safetensors.torch import save_file

from minite.cli import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "quantize" in capsys.readouterr().out


def test_quantize_safetensors_json(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    w = torch.randn(32, 64)
    w[0, 0] = 1e7  # one saturating tile; the others underflow to scale 0
    save_file({"layer.weight": w.to(torch.bfloat16), "layer.bias": torch.randn(20),
               "steps": torch.tensor([3])}, str(path))
    assert main(["quantize", "--file", str(path), "--recipe", "te", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [t["name"] for t in report["tensors"]]
    assert names == ["layer.bias", "layer.weight"]  # integer tensors skipped, bias padded to 32
    weight = report["tensors"][1]
    assert report["spec"]["block"] == [16, 16] and weight["shape"] == [32, 64]
    assert weight["blocks_at_scale_448"] > 0 and weight["blocks_at_scale_0"] > 0.5
    assert abs(sum(weight["code_histogram"].values()) - 1) < 1e-9


def test_quantize_random_table_and_sqnr(capsys):
    assert main(["quantize", "--random", "64,64", "--recipe", "aligned"]) == 0
    out = capsys.readouterr().out
    assert "SQNR dB" in out and "random_gaussian" in out
    main(["quantize", "--random", "64,64", "--json"])
    sqnr = json.loads(capsys.readouterr().out)["tensors"][0]["sqnr_db"]
    assert 15 < sqnr < 25  # 4-bit with fp8 block scales on Gaussian data: ~20 dB


def test_quantize_bad_input_is_a_clear_error(capsys, tmp_path):
    assert main(["quantize", "--random", "4,x"]) == 2
    assert "expects a shape" in capsys.readouterr().err
    assert main(["quantize", "--file", str(tmp_path / "missing.safetensors")]) == 2


def test_quantize_json_lists_skipped_empty_tensors(tmp_path, capsys):
    path = tmp_path / "w.safetensors"
    save_file({"a.weight": torch.randn(16, 32), "b.weight": torch.zeros(4, 0)}, str(path))
    assert main(["quantize", "--file", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in report["tensors"]] == ["a.weight"]
    assert report["skipped"] == [{"name": "b.weight", "shape": [4, 0], "reason": "0 elements"}]
