"""`minite diagnose`: measure, localize, attribute and orient the learner-sampler gap of one model.

Steps: build the model (a tiny random preset, briefly trained on the task's worked solutions so that
it writes task-like text and earns some reward, or a Hugging Face directory); sample responses with
the sampler recipe (or, with --rollouts, take another engine's responses and log-probs from a file:
`minite.diagnostics.rollouts`; the sampler recipe then only sets the other side of localization and
attribution, whose residual is the engine's own share); compute the log-probs of the same tokens on
the learner path and the sampler path (`minite.diagnostics.localize.Side`); then the token metrics
(and, where the file has top-k log-probs, the distribution metrics over them), the per-op
localization, the knob attribution, the direction analysis (advantages from the task's rewards, or
the file's, group-normalized per prompt) and the report (`report.html`, `report.json`, PNGs under --out).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from minite.commands.args import nonnegative_int, positive_int
from minite.devices import check_device
from minite.diagnostics.attribution import attribute, format_table
from minite.diagnostics.direction import direction, heatmap_rows
from minite.diagnostics.localize import Sequences, Side, localize, prepare, recipe_of, side_logprobs
from minite.diagnostics.metrics import mismatch_metrics
from minite.diagnostics.report import write_report
from minite.diagnostics.rollouts import check_vocab, groups, read_rollouts, temperature_of
from minite.diagnostics.topk import has_topk, learner_distributions, topk_metrics
from minite.files import check_output_dir
from minite.models.presets import MODEL_PRESETS, model_preset
from minite.recipe import KV_CACHES, RECIPES, get_recipe
from minite.rl.advantages import group_advantages
from minite.rl.rewards import exact_match_reward
from minite.rl.tasks import Example
from minite.rl.triage import TriageConfig

HELP = "measure where and why learner and sampler disagree on the same tokens; write an HTML report"
TINY_PRESETS = ("tiny-qwen3", "tiny-qwen3-moe")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def add_parser(sub, name):
    p = sub.add_parser(name, help=HELP, description=HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(MODEL_PRESETS),
                     help="a random-weight model: tiny-* for the CPU, real shapes for a GPU")
    src.add_argument("--model", help="a Hugging Face Qwen3 / Qwen3-MoE model directory")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--task", choices=["arithmetic", "countdown"], default="arithmetic")
    prompts.add_argument("--prompts", help="text (one prompt per line) or JSONL (prompt[, answer])")
    prompts.add_argument("--rollouts", metavar="FILE", help="another engine's rollouts: tokens and log-probs "
                         "(.jsonl / .parquet / .pt, docs/diagnostics.md) to diagnose instead of sampling")
    p.add_argument("--learner-recipe", default="te", choices=list(RECIPES))
    p.add_argument("--sampler-recipe", default="vllm", choices=list(RECIPES))
    for side in ("learner", "sampler"):
        p.add_argument(f"--{side}-kv-cache", default="bf16", choices=list(KV_CACHES),
                       help=f"the {side} recipe's KV cache format (recipe.kv_cache)")
    p.add_argument("--learner-batching", default="packed", choices=["packed", "alone"])
    p.add_argument("--sampler-batching", default="alone", choices=["packed", "alone"],
                   help="batching of the sampler recipe's full forward (attribution's target side)")
    p.add_argument("--sampler-engine", default="engine", choices=["engine", "forward"],
                   help="log mu from minite.sampler's decode (engine) or the sampler side's full forward")
    p.add_argument("--out", default="diagnose_report", help="output directory")
    p.add_argument("--n-prompts", type=positive_int, default=8)
    p.add_argument("--samples", type=positive_int, default=4,
                   help="responses per prompt (the advantage group)")
    p.add_argument("--max-tokens", type=positive_int, default=24)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=nonnegative_int, default=None,
                   help="supervised steps on the task's solutions before diagnosing (default: 60 for a "
                        "preset with a task, else 0)")
    p.add_argument("--segment-len", type=positive_int, default=8, help="TRIAGE response segment length")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--layers", type=positive_int, help="override the preset's number of decoder layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print report.json instead of the summary")


def check_args(args) -> None:
    """What can be refused before any compute: the device, the output folder, the temperature."""
    check_device(args.device)
    check_output_dir(args.out)
    if args.temperature == 0:
        raise ValueError("--temperature 0: greedy (temperature 0) has one-hot distributions: the gap is "
                         "not defined; use temperature > 0")
    if not args.temperature > 0:  # negative or NaN
        raise ValueError(f"--temperature {args.temperature:g}: use temperature > 0")
    if args.prompts and not Path(args.prompts).is_file():
        raise FileNotFoundError(f"--prompts {args.prompts} does not exist")
    if args.rollouts and not Path(args.rollouts).is_file():
        raise FileNotFoundError(f"--rollouts {args.rollouts} does not exist")


def run(args) -> int:
    check_args(args)
    t0 = time.time()
    phases: dict[str, float] = {}

    def phase(name: str) -> None:  # progress on stderr; the phase times go into report.json
        phases[name] = round(time.time() - t0, 1)
        print(f"[{phases[name]:7.1f}s] {name}", file=sys.stderr, flush=True)

    phase("building the model")
    torch.manual_seed(args.seed)
    model, tok = _model(args)
    rollouts = read_rollouts(args.rollouts) if args.rollouts else None
    examples, task = _examples(args, tok) if rollouts is None else (None, None)
    default_steps = 60 if args.preset in TINY_PRESETS and task else 0
    steps = args.warmup_steps if args.warmup_steps is not None else default_steps
    if steps and task is None:
        raise ValueError("--warmup-steps trains on a task's solutions: not with --rollouts or --prompts")
    if steps:
        phase(f"warm start: {steps} supervised steps")
        _warm_start(model, tok, task, steps, args.seed)
    model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
    learner = Side(get_recipe(args.learner_recipe, kv_cache=args.learner_kv_cache), args.learner_batching)
    sampler = Side(get_recipe(args.sampler_recipe, kv_cache=args.sampler_kv_cache), args.sampler_batching)
    temperature = args.temperature
    if rollouts is None:
        prompts = [tok.encode(ex.prompt, add_bos=tok.bos_token_id is not None) for ex in examples]
    else:
        check_vocab(rollouts, model.config.vocab_size, args.rollouts)
        temperature = temperature_of(rollouts, args.temperature)
        prompts = [list(p) for p in dict.fromkeys(tuple(r.prompt_token_ids) for r in rollouts)]
    phase("quantizing the weights of both recipes")
    prepare(model, Sequences(prompts, [len(p) for p in prompts]), [learner, sampler])
    if rollouts is None:
        phase("sampling responses")
        seqs, engine_mu = _generate(model, sampler, prompts, args, tok.eos_token_id)
    else:
        seqs, engine_mu = _from_rollouts(rollouts)
    targets, mask = seqs.padded()

    phase("log-probs on both paths")
    forward_mu = side_logprobs(model, sampler, seqs, temperature)
    mu = forward_mu if engine_mu is None else engine_mu
    pi = side_logprobs(model, learner, seqs, temperature)
    gap = pi - mu
    vocab = tok.vocab_size if tok is not None else 0
    decode = lambda i: tok.decode([i]) if i < vocab else f"<{i}>"
    # Random-weight presets sample ids beyond the char tokenizer's vocabulary: show those as <id>.
    texts = [tok.decode(r) if max(r, default=0) < vocab else "".join(map(decode, r))
             for r in (s[p:] for s, p in zip(seqs.tokens, seqs.prompt_lens))]
    report = {"config": _config(args, model, steps, len(seqs.tokens), int(mask.sum()), temperature),
              "metrics": mismatch_metrics(pi, mu, mask)}
    if rollouts is not None and has_topk(rollouts):
        phase("distribution over the file's top-k")
        report["distribution"] = topk_metrics(learner_distributions(model, learner, rollouts, temperature),
                                              rollouts)
    phase("localization")
    report["localization"] = localize(model, learner, sampler, seqs).to_dict()
    phase("attribution")
    report["attribution"] = attribute(model, learner, sampler, seqs, sampler_logprobs=engine_mu,
                                      temperature=temperature).to_dict()
    if engine_mu is not None:
        report["sampler_path"] = {k: v for k, v in mismatch_metrics(forward_mu, engine_mu, mask).items()
                                  if k in ("k3_kl", "logprob_abs_diff_mean", "logprob_abs_diff_max",
                                           "bitwise_equal_frac")}
    adv = None
    if rollouts is not None and all(r.reward is not None for r in rollouts):
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        adv = _group_advantages(rewards, groups(rollouts))
        report["config"]["reward_mean"] = rewards.mean().item()
        report["direction"] = direction(gap, adv, mask, TriageConfig(segment_len=args.segment_len))
    elif rollouts is None and all(ex.answer is not None for ex in examples):
        rewards = torch.tensor([(task.reward if task else _exact)(t, ex)
                                for t, ex in zip(texts, [e for e in examples for _ in range(args.samples)])])
        adv = group_advantages(rewards, args.samples) if args.samples >= 2 else rewards - rewards.mean()
        report["config"]["reward_mean"] = rewards.mean().item()
        report["direction"] = direction(gap, adv, mask, TriageConfig(segment_len=args.segment_len))
    report["heatmap"] = heatmap_rows(gap, mask, targets, decode, adv)
    report["samples"] = texts[:8]
    if rollouts is not None:
        report["rollouts"] = args.rollouts
    phase("report")
    report["config"]["phase_start_seconds"] = phases
    paths = write_report(args.out, report, deltas=gap[mask])
    report["config"]["seconds"] = round(time.time() - t0, 1)
    if args.json:
        print(json.dumps(json.loads(paths["json"].read_text()), indent=1))
    else:
        _print_summary(report, paths)
    return 0


def _from_rollouts(rollouts) -> tuple[Sequences, torch.Tensor]:
    """The file's sequences and the engine's log mu [B, T] in `Sequences.padded` layout."""
    seqs = Sequences([r.prompt_token_ids + r.response_token_ids for r in rollouts],
                     [len(r.prompt_token_ids) for r in rollouts])
    mu = torch.zeros(seqs.padded()[0].shape)
    for i, r in enumerate(rollouts):
        p = len(r.prompt_token_ids)
        mu[i, p - 1: p - 1 + len(r.logprobs)] = torch.tensor(r.logprobs, dtype=torch.float32)
    return seqs, mu


def _group_advantages(rewards: torch.Tensor, group: list[int]) -> torch.Tensor:
    """Rewards centred on their prompt group's mean and scaled by its std (groups of any size; a group
    of one gets 0), as `group_advantages` does for equal groups."""
    adv = torch.zeros_like(rewards)
    ids = torch.tensor(group)
    for g in ids.unique():
        members = ids == g
        r = rewards[members]
        if r.numel() > 1:
            adv[members] = (r - r.mean()) / (r.std() + 1e-6)
    return adv


def _exact(text: str, ex: Example) -> float:
    return exact_match_reward(text, ex.answer)


def _model(args):
    from minite.models import Qwen3, load_pretrained
    from minite.rl.tokenizer import CharTokenizer, HFTokenizer

    if args.model:
        model = load_pretrained(args.model, recipe="bf16", dtype=torch.float32)
        if args.rollouts:  # token ids in, token ids out: a tokenizer only shows the text
            try:
                return model, HFTokenizer(args.model)
            except ValueError:
                return model, None
        return model, HFTokenizer(args.model)
    # Character prompts: their ids are valid in every preset's vocabulary.
    tok = CharTokenizer(unknown="replace")
    tiny = args.preset in TINY_PRESETS
    changes = {"vocab_size": tok.vocab_size} if tiny else {}
    config = model_preset(args.preset, args.layers, eos_token_id=tok.eos_token_id, **changes)
    with torch.device("cpu" if tiny else args.device):  # tiny presets warm-start on the CPU first
        model = Qwen3(config, recipe="bf16")
    model.init_weights(std=0.1 if tiny else 0.02, generator=torch.Generator().manual_seed(args.seed))
    return model, tok


def _examples(args, tok):
    from minite.rl.tasks import make_task

    if args.prompts:
        path = Path(args.prompts)
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        if path.suffix == ".jsonl":
            exs = [_jsonl_example(path, i, ln) for i, ln in enumerate(lines, 1)]
        else:
            exs = [Example(ln, None) for ln in lines]
        return exs[: args.n_prompts], None
    task = make_task(args.task, seed=args.seed, **({"worked": True} if args.task == "arithmetic" else {}))
    return task.batch("train", 0, args.n_prompts), task


def _jsonl_example(path: Path, number: int, line: str) -> Example:
    """One `{"prompt": ..., "answer": ...}` line; a bad one is named by file and (non-blank) line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} prompt {number} is not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"{path} prompt {number} needs a string field \"prompt\"")
    return Example(row["prompt"], row.get("answer"))


def _warm_start(model, tok, task, steps: int, seed: int, batch: int = 32) -> None:
    """A few supervised steps on prompt + worked solution + eos (loss on the solution), in bf16 numerics."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        exs = task.batch("train", 10_000 + (seed * steps + step) * batch, batch)
        seqs = [(tok.encode(e.prompt, add_bos=True), tok.encode(e.solution or e.answer, add_eos=True))
                for e in exs]
        s = Sequences([p + c for p, c in seqs], [len(p) for p, _ in seqs])
        targets, mask = s.padded()
        ids = torch.zeros(len(s.tokens), targets.shape[1], dtype=torch.long)
        for i, t in enumerate(s.tokens):
            ids[i, : len(t) - 1] = torch.tensor(t[:-1])
        logits = model(ids)
        loss = F.cross_entropy(logits[mask].float(), targets[mask])
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def _generate(model, side: Side, prompts: list[list[int]], args, eos: int):
    """`args.samples` responses per prompt under the sampler recipe, and the engine's log mu [B, T]
    (None with --sampler-engine forward: a plain sampling loop, full forward of all running
    sequences right-padded at each step; log mu is then the sampler side's full forward)."""
    with recipe_of(model, side):
        if args.sampler_engine == "engine":
            from minite.sampler import Sampler
            from minite.sampling import SamplingParams

            params = SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.max_tokens,
                                    stop_token_ids=(eos,), seed=args.seed)
            outs = Sampler(model).generate(prompts, params)
            samples = [(o.prompt_token_ids, s) for o in outs for s in o.samples]
            seqs = Sequences([p + list(s.token_ids) for p, s in samples], [len(p) for p, _ in samples])
            mu = torch.zeros(seqs.padded()[0].shape)
            for i, (p, s) in enumerate(samples):
                mu[i, len(p) - 1: len(p) - 1 + len(s.token_ids)] = s.logprobs.float().cpu()
            return seqs, mu
        gen = torch.Generator().manual_seed(args.seed)
        seqs = [list(p) for p in prompts for _ in range(args.samples)]
        lens = [len(s) for s in seqs]
        running = list(range(len(seqs)))
        for _ in range(args.max_tokens):
            if not running:
                break
            T = max(len(seqs[i]) for i in running)
            ids = torch.tensor([seqs[i] + [eos] * (T - len(seqs[i])) for i in running])
            last = torch.tensor([len(seqs[i]) - 1 for i in running])
            logits = model(ids)[torch.arange(len(running)), last].float()
            z = logits / args.temperature if args.temperature > 0 else logits * 1e9
            nxt = torch.multinomial(torch.softmax(z, -1), 1, generator=gen)[:, 0].tolist()
            for i, t in zip(running, nxt):
                seqs[i].append(t)
            running = [i for i, t in zip(running, nxt) if t != eos]
    return Sequences(seqs, lens), None


def _config(args, model, steps, n_seqs, n_tokens, temperature) -> dict:
    return {"model": args.model or args.preset, "prompts": args.rollouts or args.prompts or args.task,
            "learner": f"{args.learner_recipe}/{args.learner_batching}",
            "sampler": f"{args.sampler_recipe}/{args.sampler_batching}", "dtype": args.dtype,
            "layers": model.config.num_hidden_layers, "warmup_steps": steps, "sequences": n_seqs,
            "response_tokens": n_tokens, "temperature": temperature, "seed": args.seed}


def _print_summary(report: dict, paths: dict) -> None:
    c, m = report["config"], report["metrics"]
    print(f"minite diagnose: {c['model']} on {c['prompts']}, learner {c['learner']} vs sampler "
          f"{c['sampler']} ({c['sequences']} responses, {c['response_tokens']} tokens, {c['seconds']} s)")
    print("\ntoken-level mismatch")
    for k in ("kl", "k3_kl", "chi2_token", "ess", "logprob_abs_diff_mean", "logprob_abs_diff_max",
              "logprob_abs_diff_p99", "prob_abs_diff_mean", "bitwise_equal_frac"):
        print(f"  {k:24s} {m[k]:.4g}")
    if report.get("distribution", {}).get("n_positions"):
        d = report["distribution"]
        print(f"over the sampler's top-k ({d['n_positions']} positions): tv {d['topk_tv']:.4g}, kl terms "
              f"{d['topk_kl']:.4g}, overlap {d['topk_overlap']:.3f}, top-1 agree {d['top1_agree']:.3f}")
    loc = report["localization"]
    logits = next(o["rel_diff"] for o in loc["ops"] if o["op"] == "lm_head")
    print(f"\nlocalization: first divergent op {loc['first_divergent']}; logits rel diff {logits:.3g}")
    curve = [f"{o['rel_diff']:.3g}" for o in loc["ops"] if o["kind"] == "output"]
    print(f"  residual stream rel diff per layer: {' '.join(curve)}")
    routers = [o for o in loc["ops"] if o["kind"] == "router"]
    if routers:
        print("  router top-k sets equal: " + " ".join(f"{o['router_topk_same']:.2f}" for o in routers))
    from minite.diagnostics.attribution import Attribution

    a = report["attribution"]
    print("\nattribution\n" + format_table(Attribution(a["metric"], a["initial"], a["residual"], a["rows"])))
    if report.get("sampler_path"):
        s = report["sampler_path"]
        engine = "the rollout file's engine" if c["prompts"] == report.get("rollouts") else \
            "sampler engine (decode, KV cache)"
        print(f"  {engine} vs sampler recipe's full forward: bitwise equal "
              f"{s['bitwise_equal_frac']:.3f}, max |d log-prob| {s['logprob_abs_diff_max']:.3g}")
    d = report.get("direction")
    if d:
        print(f"\ndirection (reward mean {c['reward_mean']:.2f}): shares " + ", ".join(
            f"{n} {d[f'share_{n}']:.2f}" for n in ("amp_pos", "amp_neg", "contracting", "neutral"))
            + f"; M-/M+ {d['imbalance']:.3g}; tail concentration {d['tail_concentration']:.2f}")
    print(f"\nreport: {paths['html']}  (json and PNGs in {paths['html'].parent})")
