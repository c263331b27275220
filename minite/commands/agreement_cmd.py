"""`minite agreement`: generate with the sampler, recompute with the learner, report the gap."""

import json
import sys

import torch

from minite.commands.args import nonnegative_int, positive_int
from minite.devices import check_device
from minite.diagnostics.agreement import measure_agreement, random_prompts
from minite.models.presets import MODEL_PRESETS, model_preset
from minite.recipe import KV_CACHES, RECIPES, get_recipe
from minite.sampling import SamplingParams

HELP = "learner-vs-sampler agreement on sampled tokens (bitwise share, |log-prob diff|, k3_kl)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="random-weight model of this shape")
    src.add_argument("--model", metavar="DIR", help="a Hugging Face Qwen3 / Qwen3-MoE model directory")
    p.add_argument("--layers", type=positive_int, help="override the preset's number of decoder layers")
    p.add_argument("--learner-recipe", default="aligned", choices=sorted(RECIPES))
    p.add_argument("--sampler-recipe", default=None, choices=sorted(RECIPES),
                   help="default: the learner's recipe (one model object, shared quantized weights)")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--prompt-len", type=positive_int, default=16, help="random prompt length in tokens")
    p.add_argument("--n", type=positive_int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=nonnegative_int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-std", type=float, default=0.02, help="random weights: N(0, std)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: float32 on CPU, bfloat16 on CUDA (a --model keeps its own unless set)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", choices=["auto", "ref", "triton"], default="auto",
                   help="NVFP4 execution backend of both recipes (auto: the kernels on CUDA, the "
                        "reference elsewhere)")
    p.add_argument("--kv-cache", choices=list(KV_CACHES), default="bf16",
                   help="KV cache format of both recipes (recipe.kv_cache: bf16 = the model dtype)")
    p.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                   help="sampler KV slots (default: auto; fewer than the rollout needs: preemption)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences decoded together "
                   "(default: the sampler's; fewer than prompts x n: continuous batching)")
    p.add_argument("--rollouts", metavar="FILE", help="another engine's rollouts (.jsonl / .parquet / .pt, "
                   "docs/diagnostics.md): recompute them with the learner instead of sampling")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args) -> int:
    check_device(args.device)
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.model:
        from minite.models import load_pretrained

        source = load_pretrained(args.model, recipe=args.learner_recipe, dtype=dtype, device=args.device)
    else:
        source = model_preset(args.preset, args.layers)
        dtype = dtype or (torch.bfloat16 if str(args.device).startswith("cuda") else torch.float32)
    if args.rollouts:
        return _run_rollouts(args, source, dtype)
    vocab = source.config.vocab_size if args.model else source.vocab_size
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    kw = {k: v for k, v in (("kv_cache_tokens", args.kv_cache_tokens), ("max_num_seqs", args.max_num_seqs))
          if v is not None}
    learner = get_recipe(args.learner_recipe, kv_cache=args.kv_cache).with_execution(backend=args.backend)
    sampler = get_recipe(args.sampler_recipe or args.learner_recipe, kv_cache=args.kv_cache).with_execution(
        backend=args.backend)
    report = measure_agreement(source, prompts, params, learner, sampler,
                               init_std=args.init_std, seed=args.seed, dtype=dtype, device=args.device,
                               sampler_kwargs=kw)
    report["model"] = args.model or f"{args.preset}" + (f" ({args.layers} layers)" if args.layers else "")
    return _emit(report, args.json)


def _run_rollouts(args, source, dtype) -> int:
    """`--rollouts`: the file's tokens and log-probs against the learner recipe's recomputation."""
    from minite.diagnostics.agreement import rollout_agreement
    from minite.diagnostics.rollouts import check_vocab, read_rollouts, temperature_of

    rollouts = read_rollouts(args.rollouts)
    if not args.model:  # a preset: random weights of that shape
        from minite.models import Qwen3

        model = Qwen3(source, args.learner_recipe)
        model.init_weights(args.init_std, torch.Generator().manual_seed(args.seed))
        source = model.to(device=args.device, dtype=dtype)
    check_vocab(rollouts, source.config.vocab_size, args.rollouts)
    temperature = temperature_of(rollouts, args.temperature)
    learner = get_recipe(args.learner_recipe, kv_cache=args.kv_cache).with_execution(backend=args.backend)
    report = rollout_agreement(source, rollouts, learner, temperature, args.top_k, args.top_p)
    report["model"] = args.model or args.preset
    report["rollouts"] = args.rollouts
    return _emit(report, args.json)


def _emit(report: dict, as_json: bool) -> int:
    if as_json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        _print_table(report)
    return 0


def _print_table(r: dict) -> None:
    print(f"model {r['model']} ({r['dtype']}, {r['device']}): learner {r['learner_recipe']} vs sampler "
          f"{r['sampler_recipe']}, {r['num_samples']} samples, {int(r['n_tokens'])} tokens")
    rows = [("bitwise equal", f"{100 * r['bitwise_equal_frac']:.2f} %"),
            ("max |log-prob diff|", f"{r['logprob_abs_diff_max']:.3e}"),
            ("mean |log-prob diff|", f"{r['logprob_abs_diff_mean']:.3e}"),
            ("k3_kl", f"{r['k3_kl']:.3e}"), ("kl", f"{r['kl']:.3e}"),
            ("outside learner support", str(r["outside_learner_support"]))]
    for name, value in rows:
        print(f"  {name:26s} {value:>14s}")
    d = r.get("distribution")
    if d and d["n_positions"]:
        print(f"  over the file's top-k ({d['n_positions']} positions):")
        for k in ("topk_tv", "topk_kl", "topk_overlap", "top1_agree", "topk_mass_sampler",
                  "topk_mass_learner"):
            print(f"    {k:24s} {d[k]:>14.4g}")
