"""Learner-vs-sampler agreement on sampled tokens, for any pair of recipes.

    report = measure_agreement(model_or_config, prompts, SamplingParams(n=4, max_tokens=32, seed=0),
                               learner_recipe="te", sampler_recipe="vllm")

1. Two views of one model, each under its own recipe, sharing the same (master) parameter tensors:
   when both recipes are equal the sampler runs the learner's very model object (colocated: the same
   `QuantizedWeight`s). A view whose recipe uses static activation scales (`vllm`) is calibrated
   first (`minite.nn.calibrate`, one high-precision forward per prompt).
2. The sampler view generates (`generate_fn(model, prompts, params)`, by default `minite.sampler`)
   and reports log mu of each sampled token.
3. The learner view recomputes log pi of the same tokens (`minite.learner.batch_logprobs`: packed,
   chunked, same temperature / top-k / top-p).
4. `minite.diagnostics.metrics.mismatch_metrics` on the response tokens: fraction bitwise equal,
   max and mean |log pi - log mu|, k3_kl, kl, ... Tokens the sampler drew under top-k / top-p that
   lie outside the learner's truncated support (log pi = -inf) are counted in
   `outside_learner_support` and left out of the metrics.

`rollout_agreement` does steps 3 and 4 on rollouts another engine sampled (a rollout file).

`generate_fn` returns one item per prompt, in prompt order, each with `.samples`, each sample with
`.token_ids` (list of ints) and `.logprobs` (fp32 [len(token_ids)]).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from minite.diagnostics.metrics import mismatch_metrics
from minite.learner import SequenceBatch, batch_logprobs
from minite.models import ModelConfig, Qwen3
from minite.nn.calibrate import calibrate
from minite.recipe import Recipe, get_recipe
from minite.sampling import SamplingParams

SUMMARY = ("bitwise_equal_frac", "logprob_abs_diff_max", "logprob_abs_diff_mean", "k3_kl", "kl", "n_tokens")

GenerateFn = Callable[[Qwen3, list[list[int]], SamplingParams], Sequence]

def recipe_view(model: Qwen3, recipe: str | Recipe) -> Qwen3:
    """`model` itself when it already runs `recipe`, else a second Qwen3 under `recipe` whose
    parameters are the very tensors of `model` (no copy)."""
    recipe = get_recipe(recipe)
    if model.recipe == recipe:
        return model
    with torch.device("meta"):
        view = Qwen3(model.config, recipe)
    view.load_state_dict(model.state_dict(keep_vars=True), assign=True)
    return view.train(model.training)


@torch.no_grad()
def calibrate_if_static(model: Qwen3, prompts: list[list[int]]) -> bool:
    """Calibrate static activation scales on the prompts when some layer needs them."""
    if not any(getattr(m, "recipe", None) is not None and m.recipe.fp4 and m.recipe.activation.scaling
               == "static" for m in model.modules()):
        return False
    device = model.embed_tokens.weight.device
    with calibrate(model):
        for p in prompts:
            model(torch.tensor([p], device=device))
    return True


def default_generate(model: Qwen3, prompts: list[list[int]], params: SamplingParams,
                     stats: dict | None = None, **sampler_kwargs):
    """The sampler's outputs in prompt order; `stats` receives its scheduling counts (preemptions,
    sequences decoded together)."""
    from minite.sampler import Sampler

    sampler = Sampler(model, **sampler_kwargs)
    outs = sampler.generate(prompts, params)
    if stats is not None:
        stats.update(preemptions=sampler.num_preemptions, max_num_seqs=sampler.scheduler.max_num_seqs)
    return sorted(outs, key=lambda o: o.index)


def random_prompts(num: int, length: int, vocab: int, seed: int = 0, low: int = 2) -> list[list[int]]:
    """Prompts of `length` random token ids in [low, vocab) (seeded)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (num, length), generator=g).tolist()


def measure_agreement(model_or_config: Qwen3 | ModelConfig, prompts: list[list[int]], params: SamplingParams,
                      learner_recipe: str | Recipe = "aligned", sampler_recipe: str | Recipe | None = None,
                      generate_fn: GenerateFn | None = None, init_std: float = 0.02, seed: int = 0,
                      dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                      micro_batch_tokens: int = 8192, sampler_kwargs: dict | None = None) -> dict:
    """Generate with the sampler view, recompute with the learner view, compare (module docstring).
    A config builds a random-weight model (N(0, init_std), seeded). Returns a JSON-able dict."""
    if isinstance(model_or_config, ModelConfig):
        with torch.device(device or "cpu"):
            model = Qwen3(model_or_config, learner_recipe)
        model.init_weights(init_std, torch.Generator().manual_seed(seed))
        model = model.to(device=device, dtype=dtype)
    else:
        model = model_or_config
    learner = recipe_view(model, learner_recipe)
    sampler = recipe_view(learner, learner_recipe if sampler_recipe is None else sampler_recipe)
    calibrated = [name for name, m in (("learner", learner), ("sampler", sampler))
                  if calibrate_if_static(m, prompts)]
    stats: dict = {}
    if generate_fn is None:
        generate_fn = lambda m, p, sp: default_generate(m, p, sp, stats, **(sampler_kwargs or {}))
    t0 = time.perf_counter()
    outs = generate_fn(sampler, prompts, params)
    t_generate = time.perf_counter() - t0
    if len(outs) != len(prompts):
        raise ValueError(f"generate_fn returned {len(outs)} results for {len(prompts)} prompts")
    pairs = [(p, s) for p, o in zip(prompts, outs) for s in o.samples]
    batch = SequenceBatch.from_samples([p for p, _ in pairs], [list(s.token_ids) for _, s in pairs],
                                       [s.logprobs for _, s in pairs], params=params)
    t0 = time.perf_counter()
    pi = batch_logprobs(learner, batch, micro_batch_tokens)
    t_learner = time.perf_counter() - t0
    mu = batch.sampler_logprobs.to(pi.device)
    mask = batch.mask(pi.device)
    # A token the sampler drew from its truncated (top-k / top-p) distribution may fall outside the
    # learner's: log pi = -inf. Such tokens are counted and left out of the metrics.
    outside = mask & ~torch.isfinite(pi)
    metrics = mismatch_metrics(pi, mu, mask & ~outside)
    param = next(model.parameters())
    return {"learner_recipe": learner.recipe.name, "sampler_recipe": sampler.recipe.name,
            "same_model_object": learner is sampler, "calibrated": calibrated,
            **{k: metrics[k] for k in SUMMARY},
            "outside_learner_support": int(outside.sum()), "num_prompts": len(prompts),
            "num_samples": len(pairs), "dtype": str(param.dtype).removeprefix("torch."),
            "device": str(param.device), "params": {"n": params.n, "temperature": params.temperature,
                                                    "top_k": params.top_k, "top_p": params.top_p,
                                                    "max_tokens": params.max_tokens, "seed": params.seed},
            "generate_s": t_generate, "learner_s": t_learner, "sampler_stats": stats, "metrics": metrics}


@torch.no_grad()
def rollout_agreement(model: Qwen3, rollouts: list, learner_recipe: str | Recipe = "aligned",
                      temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      micro_batch_tokens: int = 8192) -> dict:
    """Another engine's rollouts (`minite.diagnostics.rollouts`) recomputed by the learner view under
    `learner_recipe`: the token metrics of `measure_agreement` on the file's log-probs, plus the
    distribution metrics over top-k where the file has them (`minite.diagnostics.topk`)."""
    from minite.diagnostics.localize import Side
    from minite.diagnostics.topk import has_topk, learner_distributions, topk_metrics

    learner = recipe_view(model, learner_recipe)
    prompts = [list(p) for p in dict.fromkeys(tuple(r.prompt_token_ids) for r in rollouts)]
    calibrated = calibrate_if_static(learner, prompts)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    batch = SequenceBatch.from_samples([r.prompt_token_ids for r in rollouts],
                                       [r.response_token_ids for r in rollouts],
                                       [r.logprobs for r in rollouts], params=params)
    t0 = time.perf_counter()
    pi = batch_logprobs(learner, batch, micro_batch_tokens)
    t_learner = time.perf_counter() - t0
    mu, mask = batch.sampler_logprobs.to(pi.device), batch.mask(pi.device)
    outside = mask & ~torch.isfinite(pi)
    metrics = mismatch_metrics(pi, mu, mask & ~outside)
    param = next(model.parameters())
    report = {"learner_recipe": learner.recipe.name, "sampler_recipe": "rollouts",
              "calibrated": ["learner"] if calibrated else [], **{k: metrics[k] for k in SUMMARY},
              "outside_learner_support": int(outside.sum()), "num_prompts": len(prompts),
              "num_samples": len(rollouts), "dtype": str(param.dtype).removeprefix("torch."),
              "device": str(param.device), "learner_s": t_learner, "metrics": metrics,
              "params": {"temperature": temperature, "top_k": top_k, "top_p": top_p}}
    if has_topk(rollouts):
        dists = learner_distributions(learner, Side(learner.recipe, "packed"), rollouts, temperature, top_k,
                                      top_p)
        report["distribution"] = topk_metrics(dists, rollouts)
    return report
