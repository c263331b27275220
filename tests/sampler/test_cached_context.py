"""The sampler's steps are the model's own forward under a cached context: the attention layers write
the KV cache, the backend follows the device, and every module's hooks see the step."""

import torch

from minite.nn.attention_backends import PagedKernelAttention, PagedReferenceAttention, PagedSDPAAttention
from minite.sampler import Sampler
from minite.sampler.kv_cache import KVCache
from minite.sampler.runner import build_batch, cached_context, cached_forward
from minite.sampling import SamplingParams
from tests.sampler.common import prompts_of, tiny_model


def _cache(model, blocks=8, block_size=4):
    cfg = model.config
    return KVCache(cfg.num_hidden_layers, blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                   torch.float32, "cpu")


def test_prefill_writes_every_layers_keys_at_the_slots():
    model = tiny_model()
    cache = _cache(model)
    tokens = prompts_of([6, 3])
    batch = build_batch(tokens, [0, 0], [[5, 2], [0]], cache.block_size, cache.scratch_block, "cpu")
    keys = {}
    for i, layer in enumerate(model.layers):
        # k as the layer computed it: project_qkv's second output
        real = layer.self_attn.project_qkv
        layer.self_attn.project_qkv = (lambda x, pos, *rest, i=i, real=real:
                                       keys.setdefault(i, real(x, pos, *rest)))
    with torch.no_grad():
        logits = cached_forward(model, cache, batch)
    assert logits.shape == (2, model.config.vocab_size)
    flat = cache.k.view(cache.k.shape[0], -1, *cache.k.shape[-2:])  # [L, slots, Hkv, D]
    for i in range(model.config.num_hidden_layers):
        assert torch.equal(flat[i, batch.slots], keys[i][1])


def test_backend_follows_the_device():
    model = tiny_model()
    cache = _cache(model)
    batch = build_batch(prompts_of([5]), [0], [[1, 3]], cache.block_size, cache.scratch_block, "cpu")
    ctx = cached_context(model, cache, batch)
    assert isinstance(ctx.attention, PagedReferenceAttention)
    assert ctx.kv_cache is cache and ctx.slots is batch.slots and ctx.output_rows is batch.last
    model.set_recipe(model.recipe.with_execution(attention="triton"))  # the kernel, also on the CPU
    assert isinstance(cached_context(model, cache, batch).attention, PagedKernelAttention)


def test_module_hooks_see_every_step():
    model = tiny_model()
    rows = {"layer": [], "logits": []}
    model.layers[1].register_forward_hook(lambda m, a, out: rows["layer"].append(out.shape[0]))
    model.register_forward_hook(lambda m, a, out: rows["logits"].append(out.shape[0]))
    params = SamplingParams(max_tokens=3, seed=0)
    Sampler(model, max_num_seqs=2, block_size=4).generate(prompts_of([5]), params)
    # a prefill of the 5 prompt tokens, then two decode steps; one row of logits each
    assert rows == {"layer": [5, 1, 1], "logits": [1, 1, 1]}


def test_the_fast_engine_attends_through_sdpa_with_the_references_visibility():
    model = tiny_model()
    tokens = prompts_of([6, 3, 1])
    tables = [[5, 2], [0], [7]]
    out = {}
    for fast in (False, True):
        if fast:
            model.set_recipe(model.recipe.with_execution(attention="sdpa"))
        cache = _cache(model)
        batch = build_batch(tokens, [0, 0, 0], tables, cache.block_size, cache.scratch_block, "cpu", rows=4)
        assert isinstance(cached_context(model, cache, batch).attention,
                          PagedSDPAAttention if fast else PagedReferenceAttention)
        with torch.no_grad():
            out[fast] = cached_forward(model, cache, batch)
    assert torch.isfinite(out[True]).all()  # the padding row sees a key: no NaN
    torch.testing.assert_close(out[True][:3], out[False][:3], rtol=1e-4, atol=1e-4)


def test_the_fast_sampler_generates_what_the_reference_does_up_to_rounding():
    model = tiny_model()
    prompts = prompts_of([5, 9, 2])
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
    ref = Sampler(model, kv_cache_tokens=256).generate(prompts, params)
    model.set_recipe(model.recipe.with_execution(attention="sdpa"))
    fast = Sampler(model, kv_cache_tokens=256).generate(prompts, params)
    for r, f in zip(ref, fast):
        for a, b in zip(r.samples, f.samples):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-4)
