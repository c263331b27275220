"""The sampler-only form (`minite.nn.sampler_weights`): what it holds; outputs bitwise the full model's."""

import pytest
import torch

from minite import nvfp4
from minite.kernels import available
from minite.learner import Learner
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.nn.calibrate import calibrate
from minite.nn.linear import Linear
from minite.nn.moe import MoEExperts
from minite.nn.quantized_weight import is_released
from minite.nn.sampler_weights import is_sampler_only, quantized_layers, to_sampler_weights
from minite.recipe import get_recipe
from minite.sampler import Sampler
from minite.sampling import SamplingParams

CONFIGS = {"dense": tiny_qwen3, "moe": tiny_qwen3_moe}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def recipe(backend: str):
    """`aligned` with its GEMMs on `backend` (the element-wise ops and attention on the reference: the
    interpreter's time goes to the GEMMs under test)."""
    return get_recipe("aligned").with_execution(backend=backend, elementwise="ref", attention="ref")


def full_model(kind: str, r, seed: int = 0, device: str = "cpu", layers: int = 2) -> Qwen3:
    model = Qwen3(CONFIGS[kind](num_hidden_layers=layers), r).to(device=device, dtype=torch.bfloat16)
    model.init_weights(generator=torch.Generator(device).manual_seed(seed))
    return model.eval()


def backends():
    return ["ref"] + (["triton"] if available() else [])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_holds_codes_scales_and_decode_layout_only(kind):
    model = full_model(kind, recipe("triton" if available() else "ref"))
    to_sampler_weights(model)
    layers = quantized_layers(model)
    assert layers and is_sampler_only(model)
    for name, (module, leaf) in layers.items():
        param = getattr(module, leaf)
        assert is_released(param) and not param.requires_grad, name
        assert param.untyped_storage().nbytes() == 2  # one bf16 element
        if hasattr(module, "quantized_weights"):
            qws = module.quantized_weights()
        elif isinstance(module, MoEExperts):
            qws = [module.quantized_weight(leaf)]
        else:
            qws = [module.quantized_weight()]
        for qw in qws:
            assert qw.unscaled is None and not qw._derived.operands
            assert qw.q.codes.dtype == torch.uint8
            if available():
                assert qw.decode_dtypes(), name  # made for the decode GEMMs that read it
    # embeddings, norms, router and LM head keep their bf16 parameters
    kept = [n for n, p in model.named_parameters() if not is_released(p)]
    assert "embed_tokens.weight" in kept and "norm.weight" in kept
    bf16 = [m for m in model.modules() if isinstance(m, Linear) and not m.recipe.fp4]
    assert len(bf16) == (2 if kind == "moe" else 0)  # the routers
    assert not any(is_released(m.weight) for m in bf16)


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("backend", backends())
def test_logits_bitwise_the_full_models(kind, backend):
    """Rows above the decode thresholds (prefill: 72 tokens; 136 x top-2 for the 4 experts, > 64 per
    expert on average: the decode layout in row tiles) and below them (one token each)."""
    r = recipe(backend)
    full = full_model(kind, r, layers=1 if backend == "triton" else 2)
    tokens = 72 if kind == "dense" else 136
    ids = torch.randint(0, full.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_long, want_short = full(ids), full(ids[:, :1])
        to_sampler_weights(full)
        assert torch.equal(full(ids), want_long)
        assert torch.equal(full(ids[:, :1]), want_short)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gpu_logits_bitwise_at_every_tile(kind):
    """On the GPU (bf16 operands; the full model on the TMA tiles of its copies, the sampler-only one
    on its decode layouts in row tiles): prefill of 3000 tokens (the large tiles), 300 and 1 token."""
    full = full_model(kind, recipe("auto"), device="cuda")
    ids = torch.randint(0, full.config.vocab_size, (1, 3000), device="cuda")
    with torch.no_grad():
        want = [full(ids[:, :n]) for n in (3000, 300, 1)]
        to_sampler_weights(full)
        for n, w in zip((3000, 300, 1), want):
            assert torch.equal(full(ids[:, :n]), w), n


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sampler_logprobs_bitwise_the_full_models(kind):
    """The sampler's tokens and log-probs (prefill, decode steps, continuous batching) on the
    sampler-only model are the full model's, on the backend the device runs."""
    params = SamplingParams(n=2, max_tokens=6, seed=3)
    prompts = [[5, 7, 9, 11, 13], [3, 4], [8] * 9]
    full = full_model(kind, "aligned", device=DEVICE)
    want = Sampler(full, kv_cache_tokens=256).generate(prompts, params)
    got = Sampler(to_sampler_weights(full), kv_cache_tokens=256).generate(prompts, params)
    for a, b in zip(want, got):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids
            assert torch.equal(torch.as_tensor(sa.logprobs), torch.as_tensor(sb.logprobs))


def test_a_sampler_only_model_does_not_train_or_change_recipe():
    model = to_sampler_weights(full_model("dense", recipe("ref")))
    with pytest.raises(ValueError, match="sampler-only"):
        Learner(model)
    x = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True)
    y = model.layers[0].mlp.down_proj(torch.randn(3, 128, dtype=torch.bfloat16))
    assert not y.requires_grad  # nothing to train: no gradient reaches the released weight
    q = model.layers[0].self_attn.o_proj(x)
    with pytest.raises(RuntimeError, match="no backward"):
        q.sum().backward()
    with pytest.raises(RuntimeError, match="calibrate_through"), calibrate(model):
        pass
    model.set_recipe("te")
    with pytest.raises(ValueError, match="released"), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))


def test_to_sampler_weights_twice_keeps_the_weights():
    model = full_model("moe", recipe("ref"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = model(ids)
        to_sampler_weights(to_sampler_weights(model))
        assert torch.equal(model(ids), want)


@pytest.mark.skipif(not available(), reason="Triton kernels unavailable")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_packed_codes_give_the_copys_bits_in_every_aligned_config(out_dtype):
    """The GEMMs' packed-weight path reads the codes in the aligned K order: the bits of the bf16 copy
    (fp16 operands in the interpreter, bf16 on the GPU), heavy-tailed data, ragged M and N; the large
    tile's too on the GPU (where the copy runs by TMA, the codes by pointer loads)."""
    from minite.kernels import gemm as kg
    from minite.kernels import grouped_gemm as gg

    g = torch.Generator().manual_seed(0)
    k = 256
    x = torch.randn(300 if DEVICE == "cuda" else 40, k, generator=g) ** 3
    w = torch.randn(3, 80, k, generator=g) ** 3
    xq = nvfp4.quantize(x, "row")
    wqs = [nvfp4.quantize(we, "tensor").to(DEVICE) for we in w]
    a = xq.unscaled().to(DEVICE, kg.operand_dtype(DEVICE))
    sa = xq.global_scale.reshape(-1).to(DEVICE)
    ms = (1, 40) if DEVICE == "cpu" else (1, 300, 2048 + 5)
    for m in ms:
        am = a[torch.arange(m, device=DEVICE) % a.shape[0]].contiguous()
        sam = sa[torch.arange(m, device=DEVICE) % a.shape[0]].contiguous()
        for config in ("aligned", "prefill"):
            cfg = kg.pick_config(config, m, 80)
            w0 = wqs[0]
            copy = kg.w4a4_gemm(am, sam, kg.unscaled_copy(w0), w0.global_scale, None, "sdec", out_dtype, cfg)
            packed = kg.w4a4_gemm(am, sam, w0.codes, w0.global_scale, w0.block_scales, "sdec", out_dtype, cfg)
            assert torch.equal(packed, copy), (m, config)
    offsets = torch.tensor([0, 17, 17, a.shape[0]], device=DEVICE)
    sw = torch.stack([q.global_scale for q in wqs]).reshape(-1)
    copies = torch.stack([kg.unscaled_copy(q) for q in wqs])
    codes, scales = torch.stack([q.codes for q in wqs]), torch.stack([q.block_scales for q in wqs])
    for config in ("aligned", "prefill"):
        want = gg.grouped_w4a4_gemm(a, sa, copies, sw, offsets, None, "sdec", out_dtype, config)
        got = gg.grouped_w4a4_gemm(a, sa, codes, sw, offsets, scales, "sdec", out_dtype, config)
        assert torch.equal(got, want), config
