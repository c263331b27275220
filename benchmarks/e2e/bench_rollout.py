"""Rollout throughput (generated tokens/s): our sampler in `bf16` and `aligned` vs Hugging Face `generate`.

Workload (defaults): 64 prompts x 8 samples x 512 new tokens (no stop token, every sample runs to
max_tokens), random prompts of 128 tokens, temperature 1, no truncation. Models with random weights:

- dense: Qwen3-1.7B shape (hidden 2048, 28 layers, 16 heads / 8 KV heads, head_dim 128, FFN 6144,
  vocab 151936, tied embeddings), all 28 layers by default;
- moe: Qwen3-30B-A3B shape (hidden 2048, 32 heads / 4 KV heads, head_dim 128, 128 experts, top-8,
  expert FFN 768, vocab 151936), all 48 layers by default (`--moe-layers`).

A recipe is a name, optionally with a KV cache format: `aligned/fp8` is the `aligned` recipe with
an FP8 KV cache (`Recipe.kv_cache`). Each row reports the mean decode step (wall time of the decode
steps over their number) and its roofline (`decode_roofline`: the bytes and FLOPs of a decode step at
the workload's mean context, against the H200's measured ceilings) and the fraction of it reached.
`--max-batch`: each recipe runs as many sequences as the memory its weights leave holds in KV cache
(prompts of `--samples` each), so recipes are compared at their own maximum batch.

The Hugging Face baseline (`Qwen3ForCausalLM` / `Qwen3MoeForCausalLM`, bf16, SDPA attention) gets our
state dict under Hugging Face names where both copies fit on the GPU (the largest logit difference on
one prompt is reported as a mapping check); otherwise (the full MoE) it is built after ours is freed,
with its own random weights of the same shape (no stop token: the weights do not change the work).
Each engine runs a short warm-up before the timed run (`warm_up`: kernel compilation, and the capture
of every decode graph the run replays). `--tiny` runs tiny models on the CPU in seconds (smoke test).
Prints a table and writes JSON (GPU, date, commit, arguments, rows) to `--out`.

    python -m benchmarks.e2e.bench_rollout --models dense --out OUT.json
    python -m benchmarks.e2e.bench_rollout --models moe --new-tokens 256 --no-hf --rounds 3
    python -m benchmarks.e2e.bench_rollout --models dense --recipes bf16,aligned/fp8 --max-batch
    python -m benchmarks.e2e.bench_rollout --models moe --moe-layers 48 --sampler-only --no-hf

`--sampler-only`: each NVFP4 recipe samples with a sampler-only model (codes, scales and decode layout;
no bf16 weights of its quantized layers) built layer by layer with the same random weights
(`build_sampler_model`), so the full 48-layer MoE shape fits one GPU; every run (bf16 too) builds its
own model and frees it after, so one model is on the GPU at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time

import torch

from benchmarks.common import ratio_stats, report, sync
from benchmarks.e2e.decode_roofline import decode_step, linear_params
from minite.models import ModelConfig, Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.models.checkpoint import EXPERT_PARAM, fused_expert_name, hf_tensors
from minite.models.presets import qwen3_1_7b, qwen3_30b_a3b
from minite.models.sampler_model import build_sampler_model, random_fill
from minite.nn.sampler_weights import is_sampler_only
from minite.recipe import get_recipe
from minite.sampler import Sampler
from minite.sampler.graphs import bucket_width
from minite.sampler.kv_cache import KVCache
from minite.sampling import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU, a few tokens (smoke test)")
    p.add_argument("--models", default="dense,moe")
    p.add_argument("--recipes", default="bf16,aligned")
    p.add_argument("--backend", default="auto", choices=["auto", "ref", "triton"],
                   help="backend of the NVFP4 recipes (auto: the kernels on CUDA, the reference elsewhere)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--dense-layers", type=int, default=28)
    p.add_argument("--moe-layers", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="default: enough for the workload")
    p.add_argument("--max-batch", action="store_true",
                   help="each recipe: as many sequences as its free memory holds in KV cache")
    p.add_argument("--memory-fraction", type=float, default=0.85,
                   help="with --max-batch: the share of the memory left by the weights for KV cache")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--sync-recipes", default="",
                   help="recipes also run without lookahead decode (Sampler(async_decode=False)), e.g. bf16")
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face baseline")
    p.add_argument("--sampler-only", action="store_true",
                   help="NVFP4 recipes on a sampler-only model built layer by layer (module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="run our recipes this many times, the order reversed every other round; a recipe's "
                        "speed against bf16 is then the median of its per-round ratios (the clock and the "
                        "host move between runs: unpaired readings of one recipe spread by 10 %% and more)")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.samples, args.new_tokens, args.prompt_len = 3, 2, 6, 5
    return args


def model_config(kind: str, args) -> ModelConfig:
    if args.tiny:
        if kind == "dense":  # tied like Qwen3-1.7B
            return tiny_qwen3(eos_token_id=None, tie_word_embeddings=True)
        return tiny_qwen3_moe(eos_token_id=None)
    if kind == "dense":
        return qwen3_1_7b(num_hidden_layers=args.dense_layers, eos_token_id=None)
    return qwen3_30b_a3b(num_hidden_layers=args.moe_layers, eos_token_id=None)


def build_model(config: ModelConfig, device, dtype, seed: int) -> Qwen3:
    """The model made in `dtype` from the start: made in fp32 and cast, the full MoE's fp32 weights
    (122 GB) stay in the allocator's cache and shrink what `--max-batch` finds free."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3(config, recipe="bf16")
    finally:
        torch.set_default_dtype(previous)
    model.init_weights(std=0.02, generator=torch.Generator(device).manual_seed(seed))
    return model.eval()


def recipe_of(spec: str, backend: str):
    """`name` or `name/kv` (a KV cache format) -> the recipe, on `backend`."""
    name, _, kv = spec.partition("/")
    recipe = get_recipe(name).with_execution(backend=backend)
    return dataclasses.replace(recipe, kv_cache=kv) if kv else recipe


def max_sequences(model, recipe, args, device) -> int:
    """Sequences of the workload whose KV cache fits in `--memory-fraction` of the free memory the
    model's weights leave (a multiple of `--samples`)."""
    cfg = model.config
    per_token = KVCache.bytes_per_block(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim,
                                        torch.bfloat16, recipe.kv_cache)
    gc.collect()
    torch.cuda.empty_cache()  # memory cached by the allocator is free for the KV cache
    free, _ = torch.cuda.mem_get_info(device)
    tokens = int(free * args.memory_fraction / per_token)
    seqs = tokens // (args.prompt_len + args.new_tokens + 16) - 16
    return max(args.samples, seqs // args.samples * args.samples)


def build_sampler_only(config: ModelConfig, spec: str, device, dtype, seed: int, backend: str) -> Qwen3:
    """`build_model`'s weights as a sampler-only model under the recipe `spec`, made layer by layer
    (peak memory: the sampler form plus one layer in bf16)."""
    recipe = recipe_of(spec, backend)
    fill = random_fill(seed, std=0.02, device=device)
    return build_sampler_model(config, recipe, fill, device=device, dtype=dtype)


def run_ours(model, spec: str, prompts, args, device, async_decode: bool | None = None) -> dict:
    sampler_only = is_sampler_only(model)  # its recipe is fixed
    recipe = model.recipe if sampler_only else recipe_of(spec, args.backend)
    if not sampler_only:
        model.set_recipe(recipe)
    if args.max_batch and device.type == "cuda":
        model(torch.tensor([prompts[0][:8]], device=device))  # quantize the weights before measuring
        sync()
        prompts = workload_prompts(model.config, max_sequences(model, recipe, args, device) // args.samples,
                                   args)
    params = SamplingParams(n=args.samples, max_tokens=args.new_tokens, seed=args.seed)
    seqs = len(prompts) * args.samples
    kv_tokens = args.kv_cache_tokens or (seqs + 16) * (args.prompt_len + args.new_tokens + 16)
    max_num_seqs = max(args.max_num_seqs, seqs) if args.max_batch else args.max_num_seqs
    sampler = Sampler(model, max_num_seqs=max_num_seqs, kv_cache_tokens=kv_tokens,
                      cuda_graphs=False if args.no_cuda_graphs else None, async_decode=async_decode)
    warm_up(sampler, model.config, len(prompts), args)
    sync()
    decode_s, step, stats = [0.0], sampler.step, sampler.stats

    def timed_step():
        t, before = time.perf_counter(), stats["decode_steps"]
        out = step()
        if stats["decode_steps"] > before:
            decode_s[0] += time.perf_counter() - t
        return out

    sampler.step = timed_step
    decode_before = sampler.stats["decode_steps"]
    start = time.perf_counter()
    out = sampler.generate(prompts, params)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(s.token_ids) for r in out for s in r.samples)
    decode_steps = sampler.stats["decode_steps"] - decode_before
    step_ms = 1e3 * decode_s[0] / max(decode_steps, 1)
    batch = min(seqs, sampler.max_num_seqs)
    weight_format = "bf16" if recipe.name == "bf16" else "nvfp4"
    roof = decode_step(model.config, batch, args.prompt_len + (args.new_tokens + 1) / 2, weight_format,
                       recipe.kv_cache)
    row = dict(engine="minite", recipe=spec, seconds=seconds, gen_tokens=tokens, sequences=seqs,
               tokens_per_s=tokens / seconds, decode_step_ms=step_ms, decode_steps=decode_steps,
               outside_decode_s=seconds - decode_s[0],  # the prefill steps, the run's start and end
               roofline_ms=roof["roofline_ms"], roofline_frac=roof["roofline_ms"] / step_ms,
               step_weight_gb=roof["weight_gb"], step_kv_gb=roof["kv_gb"], step_tflop=roof["tflop"],
               cuda_graphs=sampler.use_graphs, async_decode=sampler.async_decode,
               preemptions=sampler.num_preemptions, steps=sampler.stats["steps"], sampler_only=sampler_only)
    if device.type == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9  # since the caller's reset
    del sampler, out
    if not sampler_only:
        model.set_recipe("bf16")  # drops the quantized weight copies before the next engine runs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def warm_up(sampler: Sampler, config, n_prompts: int, args) -> None:
    """Short runs of the whole batch (the kernels of its row counts compile) whose decode steps reach
    every block-table width bucket the timed run crosses, the widest first: each decode graph the run
    replays is captured here, not inside the timed run. Other random prompts than the workload's."""
    first, last = args.prompt_len + 1, args.prompt_len + args.new_tokens
    starts = {}  # width bucket -> the first context length in it
    for ctx in range(first, last + 1):
        starts.setdefault(bucket_width(-(-ctx // sampler.block_size)), ctx)
    steps = min(4, args.new_tokens)
    g = torch.Generator().manual_seed(args.seed + 2)
    for ctx in sorted(set(starts.values()) | {last}, reverse=True):
        length = max(1, min(ctx, last - steps + 1) - 1)
        prompts = torch.randint(0, config.vocab_size, (n_prompts, length), generator=g).tolist()
        sampler.generate(prompts, SamplingParams(n=args.samples, max_tokens=steps, seed=1))


def workload_prompts(config, n: int, args) -> list[list[int]]:
    """n random prompts of `--prompt-len` tokens (the same first prompts for any n)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, config.vocab_size, (n, args.prompt_len), generator=g).tolist()


def hf_model_from(model: Qwen3, device, dtype):
    """A transformers model holding (copies of) `model`'s weights."""
    import transformers

    cfg = model.config
    hf_cfg = (transformers.Qwen3MoeConfig if cfg.is_moe else transformers.Qwen3Config)(**cfg.to_hf())
    cls = transformers.Qwen3MoeForCausalLM if cfg.is_moe else transformers.Qwen3ForCausalLM
    with torch.device(device):
        hf = cls(hf_cfg).to(dtype).eval()
    hf_keys = set(hf.state_dict())
    state = {}
    for name, tensor in model.state_dict().items():
        fused = bool(EXPERT_PARAM.match(name)) and fused_expert_name(name) in hf_keys
        state.update(hf_tensors(name, tensor, cfg, fused_experts=fused))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    allowed = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"weight mapping to transformers failed: missing {missing}, "
                           f"unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf


def bf16_bytes(config) -> int:
    """The bf16 weights of `config`'s model: decoder linears, embeddings and (untied) LM head."""
    heads = 1 if config.tie_word_embeddings else 2
    return 2 * (linear_params(config)[1] + heads * config.vocab_size * config.hidden_size)


def hf_own_model(config, device, dtype):
    """A transformers model of `config`'s shape with its own random weights."""
    import transformers

    hf_cfg = (transformers.Qwen3MoeConfig if config.is_moe else transformers.Qwen3Config)(**config.to_hf())
    cls = transformers.Qwen3MoeForCausalLM if config.is_moe else transformers.Qwen3ForCausalLM
    with torch.device(device):
        return cls(hf_cfg).to(dtype).eval()


@torch.no_grad()
def run_hf(model: Qwen3 | None, config, prompts, args, device, dtype) -> dict:
    """HF generate on a copy of `model`'s weights, or (model None) on its own weights of `config`'s shape."""
    probe = torch.tensor([prompts[0]], device=device)
    if model is None:
        hf, logit_diff = hf_own_model(config, device, dtype), None
    else:
        hf = hf_model_from(model, device, dtype)
        logit_diff = (hf(probe).logits.float() - model(probe).float()).abs().max().item()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  num_return_sequences=args.samples, pad_token_id=0, eos_token_id=None)
    n = args.new_tokens
    hf.generate(ids, max_new_tokens=min(4, n), min_new_tokens=min(4, n), **kwargs)
    sync()
    start = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
    sync()
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    del hf, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(engine="hf_generate", recipe="bf16", seconds=seconds, gen_tokens=tokens,
                tokens_per_s=tokens / seconds, hf_logit_max_abs_diff=logit_diff,
                hf_weights="own random" if model is None else "ours")


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    rows = []
    for kind in args.models.split(","):
        config = model_config(kind, args)
        recipes = args.recipes.split(",")
        # --sampler-only: each run builds its own model and frees it after (one model on the GPU at a time)
        model = None if args.sampler_only else build_model(config, device, dtype, args.seed)
        prompts = workload_prompts(config, args.prompts, args)
        shape = dict(model=kind, layers=config.num_hidden_layers)
        runs = [(r, None) for r in recipes]
        runs += [(r, False) for r in args.sync_recipes.split(",") if r]
        for rnd in range(args.rounds):
            for recipe, async_decode in runs if rnd % 2 == 0 else runs[::-1]:
                if device.type == "cuda":  # the row's peak_gb: this run, its model's making included
                    torch.cuda.reset_peak_memory_stats()
                target = model
                if args.sampler_only and recipe.partition("/")[0] == "bf16":
                    target = build_model(config, device, dtype, args.seed)
                elif args.sampler_only:
                    target = build_sampler_only(config, recipe, device, dtype, args.seed, args.backend)
                row = run_ours(target, recipe, prompts, args, device, async_decode)
                del target
                if args.sampler_only and device.type == "cuda":  # this run's model goes before the next's
                    gc.collect()
                    torch.cuda.empty_cache()
                rows.append(dict(shape, round=rnd, **row))
                print(rows[-1], flush=True)
        if not args.no_hf:
            # a second copy of the weights must leave room for the KV cache, else HF gets its own weights
            copy = device.type != "cuda" or 2 * bf16_bytes(config) < 0.6 * torch.cuda.mem_get_info(device)[1]
            if not copy:
                model = None
                gc.collect()
                torch.cuda.empty_cache()
            elif model is None:
                model = build_model(config, device, dtype, args.seed)
            rows.append(dict(shape, **run_hf(model, config, prompts, args, device, dtype)))
            print(rows[-1], flush=True)
            hf_tps = next(r["tokens_per_s"] for r in rows
                          if r["model"] == kind and r["engine"] == "hf_generate")
            for r in rows:
                if r["model"] == kind and r["engine"] == "minite":
                    r["speedup_vs_hf"] = r["tokens_per_s"] / hf_tps
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    workload = dict(prompts=args.prompts, samples=args.samples, new_tokens=args.new_tokens,
                    prompt_len=args.prompt_len, device=str(device), dtype=str(dtype), backend=args.backend,
                    moe_layers_of_48=args.moe_layers, dense_layers_of_28=args.dense_layers, tiny=args.tiny,
                    sampler_only=args.sampler_only)
    report("rollout", rows, args.out, extra=dict(workload=workload, vs_bf16=paired_vs_bf16(rows)))
    return rows


def paired_vs_bf16(rows: list[dict]) -> dict:
    """Each of our rows' speed against the (first) bf16 run of its model and round (`vs_bf16`, set on the
    row), and per model and recipe the median / min / max of those ratios over the rounds."""
    ours = [r for r in rows if r["engine"] == "minite"]
    out = {}
    for r in ours:
        same = (r["model"], r["round"])
        base = next((b for b in ours if b["recipe"] == "bf16" and (b["model"], b["round"]) == same), None)
        if base is None or r is base:
            continue
        r["vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        name = f"{r['model']} {r['recipe']}" + ("" if r["async_decode"] == base["async_decode"] else " sync")
        out.setdefault(name, []).append(r["vs_bf16"])
    return {k: dict(zip(("median", "min", "max"), ratio_stats(v, [1.0] * len(v)), strict=True), rounds=len(v))
            for k, v in out.items()}


if __name__ == "__main__":
    main()
