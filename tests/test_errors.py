"""Bad input through `minite.cli.main`, one case per row: a single `minite <command>: error:` line
naming the file, tensor or value (no traceback), exit status 2, and every file that existed before
left exactly as it was."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minite.cli import main
from minite.files import WriteError
from minite.models import save_pretrained
from minite.models.presets import model_preset
from minite.rl.run_logging import METRICS_FILE, MetricsLog, MetricsWarning, read_metrics, write_report

FAST_DIAGNOSE = ["diagnose", "--preset", "tiny-qwen3", "--layers", "1", "--n-prompts", "1", "--samples", "2",
                 "--max-tokens", "2", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A valid tiny Hugging Face model folder; cases copy it and break one file."""
    from minite.models import Qwen3

    path = tmp_path_factory.mktemp("hf") / "model"
    model = Qwen3(model_preset("tiny-qwen3", 1), recipe="bf16")
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(0))
    save_pretrained(model, path)
    return path


def _copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _setup(case: str, tmp: Path, model_dir: Path) -> list[str]:
    """Build the bad input of `case` under `tmp`; returns the command line's arguments."""
    if case == "quantize-truncated":
        save_file({"w": torch.randn(32, 32)}, str(tmp / "w.safetensors"))
        return ["quantize", "--file", str(_truncated(tmp / "w.safetensors"))]
    if case == "quantize-random-bytes":
        (tmp / "w.safetensors").write_bytes(os.urandom(4096))
        return ["quantize", "--file", str(tmp / "w.safetensors")]
    if case == "quantize-empty-tensor":
        save_file({"empty.weight": torch.zeros(0, 16)}, str(tmp / "w.safetensors"))
        return ["quantize", "--file", str(tmp / "w.safetensors")]
    if case == "quantize-bad-shape":
        return ["quantize", "--random", "0,16"]
    if case == "diagnose-model-truncated":
        model = _copy_model(model_dir, tmp / "model")
        _truncated(model / "model.safetensors")
        return FAST_DIAGNOSE[:1] + ["--model", str(model), "--out", str(tmp / "r")]
    if case.startswith("agreement-model-"):
        model = _copy_model(model_dir, tmp / "model")
        if case.endswith("truncated"):
            _truncated(model / "model.safetensors")
        else:
            (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"], "vocab_size": 12,')
        return ["agreement", "--model", str(model), "--device", "cpu"]
    if case == "agreement-cuda":
        return ["agreement", "--preset", "tiny-qwen3", "--device", "cuda"]
    if case == "agreement-bad-device":
        return ["agreement", "--preset", "tiny-qwen3", "--device", "gpu0"]
    if case == "diagnose-cuda":
        return FAST_DIAGNOSE + ["--device", "cuda", "--out", str(tmp / "r")]
    if case == "diagnose-out-is-a-file":
        (tmp / "taken").write_text("an earlier result\n")
        return FAST_DIAGNOSE + ["--out", str(tmp / "taken")]
    if case == "diagnose-temperature-0":
        return FAST_DIAGNOSE + ["--temperature", "0", "--out", str(tmp / "r")]
    if case == "diagnose-temperature-negative":
        return FAST_DIAGNOSE + ["--temperature", "-1", "--out", str(tmp / "r")]
    if case == "diagnose-prompts-missing":
        return FAST_DIAGNOSE + ["--prompts", str(tmp / "none.txt"), "--out", str(tmp / "r")]
    if case == "diagnose-prompts-bad-jsonl":
        (tmp / "p.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": 3+}\n')
        return FAST_DIAGNOSE + ["--prompts", str(tmp / "p.jsonl"), "--out", str(tmp / "r")]
    if case.startswith("eval-"):
        (tmp / "d.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n')
    if case == "eval-model-missing":
        return ["eval", "--model", str(tmp / "none"), "--data", str(tmp / "d.jsonl")]
    if case == "eval-no-tokenizer":  # a folder with weights only: AutoTokenizer would invent one
        return ["eval", "--model", str(model_dir), "--data", str(tmp / "d.jsonl")]
    if case == "eval-data-missing":
        return ["eval", "--model", str(tmp / "none"), "--data", str(tmp / "none.jsonl")]
    if case == "eval-bad-reward":
        return ["eval", "--model", str(model_dir), "--data", str(tmp / "d.jsonl"), "--reward", "close"]
    if case == "eval-no-answer-column":
        (tmp / "d.jsonl").write_text('{"question": "1+1?", "result": "2"}\n')
        return ["eval", "--model", str(model_dir), "--data", str(tmp / "d.jsonl")]
    raise AssertionError(case)


# case, expected exit status, fragments the error line must contain
CASES = [
    ("quantize-truncated", 2, ["w.safetensors", "is not a valid safetensors file", "re-download"]),
    ("quantize-random-bytes", 2, ["w.safetensors", "is not a valid safetensors file"]),
    ("quantize-empty-tensor", 2, ["empty.weight (shape 0x16)", "is empty"]),
    ("quantize-bad-shape", 2, ["--random", "positive sizes", "'0,16'"]),
    ("agreement-model-truncated", 2, ["model.safetensors", "is not a valid safetensors file"]),
    ("agreement-model-config", 2, ["config.json is not valid JSON", "line 1 column"]),
    ("diagnose-model-truncated", 2, ["model.safetensors", "is not a valid safetensors file"]),
    ("agreement-cuda", 2, ["--device='cuda'", "CUDA is not available here", "use --device=cpu"]),
    ("agreement-bad-device", 2, ["--device='gpu0' is not a device", "cpu or cuda"]),
    ("diagnose-cuda", 2, ["--device='cuda'", "CUDA is not available here"]),
    ("diagnose-out-is-a-file", 2, ["--out", "taken is a file, not a folder"]),
    ("diagnose-temperature-0", 2, ["--temperature 0", "greedy (temperature 0) has one-hot distributions",
                                   "use temperature > 0"]),
    ("diagnose-temperature-negative", 2, ["--temperature -1", "use temperature > 0"]),
    ("diagnose-prompts-missing", 2, ["--prompts", "none.txt does not exist"]),
    ("diagnose-prompts-bad-jsonl", 2, ["p.jsonl prompt 2 is not valid JSON"]),
    ("eval-model-missing", 2, ["cannot load a tokenizer from", "none", "no such directory"]),
    ("eval-no-tokenizer", 2, ["holds no tokenizer", "model.tokenizer"]),
    ("eval-data-missing", 2, ["task file not found", "none.jsonl"]),
    ("eval-bad-reward", 2, ["--reward 'close'", "exact, math_verify or module:function"]),
    ("eval-no-answer-column", 2, ["d.jsonl", "no answer column", "--answer-key"]),
]
ARGPARSE_CASES = [  # refused by argparse: its usage line, then the one error line naming the flag
    ("agreement --num-prompts 0", "argument --num-prompts: must be at least 1, got 0"),
    ("agreement --n -2", "argument --n: must be at least 1, got -2"),
    ("agreement --max-tokens 0", "argument --max-tokens: must be at least 1, got 0"),
    ("agreement --prompt-len x", "argument --prompt-len: expected an integer, got 'x'"),
    ("diagnose --n-prompts 0", "argument --n-prompts: must be at least 1, got 0"),
    ("diagnose --samples 0", "argument --samples: must be at least 1, got 0"),
    ("diagnose --max-tokens 0", "argument --max-tokens: must be at least 1, got 0"),
    ("diagnose --warmup-steps -1", "argument --warmup-steps: must be at least 0, got -1"),
    ("eval --model m --data d --n -1", "argument --n: must be at least 0, got -1"),
    ("train --rl.steps", "override --rl.steps needs a value"),
]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_one_error_line(err: str, command: str, fragments: list[str]) -> None:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and lines[0].startswith(f"minite {command}: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(autouse=True)
def no_cuda(monkeypatch):
    """Every case runs as on a machine without a GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("case,status,fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(case, status, fragments, tmp_path, model_dir, capsys):
    argv = _setup(case, tmp_path, model_dir)
    before = snapshot(tmp_path)
    assert main(argv) == status
    out, err = capsys.readouterr()
    assert_one_error_line(err, argv[0], fragments)
    assert snapshot(tmp_path) == before  # nothing written over, nothing half-written left behind


@pytest.mark.parametrize("line,fragment", ARGPARSE_CASES, ids=[line for line, _ in ARGPARSE_CASES])
def test_bad_count_is_refused_by_argparse(line, fragment, capsys):
    command, *flags = line.split()
    argv = [command, "--preset", "tiny-qwen3", *flags]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert_one_error_line(capsys.readouterr().err, argv[0], [fragment])


def _fail_writes(monkeypatch, code: int) -> None:
    def fail(path, data):
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr("minite.files._write_file", fail)


@pytest.mark.parametrize("code,fragment", [(errno.ENOSPC, "no space left on the device; free space"),
                                           (errno.EACCES, "permission denied; check the permissions")],
                         ids=["full-disk", "permission-denied"])
def test_diagnose_write_failure_names_the_path_and_keeps_the_old_report(code, fragment, tmp_path, capsys,
                                                                        monkeypatch):
    out = tmp_path / "r"
    assert main(FAST_DIAGNOSE + ["--out", str(out)]) == 0
    before = snapshot(tmp_path)
    capsys.readouterr()
    _fail_writes(monkeypatch, code)
    assert main(FAST_DIAGNOSE + ["--out", str(out)]) == 2
    assert_one_error_line(capsys.readouterr().err, "diagnose", [f"cannot write {out}", fragment])
    assert snapshot(tmp_path) == before  # no temporary files left, every earlier file intact


def test_diagnose_unwritable_out_is_refused_before_compute(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("minite.files.os.access", lambda path, mode: False)
    monkeypatch.setattr("minite.commands.diagnose_cmd._model", lambda args: pytest.fail("computed"))
    assert main(FAST_DIAGNOSE + ["--out", str(tmp_path / "r")]) == 2
    assert_one_error_line(capsys.readouterr().err, "diagnose", ["permission denied"])
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_diagnose_into_a_read_only_folder(tmp_path, capsys):
    tmp_path.chmod(0o500)
    try:
        assert main(FAST_DIAGNOSE + ["--out", str(tmp_path / "r")]) == 2
    finally:
        tmp_path.chmod(0o700)
    assert_one_error_line(capsys.readouterr().err, "diagnose", ["permission denied"])


@pytest.mark.parametrize("error,fragment", [
    (PermissionError(errno.EACCES, "Permission denied", "/data/w.safetensors"),
     "/data/w.safetensors: permission denied; check the permissions"),
    (OSError(errno.ENOSPC, "No space left on device", "/data/out"),
     "/data/out: no space left on the device; free space"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x"),
     "/data/x: no such file or directory"),
], ids=["EACCES", "ENOSPC", "ENOENT"])
def test_any_os_error_is_one_line(error, fragment, monkeypatch, capsys):
    def run(args):
        raise error

    monkeypatch.setattr("minite.commands.quantize_cmd.run", run)
    assert main(["quantize", "--random", "16,16"]) == 2
    assert_one_error_line(capsys.readouterr().err, "quantize", [fragment])


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    def run(args):
        raise KeyboardInterrupt

    monkeypatch.setattr("minite.commands.quantize_cmd.run", run)
    assert main(["quantize", "--random", "16,16"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip() == "minite quantize: interrupted"


def test_quantize_skips_an_empty_tensor_by_name(tmp_path, capsys):
    save_file({"empty.weight": torch.zeros(0, 16), "w": torch.randn(16, 32)}, str(tmp_path / "w.safetensors"))
    assert main(["quantize", "--file", str(tmp_path / "w.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "empty.weight" in out and "skipped: 0 elements" in out and "SQNR" in out


RECORDS = [{"kind": "warmup", "step": 1, "nll": 2.0}, {"kind": "rl", "step": 1, "reward": 0.5},
           {"kind": "eval", "step": 1, "eval/accuracy": 0.25}, {"kind": "rl", "step": 2, "reward": 0.75}]


def _metrics_file(tmp_path: Path, tail: str = "") -> Path:
    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + tail)
    return path


def test_half_written_last_metrics_line_is_dropped_with_a_warning(tmp_path):
    path = _metrics_file(tmp_path, '{"kind": "rl", "step": 3, "rew')  # a crash in the middle of an append
    with pytest.warns(MetricsWarning, match=rf"{METRICS_FILE} line 5 is half-written"):
        assert read_metrics(path) == RECORDS
    with pytest.warns(MetricsWarning):
        MetricsLog(tmp_path, tensorboard=False).truncate_after(1)  # what a resume does
    assert read_metrics(path) == RECORDS[:3]  # the partial line is gone, the file parses again


def test_any_other_bad_metrics_line_names_the_file_and_line(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"kind": "rl", "step": 1}\nnot json\n{"kind": "rl", "step": 2}\n')
    before = path.read_bytes()
    with pytest.raises(ValueError, match=rf"{METRICS_FILE} line 2 is not valid JSON"):
        MetricsLog(tmp_path, tensorboard=False).truncate_after(1)
    assert path.read_bytes() == before  # a resume refuses; it does not rewrite the log
    path.write_text('{"kind": "rl", "step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 holds a JSON list, expected an object"):
        read_metrics(path)
    path.write_text('{"kind": "rl", "step": 1}\n{"kind": "rl", "st\n')  # cut, then a newline: not a crash
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_metrics(path)


def test_cli_prints_a_metrics_warning_as_one_line(tmp_path, monkeypatch, capsys):
    def run(args):
        read_metrics(_metrics_file(tmp_path, '{"kind'))
        return 0

    monkeypatch.setattr("minite.commands.quantize_cmd.run", run)
    assert main(["quantize", "--random", "16,16"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("minite quantize: warning: ") and "half-written" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("code,fragment", [(errno.ENOSPC, "free space"), (errno.EACCES, "permissions")],
                         ids=["full-disk", "permission-denied"])
def test_run_report_write_failure_names_the_path_and_keeps_earlier_files(code, fragment, tmp_path,
                                                                         monkeypatch):
    _metrics_file(tmp_path)
    write_report(tmp_path, {"wall_seconds": 1.0})
    before = snapshot(tmp_path)
    _fail_writes(monkeypatch, code)
    with pytest.raises(WriteError, match=rf"cannot write {tmp_path}/\S+: .*{fragment}"):
        write_report(tmp_path, {"wall_seconds": 2.0})
    assert snapshot(tmp_path) == before


def test_metrics_append_failure_names_the_file(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("minite.files.open", full, raising=False)
    with pytest.raises(WriteError, match=rf"cannot write {tmp_path}/{METRICS_FILE}: no space left"):
        MetricsLog(tmp_path, tensorboard=False).log({"kind": "rl", "step": 1})


TINY_TRAIN = ["--model.config.hidden_size=32", "--model.config.intermediate_size=64",
              "--model.config.head_dim=16", "--model.config.num_hidden_layers=1", "--rl.prompts=2",
              "--rl.n=2", "--sampling.max_tokens=2", "--warmup.steps=1", "--warmup.batch_size=4",
              "--eval.size=4", "--eval.every=0", "--logging.progress=false", "--logging.tensorboard=false",
              "--threads=0", "--checkpoint.every=1"]


def test_gpu_preset_without_cuda_is_refused_before_building(tmp_path, capsys):
    argv = ["train", "--config", "configs/gpu_arith.toml", f"--run_dir={tmp_path / 'run'}"]
    assert main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, "train",
                          ["--model.device='cuda'", "CUDA is not available here", "use --model.device=cpu"])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A two-step tiny run with a checkpoint at every step; cases copy it."""
    run = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", *TINY_TRAIN, "--rl.steps=2", f"--run_dir={run}"]) == 0
    return run


def _resume_copy(run: Path, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of `run` and the command line that resumes it for one more step."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy, ["train", "--resume", str(copy), "--rl.steps=3"]


def test_resume_with_a_bad_metrics_line_names_the_file_and_line(finished_run, tmp_path, capsys):
    run, argv = _resume_copy(finished_run, tmp_path)
    lines = (run / METRICS_FILE).read_text().splitlines(keepends=True)
    (run / METRICS_FILE).write_text("".join(lines[:1] + ["{not json\n"] + lines[1:]))
    before = snapshot(run)
    capsys.readouterr()
    assert main(argv) == 2
    assert_one_error_line(capsys.readouterr().err, "train",
                          [f"{run / METRICS_FILE} line 2 is not valid JSON"])
    assert snapshot(run) == before


def test_resume_after_a_half_written_metrics_line_warns_and_continues(finished_run, tmp_path, capsys):
    run, argv = _resume_copy(finished_run, tmp_path)
    with open(run / METRICS_FILE, "a") as f:
        f.write('{"kind": "rl", "step": 3, "rew')
    capsys.readouterr()
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"minite train: warning: {run / METRICS_FILE} line" in err and "half-written" in err
    steps = [r["step"] for r in read_metrics(run / METRICS_FILE) if r["kind"] == "rl"]
    assert steps == [1, 2, 3]
