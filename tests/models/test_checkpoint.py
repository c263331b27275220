"""Hugging Face checkpoint round trips and the errors bad checkpoints give."""

import json

import pytest
import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import minite.models.checkpoint as checkpoint
from minite.files import WriteError
from minite.models import CheckpointError, UnsupportedConfigError, load_pretrained, save_pretrained
from minite.models.config import tiny_qwen3, tiny_qwen3_moe
from tests.models.hf_helpers import random_hf_model

CASES = {
    "dense": (tiny_qwen3(), "5GB"),
    "dense_tied_sharded": (tiny_qwen3(tie_word_embeddings=True), 20_000),
    "moe": (tiny_qwen3_moe(), "5GB"),
    "moe_sharded": (tiny_qwen3_moe(decoder_sparse_step=2), "40KB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_transformers_round_trip_is_identical(case, tmp_path):
    config, shard_size = CASES[case]
    ref = random_hf_model(config)
    ref.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", recipe="bf16", dtype=torch.float32)
    save_pretrained(ours, tmp_path / "ours", max_shard_size=shard_size)
    sharded = (tmp_path / "ours" / checkpoint.INDEX).exists()
    assert sharded == ("sharded" in case)
    cls = type(ref)
    back = cls.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    expected, got = ref.state_dict(), back.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_ours_reloads_bitwise_in_bf16(tmp_path):
    ref = random_hf_model(tiny_qwen3_moe())
    ref.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf", recipe="aligned", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and p.requires_grad for p in ours.parameters())
    save_pretrained(ours, tmp_path / "ours", max_shard_size="30KiB")
    again = load_pretrained(tmp_path / "ours", recipe="aligned")
    assert again.recipe.name == "aligned"
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert b.dtype == torch.bfloat16 and torch.equal(a, b), name
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert transformers.AutoConfig.from_pretrained(tmp_path / "ours").num_experts == config["num_experts"]


@pytest.fixture
def hf_dir(tmp_path):
    random_hf_model(tiny_qwen3_moe()).save_pretrained(tmp_path)
    return tmp_path


def _edit_tensors(path, edit):
    file = path / checkpoint.SINGLE
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(hf_dir):
    _edit_tensors(hf_dir, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    name = r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"
    with pytest.raises(CheckpointError, match="lacks tensor " + name):
        load_pretrained(hf_dir)


def test_extra_tensor_is_named(hf_dir):
    _edit_tensors(hf_dir, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_pretrained(hf_dir)


def test_wrong_shape_is_named(hf_dir):
    _edit_tensors(hf_dir, lambda t: t.update({"model.layers.0.self_attn.k_norm.weight": torch.ones(8)}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight has shape \[8\]"):
        load_pretrained(hf_dir)


def test_unsupported_architecture_is_named(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(config | {"architectures": ["MixtralForCausalLM"]}))
    with pytest.raises(UnsupportedConfigError, match="MixtralForCausalLM"):
        load_pretrained(hf_dir)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_pretrained(tmp_path)
    model = load_pretrained_tiny(tmp_path)
    save_pretrained(model, tmp_path / "sharded", max_shard_size=10_000)
    index = json.loads((tmp_path / "sharded" / checkpoint.INDEX).read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "sharded" / second).unlink()
    with pytest.raises(CheckpointError, match=second):
        load_pretrained(tmp_path / "sharded")
    (tmp_path / "sharded" / checkpoint.INDEX).unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_pretrained(tmp_path / "sharded")


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty"])
def test_corrupt_safetensors_is_named(hf_dir, damage):
    file = hf_dir / checkpoint.SINGLE
    data = file.read_bytes()
    file.write_bytes({"truncated": data[: len(data) // 2], "random bytes": bytes(range(256)) * 8,
                      "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=f"{file} is not a valid safetensors file .*truncated"):
        load_pretrained(hf_dir)


def test_corrupt_shard_is_named(tmp_path):
    save_pretrained(load_pretrained_tiny(tmp_path), tmp_path / "sharded", max_shard_size=10_000)
    index = json.loads((tmp_path / "sharded" / checkpoint.INDEX).read_text())
    shard = tmp_path / "sharded" / sorted(set(index["weight_map"].values()))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard} is not a valid safetensors file"):
        load_pretrained(tmp_path / "sharded")


@pytest.mark.parametrize("text,problem", [
    ('{"vocab_size": 128,', r"not valid JSON \(Expecting property name .* at line 1 column 20\)"),
    ("[1, 2]", "holds a JSON list, expected an object"),
    ('{"architectures": ["Qwen3ForCausalLM"], "rope_theta": "big"}', "lacks the required field"),
], ids=["cut", "list", "field"])
def test_corrupt_config_json_is_named(hf_dir, text, problem):
    (hf_dir / "config.json").write_text(text)
    with pytest.raises(ValueError, match=f"{hf_dir / 'config.json'}.*{problem}"):
        load_pretrained(hf_dir)
    with pytest.raises(ValueError, match=problem):
        checkpoint.read_config(hf_dir)


def test_corrupt_index_is_named(tmp_path):
    save_pretrained(load_pretrained_tiny(tmp_path), tmp_path / "sharded", max_shard_size=10_000)
    (tmp_path / "sharded" / checkpoint.INDEX).write_text('{"weight_map": {')
    with pytest.raises(CheckpointError, match=f"{checkpoint.INDEX} is not valid JSON"):
        load_pretrained(tmp_path / "sharded")


def test_tied_checkpoint_with_different_lm_head_is_rejected(tmp_path):
    random_hf_model(tiny_qwen3(tie_word_embeddings=True)).save_pretrained(tmp_path)
    _edit_tensors(tmp_path, lambda t: t.update({"lm_head.weight": torch.zeros(128, 64)}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_pretrained(tmp_path)


def test_save_is_atomic(tmp_path, monkeypatch):
    model = load_pretrained_tiny(tmp_path)
    target = tmp_path / "out"
    calls = []

    def crash_on_second_shard(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", crash_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(model, target, max_shard_size=10_000)
    assert not target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    monkeypatch.undo()
    save_pretrained(model, target)
    with pytest.raises(FileExistsError):
        save_pretrained(model, target)
    save_pretrained(model, target, max_shard_size=10_000, overwrite=True)
    assert (target / checkpoint.INDEX).exists() and not (target / checkpoint.SINGLE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_full_disk_while_saving_names_the_path_and_keeps_the_old_checkpoint(tmp_path, monkeypatch):
    model = load_pretrained_tiny(tmp_path)
    save_pretrained(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def full(tensors, filename, metadata=None):  # how safetensors reports an I/O error
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(WriteError, match=f"cannot write {tmp_path / 'out'}: no space left on the device; "
                                         "free space"):
        save_pretrained(model, tmp_path / "out", overwrite=True)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def load_pretrained_tiny(tmp_path):
    random_hf_model(tiny_qwen3()).save_pretrained(tmp_path / "src")
    return load_pretrained(tmp_path / "src", recipe="bf16", dtype=torch.float32)
