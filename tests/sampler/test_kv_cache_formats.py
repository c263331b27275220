"""Quantized KV cache formats (`Recipe.kv_cache` fp8 / nvfp4) through both engines: the sampler's cache
and the learner's forward quantize k and v alike, so their log-probs agree as with bf16 keys (CPU:
reference paths and the kernels under the interpreter; GPU: bitwise); straight-through gradients, a
training step, the config override, and the blocks a cache of each format gets."""

import pytest
import torch

from minite.config import load_config
from minite.nn.kv_quant import fake_quantize_kv
from minite.recipe import RECIPES, get_recipe
from minite.ref.kv_quant import quantize_kv
from minite.sampler import Sampler
from minite.sampler.kv_cache import KVCache, num_kv_blocks
from minite.sampling import SamplingParams
from tests.kernels.test_attention import sampler_vs_learner
from tests.sampler.common import prompts_of, tiny_model

FORMATS = ["fp8", "nvfp4"]
# fp32 reference paths: the engines agree as closely as with bf16 keys (tests/diagnostics/test_agreement.py)
CPU_AGREEMENT_ATOL = 1e-5
PARAMS = SamplingParams(n=2, max_tokens=6, temperature=0.9, seed=5)


def quantized(recipe: str, kv_cache: str, moe: bool = False, **execution):
    model = tiny_model(recipe, moe=moe)
    model.set_recipe(model.recipe.replace(kv_cache=kv_cache).with_execution(**execution))
    return model


def test_every_named_recipe_keeps_the_model_dtype_and_bad_formats_are_refused():
    assert {r.kv_cache for r in RECIPES.values()} == {"bf16"}
    assert get_recipe("aligned", kv_cache="nvfp4").kv_cache == "nvfp4"
    with pytest.raises(ValueError, match="kv_cache='int4'"):
        get_recipe("aligned", kv_cache="int4")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("recipe", ["bf16", "aligned"])
def test_sampler_and_learner_agree_on_the_reference(fmt, recipe):
    model = quantized(recipe, fmt)
    sampler, learner = sampler_vs_learner(model, prompts_of([5, 30, 12]), PARAMS, max_num_seqs=4,
                                          kv_cache_tokens=512)
    torch.testing.assert_close(sampler, learner, rtol=0, atol=CPU_AGREEMENT_ATOL)
    # and the format is in force: with bf16 keys and values the log-probs are others
    model.set_recipe(model.recipe.replace(kv_cache="bf16"))
    _, plain = sampler_vs_learner(model, prompts_of([5, 30, 12]), PARAMS, max_num_seqs=4, kv_cache_tokens=512)
    assert not torch.equal(plain, learner)


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_under_the_interpreter_agree_with_the_reference(fmt):
    """The paged kernel over the quantized cache (written by the quantizer kernel) and the packed
    kernel over the learner's quantized k/v give the reference path's log-probs."""
    model = quantized("bf16", fmt)
    ref_sampler, ref_learner = sampler_vs_learner(model, prompts_of([7, 19]), PARAMS, max_num_seqs=4,
                                                  kv_cache_tokens=64, block_size=4)
    model.set_recipe(model.recipe.with_execution(attention="triton", elementwise="triton"))
    sampler, learner = sampler_vs_learner(model, prompts_of([7, 19]), PARAMS, max_num_seqs=4,
                                          kv_cache_tokens=64, block_size=4)
    torch.testing.assert_close(sampler, learner, rtol=0, atol=CPU_AGREEMENT_ATOL)
    torch.testing.assert_close(learner, ref_learner, rtol=0, atol=1e-4)
    torch.testing.assert_close(sampler, ref_sampler, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gradients_pass_straight_through_the_quantization(fmt, kernel):
    """d/dk and d/dv of the quantized forward are those of attention over the dequantized values."""
    import sys

    nn_attention = sys.modules["minite.nn.attention"]
    from minite.nn.attention import PackedLayout, varlen_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(26, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    pos, cu = torch.cat([torch.arange(7), torch.arange(19)]), torch.tensor([0, 7, 26])
    probe = torch.randn(26, 4, 16, generator=g)
    if kernel:
        out = nn_attention.KernelAttention.apply(q, k, v, PackedLayout(pos, cu), fmt)
    else:
        out = varlen_attention(q, fake_quantize_kv(k, fmt), fake_quantize_kv(v, fmt), pos, cu)
    (out * probe).sum().backward()
    kd, vd = (quantize_kv(t.detach(), fmt).dequantize().requires_grad_() for t in (k, v))
    qd = q.detach().requires_grad_()
    (varlen_attention(qd, kd, vd, pos, cu) * probe).sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_fp32_operands_read_a_quantized_cache(fmt):
    """fp32 q, k, v on quantized keys and values (the fp8 words widened from fp16): the kernel's
    forward on the GPU matches attention over the dequantized values."""
    from minite.nn.attention import KernelAttention, PackedLayout, varlen_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(80, h, 128, generator=g, device="cuda") for h in (4, 2, 2))
    pos = torch.cat([torch.arange(23), torch.arange(57)]).cuda()
    cu = torch.tensor([0, 23, 80], device="cuda")
    out = KernelAttention.apply(q, k, v, PackedLayout(pos, cu), fmt)
    kd, vd = (quantize_kv(t, fmt).dequantize() for t in (k, v))
    torch.testing.assert_close(out, varlen_attention(q, kd, vd, pos, cu), rtol=0, atol=1e-4)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_cpu_training_step_with_the_config_override(tmp_path, fmt):
    from minite.rl.trainer import Trainer
    from tests.rl.test_trainer import TINY

    cfg = load_config(None, TINY + [f"--recipe.overrides.kv_cache={fmt}", "--rl.steps=1", "--warmup.steps=0",
                                    "--eval.every=0", "--checkpoint.every=0"])
    assert cfg.recipe.overrides == {"kv_cache": fmt}
    trainer = Trainer(cfg, tmp_path / "run")
    assert trainer.recipe.kv_cache == fmt
    summary = trainer.run()
    assert summary["rl_steps"] == 1
    own = load_config(None, ["--sampler.recipe=bf16", f"--sampler.recipe_overrides.kv_cache={fmt}"])
    assert own.sampler.own_recipe().kv_cache == fmt


def test_a_quantized_cache_holds_more_blocks_in_the_same_memory(monkeypatch):
    cfg = tiny_model().config
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 1 << 31))
    blocks = {f: num_kv_blocks(cfg, 16, torch.bfloat16, torch.device("cuda"), None, 0.5, f)
              for f in ("bf16", *FORMATS)}
    per_block = {f: KVCache.bytes_per_block(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim,
                                            torch.bfloat16, f) for f in blocks}
    assert blocks["bf16"] < blocks["fp8"] < blocks["nvfp4"]
    D = cfg.head_dim
    assert per_block["bf16"] / per_block["fp8"] == pytest.approx(2 * D / (D + 4))
    assert per_block["bf16"] / per_block["nvfp4"] == pytest.approx(2 * D / (D / 2 + D / 16 + 4))
    cache = KVCache(cfg.num_hidden_layers, 3, 16, cfg.num_key_value_heads, D, torch.bfloat16, "cpu", "nvfp4")
    stored = sum(t.numel() * t.element_size() for kv in (cache.k, cache.v) for t in kv.fields())
    assert stored == 4 * per_block["nvfp4"]  # 3 blocks and the scratch block


def test_the_sampler_allocates_its_cache_in_the_recipes_format():
    model = quantized("bf16", "nvfp4")
    sampler = Sampler(model, kv_cache_tokens=64, block_size=4)
    assert sampler.cache.kv_format == "nvfp4" and sampler.cache.k.payload.dtype == torch.uint8


# GPU: the aligned recipe's engines agree bit for bit with every KV format, dense and MoE


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", *FORMATS])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpu_aligned_sampler_logprobs_equal_learner_bitwise(fmt, moe):
    model = tiny_model(get_recipe("aligned", kv_cache=fmt).with_execution(backend="triton"), moe=moe,
                       head_dim=128).to("cuda", torch.bfloat16)
    params = SamplingParams(n=3, max_tokens=48, temperature=0.9, seed=5)
    sampler, learner = sampler_vs_learner(model, prompts_of([5, 30, 70, 130, 12]), params, max_num_seqs=16,
                                          kv_cache_tokens=8192)
    equal = (sampler == learner).float().mean().item()
    worst = (sampler - learner).abs().max().item()
    assert equal == 1.0, f"{fmt}: bitwise {equal:.4f} of {sampler.numel()} tokens, max |diff| {worst:.3g}"


def test_an_unknown_format_in_the_config_is_one_clear_line(capsys):
    from minite.cli import main

    assert main(["train", "--recipe.overrides.kv_cache=int8", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("minite train: error: recipe: kv_cache='int8' is not supported; choose one of "
                       "['bf16', 'fp8', 'nvfp4']")


def test_agreement_cli_takes_the_kv_format(capsys):
    import json

    from minite.cli import main

    assert main(["agreement", "--preset", "tiny-qwen3", "--kv-cache", "nvfp4", "--num-prompts", "2",
                 "--n", "2", "--max-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["logprob_abs_diff_max"] < CPU_AGREEMENT_ATOL and report["n_tokens"] > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_sdpa_sampler_reads_the_dequantized_cache(fmt):
    """The fast engine's SDPA backend gathers the quantized blocks dequantized: the reference's
    log-probs up to SDPA's own summation order."""
    model = quantized("bf16", fmt)
    want, _ = sampler_vs_learner(model, prompts_of([9, 4]), PARAMS, max_num_seqs=4, kv_cache_tokens=64)
    model.set_recipe(model.recipe.with_execution(attention="sdpa"))
    got, _ = sampler_vs_learner(model, prompts_of([9, 4]), PARAMS, max_num_seqs=4, kv_cache_tokens=64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
