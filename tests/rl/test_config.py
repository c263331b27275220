"""Run config: presets, dotted overrides, errors that name the key, --dry-run."""

import tomllib
from pathlib import Path

import pytest

from minite.cli import main
from minite.config import ConfigError, TrainConfig, apply_overrides, build, load_config, parse_value, to_toml
from minite.rl.corrections import CorrectionConfig
from minite.rl.losses import LossConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_embedded_default_is_configs_tiny_cpu():
    assert load_config(CONFIGS / "tiny_cpu.toml") == load_config(None) == TrainConfig()


@pytest.mark.parametrize("name", ["tiny_cpu.toml", "gpu_arith.toml"])
def test_presets_load_and_round_trip(name):
    cfg = load_config(CONFIGS / name)
    assert build(TrainConfig, tomllib.loads(to_toml(cfg))) == cfg


def test_dotted_overrides_reach_nested_configs():
    cfg = load_config(None, ["--rl.lr=1e-6", "rl.correction.name=triage", "--rl.correction.triage.beta=1",
                             "--rl.loss.aggregation=seq_mean", "--task.args.operands=[2, 4]",
                             "--sampling.temperature=0.7"])
    assert cfg.rl.lr == 1e-6 and isinstance(cfg.rl.correction, CorrectionConfig)
    assert cfg.rl.correction.name == "triage" and cfg.rl.correction.triage.beta == 1.0
    assert cfg.rl.loss == LossConfig(aggregation="seq_mean")
    assert cfg.task.args["operands"] == [2, 4] and cfg.sampling.temperature == 0.7


def test_override_of_one_key_keeps_the_files_other_keys(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[model.config]\nhidden_size = 64\nnum_hidden_layers = 1\n")
    cfg = load_config(path, ["--model.config.hidden_size=32"])
    assert cfg.model.config == {"hidden_size": 32, "num_hidden_layers": 1}
    assert cfg.model.model_config().num_hidden_layers == 1


def test_override_values_are_toml_literals():
    assert parse_value("1e-6") == 1e-6 and parse_value("true") is True and parse_value("[1, 2]") == [1, 2]
    assert parse_value("triage") == "triage" and parse_value('"3"') == "3"
    assert apply_overrides({"a": {"b": 1}}, ["a.c=2"]) == {"a": {"b": 1, "c": 2}}


@pytest.mark.parametrize("override, names", [
    ("--rl.lrr=1", "rl.lrr"),
    ("--nope.x=1", "nope"),
    ("--rl.correction.triage.betta=1", "rl.correction.triage.betta"),
    ("--task.args.digitz=[1, 2]", "task.args"),
    ("--model.config.hiden_size=3", "model.config"),
])
def test_unknown_keys_are_errors_naming_the_key(override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("override, names", [
    ("--rl.lr=fast", "rl.lr"),
    ("--rl.n=1.5", "rl.n"),
    ("--logging.progress=1", "logging.progress"),
    ("--rl.lr=-1", "rl: lr"),
    ("--rl.loss.eps_low=2", "rl.loss: eps_low"),
    ("--rl.correction.name=magic", "rl.correction: name"),
    ("--rl.minibatches=3", "rl: minibatches"),
    ("--model.dtype=float8", "model: dtype"),
    ("--model.preset=huge", "model: preset"),
    ("--recipe.name=fp2", "recipe"),
    ("--task.args.ops=%", "task.args"),
    ("--rl=3", "rl"),
])
def test_bad_values_are_errors_naming_the_key(override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(None, [override])


def test_malformed_override_and_missing_file():
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["--rl.lr"])
    with pytest.raises(FileNotFoundError):
        load_config("no/such.toml")


def test_unknown_key_in_a_toml_file(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text("[rl]\nlr = 1e-4\nbatch = 3\n")
    with pytest.raises(ConfigError, match=r"rl\.batch"):
        load_config(path)


def test_dry_run_prints_the_resolved_config(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--dry-run", "--rl.lr=1e-6", "--rl.correction.name=triage"]) == 0
    out = capsys.readouterr().out
    cfg = build(TrainConfig, tomllib.loads(out))
    assert cfg == load_config(None, ["--rl.lr=1e-6", "--rl.correction.name=triage"])
    assert list(tmp_path.iterdir()) == []  # nothing was run


def test_cli_reports_config_errors(capsys):
    assert main(["train", "--dry-run", "--rl.lrr=1e-6"]) == 2
    assert "rl.lrr" in capsys.readouterr().err


def test_resume_needs_a_run_folder(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "config.toml" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path), "--config", "x.toml"]) == 2


def test_resume_reads_the_runs_config_with_overrides(tmp_path, capsys):
    (tmp_path / "config.toml").write_text(to_toml(load_config(None, ["--rl.steps=7"])))
    assert main(["train", "--resume", str(tmp_path), "--dry-run", "--rl.lr=1e-5"]) == 0
    cfg = build(TrainConfig, tomllib.loads(capsys.readouterr().out))
    assert cfg.rl.steps == 7 and cfg.rl.lr == 1e-5


def test_a_model_path_gets_the_pretrained_defaults_unless_set(tmp_path):
    from minite.config import PRETRAINED_DEFAULTS, char_defaults_in_use

    cfg = load_config(None, ["--model.path=some/dir"])
    assert (cfg.warmup.steps, cfg.rl.lr, cfg.sampling.max_tokens) == (0, 1e-6, 1024)
    assert cfg.model.tokenizer_source() == "some/dir" and not char_defaults_in_use(cfg)
    cfg = load_config(None, ["--model.path=some/dir", "--rl.lr=3e-6", "--warmup.steps=5"])
    assert (cfg.rl.lr, cfg.warmup.steps, cfg.warmup.lr) == (3e-6, 5, PRETRAINED_DEFAULTS["warmup.lr"])
    preset = tmp_path / "p.toml"
    preset.write_text('[model]\npath = "some/dir"\n[sampling]\nmax_tokens = 64\n')
    assert load_config(preset).sampling.max_tokens == 64
    # a resumed run reads its resolved config.toml: the same values
    assert load_config(_written(tmp_path, cfg)) == cfg
    # the char defaults stay for a preset, and are named when a real tokenizer meets them
    cfg = load_config(None, ["--model.tokenizer=some/dir"])
    assert cfg.rl.lr == 1e-4 and char_defaults_in_use(cfg) == ["warmup.steps = 150", "warmup.lr = 0.003",
                                                              "rl.lr = 0.0001", "sampling.max_tokens = 4"]


def _written(tmp_path, cfg):
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    return path


def test_overrides_as_two_arguments(capsys):
    args = ["--rl.steps", "3", "--sampling.temperature", "0.5", "--rl.lr=2e-4"]
    assert main(["train", "--dry-run", *args]) == 0
    cfg = tomllib.loads(capsys.readouterr().out)
    assert (cfg["rl"]["steps"], cfg["rl"]["lr"], cfg["sampling"]["temperature"]) == (3, 2e-4, 0.5)
    with pytest.raises(SystemExit):
        main(["train", "--dry-run", "--rl.steps"])
    assert "override --rl.steps needs a value" in capsys.readouterr().err
