"""NVFP4 checkpoints out and in: the formats' own readers see our quantization bit for bit, and an
exported directory imports to the exporting model's logits.

compressed-tensors (a `dev` extra) is the reader of its own format and, through its ModelOpt
converter, of ModelOpt's layout; ModelOpt's layout is also checked against its published spec
(docs/export.md names the sources).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minite.models import CheckpointError, Qwen3, load_pretrained
from minite.models.config import tiny_qwen3, tiny_qwen3_moe
from minite.models.export_nvfp4 import export_nvfp4
from minite.models.nvfp4_formats import SIDECAR
from minite.models.nvfp4_layout import checkpoint_modules
from minite.nn.calibrate import calibrate
from minite.nvfp4 import unpack
from minite.recipe import get_recipe
from minite.ref.nvfp4 import global_scales

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4, QuantizationScheme  # noqa: E402

CONFIGS = {"dense": tiny_qwen3, "moe": tiny_qwen3_moe}
FORMATS = ("modelopt", "compressed-tensors")


def _model(kind: str, recipe: str, fused_scale: str = "shared") -> Qwen3:
    model = Qwen3(CONFIGS[kind](), get_recipe(recipe, fused_scale=fused_scale))
    model.init_weights(0.05, torch.Generator().manual_seed(0))
    model = model.to(torch.bfloat16)
    if model.recipe.activation.scaling == "static":
        with calibrate(model):
            model(torch.randint(2, 128, (4, 16), generator=torch.Generator().manual_seed(1)))
    return model


def _ours(model):
    """{Hugging Face module: (e2m1 values fp32, block scales, S_dec, S_enc)} of what the model computes."""
    out = {}
    for e in checkpoint_modules(model):
        q = e.quantized_weight().q
        expert = e.part if q.global_scale.ndim else None
        i = () if expert is None else (expert,)
        values = q.values()[i][e.rows]
        amax = q.amax.reshape(-1)[expert or 0]
        s_enc, s_dec = global_scales(amax, q.chain)
        assert torch.equal(s_dec, q.global_scale.reshape(-1)[expert or 0])
        out[e.name] = (values, q.block_scales[i][e.rows], s_dec, s_enc)
    return out


def _module_tensors(tensors, name):
    return {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}


def _check_ct_reader(tensors, scheme, ours, from_modelopt=False):
    """compressed-tensors' own unpacking and decompression against our codes, scales and values (its
    encode scale is our chain's S_enc; converted from ModelOpt's S_dec, 1 / S_dec)."""
    for name, (values, sb, s_dec, s_enc) in ours.items():
        if from_modelopt:
            s_enc = 1.0 / s_dec
        sd = _module_tensors(tensors, name)
        n, half = sd["weight_packed"].shape
        assert torch.equal(unpack_fp4_from_uint8(sd["weight_packed"], n, 2 * half, torch.float32), values)
        assert torch.equal(sd["weight_scale"].view(torch.uint8), sb.view(torch.uint8))
        assert torch.equal(sd["weight_global_scale"].reshape(()), s_enc)
        weight = NVFP4PackedCompressor.decompress(sd, scheme)["weight"].float()
        # its decode, e2m1 * (s_b / S_enc) rounded to bf16 (s_b / S_enc in bf16 where its global scale is
        # a 0-d tensor, as its ModelOpt converter leaves it), is exactly that of our codes and scales;
        # ours, e2m1 * s_b * S_dec in fp32, differs from it only by that rounding
        block = sb.to(torch.bfloat16).repeat_interleave(16, -1)
        want = (values.bfloat16() * (block / sd["weight_global_scale"])).bfloat16().float()
        assert torch.equal(weight, want), name
        ours = values * block.float() * s_dec
        assert ((weight - ours).abs() <= ours.abs() * 2**-6).all(), name


@pytest.mark.parametrize("recipe", ["aligned", "te", "vllm"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_compressed_tensors_reads_our_quantization_bit_for_bit(kind, recipe, tmp_path):
    model = _model(kind, recipe)
    export_nvfp4(model, tmp_path / "ct", "compressed-tensors")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(config)
    scheme = qc.config_groups["group_0"]
    assert qc.format == "nvfp4-pack-quantized" and scheme.weights.group_size == 16
    assert (scheme.input_activations is not None) == (recipe == "vllm")
    want = QuantizationScheme(targets=["Linear"], **NVFP4)
    assert scheme.weights.strategy == want.weights.strategy and scheme.weights.type == want.weights.type
    assert "lm_head" in qc.ignore and all(n.endswith("mlp.gate") for n in qc.ignore if n != "lm_head")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    _check_ct_reader(tensors, scheme, _ours(model))
    if recipe == "vllm":  # the calibrated input scale as the encode scale
        lin = model.layers[0].self_attn.qkv_proj
        want = 1.0 / lin.input_scale.float()
        assert torch.equal(tensors["model.layers.0.self_attn.q_proj.input_global_scale"], want.reshape(1))


@pytest.mark.parametrize("recipe", ["aligned", "te", "vllm"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_modelopt_layout_matches_its_spec_and_reads_back_bit_for_bit(kind, recipe, tmp_path):
    model = _model(kind, recipe)
    export_nvfp4(model, tmp_path / "mo", "modelopt")
    out = tmp_path / "mo"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == hf_quant["quant_algo"] == "NVFP4"
    assert qc["group_size"] == hf_quant["group_size"] == 16 and "lm_head" in hf_quant["exclude_modules"]
    tensors = load_file(out / "model.safetensors")
    ours = _ours(model)
    for name, (values, sb, s_dec, _) in ours.items():
        sd = _module_tensors(tensors, name)
        n, k = values.shape
        assert torch.equal(sd["weight_scale"].view(torch.uint8), sb.view(torch.uint8))
        # the spec: weight uint8 [N, K/2] (two E2M1 codes a byte, the even element low), weight_scale
        # e4m3 [N, K/16], weight_scale_2 fp32 scalar = the decode scale, input_scale fp32 scalar
        assert sd["weight"].dtype == torch.uint8 and tuple(sd["weight"].shape) == (n, k // 2)
        assert sd["weight_scale"].dtype == torch.float8_e4m3fn
        assert tuple(sd["weight_scale"].shape) == (n, k // 16)
        assert sd["weight_scale_2"].dtype == torch.float32 and sd["weight_scale_2"].shape == ()
        assert torch.equal(sd["weight_scale_2"], s_dec)
        grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        codes = unpack(sd["weight"])
        assert torch.equal(torch.where(codes >= 8, -1.0, 1.0) * grid[(codes & 7).long()], values)
        assert ("input_scale" in sd) == (recipe == "vllm")
        if "input_scale" in sd:
            assert sd["input_scale"].dtype == torch.float32 and sd["input_scale"].shape == ()
    # compressed-tensors' ModelOpt converter is a reader of the layout: the same checks through it
    converter = ModelOptNvfp4Converter(targets=["re:.*"], ignore=hf_quant["exclude_modules"])
    converted = converter.process(dict(tensors))
    scheme = QuantizationScheme(targets=["Linear"], **NVFP4)
    _check_ct_reader(converted, scheme, ours, from_modelopt=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", ["aligned", "te", "vllm"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_an_export_imports_to_the_exporting_models_logits(kind, recipe, fmt, tmp_path):
    model = _model(kind, recipe)
    export_nvfp4(model, tmp_path / "out", fmt)
    loaded = load_pretrained(tmp_path / "out", recipe=model.recipe)
    ids = torch.randint(0, 128, (3, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    for name, (values, sb, s_dec, _) in _ours(model).items():  # kept as they are, not re-quantized
        got = _ours(loaded)[name]
        assert torch.equal(got[0], values) and torch.equal(got[1].view(torch.uint8), sb.view(torch.uint8))
        assert torch.equal(got[2], s_dec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_checkpoint_without_our_sidecar_keeps_its_codes(fmt, tmp_path):
    """Another exporter's checkpoint: the formats' tensors alone (the weight amax is then 2688 S_dec;
    the aligned recipe's epilogue does not use it)."""
    model = _model("moe", "aligned")
    export_nvfp4(model, tmp_path / "out", fmt)
    (tmp_path / "out" / SIDECAR).unlink()
    loaded = load_pretrained(tmp_path / "out", recipe="aligned")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    # a recipe of another block shape quantizes the dequantized weights: it still runs
    assert torch.isfinite(load_pretrained(tmp_path / "out", recipe="te")(ids)).all()


def test_separate_fused_scales_warn_at_export(tmp_path):
    model = _model("dense", "aligned", fused_scale="separate")
    with pytest.warns(UserWarning, match="fused_scale='shared'"):
        export_nvfp4(model, tmp_path / "out", "modelopt")


def test_bad_checkpoints_are_named(tmp_path):
    model = _model("dense", "aligned")
    export_nvfp4(model, tmp_path / "out", "compressed-tensors")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    config["quantization_config"]["format"] = "float-quantized"
    (tmp_path / "out" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'float-quantized' is not supported"):
        load_pretrained(tmp_path / "out")
    export_nvfp4(model, tmp_path / "out2", "compressed-tensors")
    file = tmp_path / "out2" / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.q_proj.weight_packed"] = tensors[
        "model.layers.0.self_attn.q_proj.weight_packed"].to(torch.int16)
    save_file(tensors, file)
    with pytest.raises(CheckpointError, match="weight_packed is torch.int16"):
        load_pretrained(tmp_path / "out2")
    with pytest.raises(FileExistsError):
        export_nvfp4(model, tmp_path / "out2", "modelopt")
    with pytest.raises(ValueError, match="quantizes no weight"):
        export_nvfp4(Qwen3(tiny_qwen3(), "bf16"), tmp_path / "out3", "modelopt")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_from_the_gpu_imports_to_its_logits(fmt, tmp_path):
    """On the kernels (CUDA: one-launch refresh, fused projections, decode layouts): export, import
    onto the GPU, the same logits bit for bit."""
    model = _model("moe", "aligned").to("cuda")
    export_nvfp4(model, tmp_path / "out", fmt)
    loaded = load_pretrained(tmp_path / "out", recipe=model.recipe, device="cuda")
    ids = torch.randint(0, 128, (3, 11), device="cuda")
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
