"""What one weight global scale per fused group (q/k/v, gate/up) costs, and what it buys (CPU).

`fused_scale="shared"` quantizes a fused group under its largest member's scale so that an export
serves exactly what the model computed (vLLM decodes a group with the largest of its members'
`weight_scale_2`). On tiny random-weight models (dense and MoE, a few seeds), tokens sampled by the
`aligned` sampler, log-probs compared on those tokens:

- quality: each variant against bf16 (`bf16` learner, the variant as sampler): k3_kl and mean
  |d log-prob|; the shared scale's cost is the difference between the two rows;
- served: a per-projection (`separate`) export as vLLM would decode it (each member's codes and block
  scales times the group's largest S_dec) against what the model computed, on its sampled tokens,
  both through the learner's forward: the mismatch the shared scale removes (0 for the shared
  export, checked here too).

"spread" scales k_proj by 3 and v_proj by 0.5 (and up_proj by 0.5) before quantizing: members of
different ranges, as trained models have; "same" keeps the random init (one std for all).

    python -m benchmarks.e2e.fused_scale_cost [--out results.json]
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from benchmarks.common import parse_args, report
from minite.diagnostics.agreement import measure_agreement, random_prompts
from minite.diagnostics.metrics import mismatch_metrics
from minite.learner import SequenceBatch, batch_logprobs
from minite.models import Qwen3, tiny_qwen3, tiny_qwen3_moe
from minite.nn.linear import SegmentedLinear
from minite.nn.pinned_weights import pin
from minite.recipe import get_recipe
from minite.sampler import Sampler
from minite.sampling import SamplingParams

PARAMS = SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=0)
SEEDS = (0, 1, 2)


def model_of(config, recipe, seed: int, spread: bool) -> Qwen3:
    model = Qwen3(config, recipe)
    model.init_weights(0.1, torch.Generator().manual_seed(seed))
    if spread:
        with torch.no_grad():
            for layer in model.layers:
                _, k, v = layer.self_attn.qkv_proj.segments()
                k.mul_(3.0)
                v.mul_(0.5)
                if not layer.is_moe:
                    layer.mlp.gate_up_proj.segments()[1].mul_(0.5)
    return model.eval()


def served_by_vllm(model: Qwen3) -> Qwen3:
    """A copy whose fused groups decode each segment's codes with the group's largest S_dec."""
    served = copy.deepcopy(model)
    for module in served.modules():
        if not isinstance(module, SegmentedLinear) or not module.recipe.fp4:
            continue
        qs = [qw.q for qw in module.quantized_weights()]
        top = max(qs, key=lambda q: float(q.global_scale))
        pin(module.weight, [replace(q, global_scale=top.global_scale, amax=top.amax) for q in qs])
        module.refresh_quantized_weight()
    return served


def gap(served: Qwen3, model: Qwen3, prompts) -> dict:
    """On tokens `model` samples, the served copy's log-probs against `model`'s, both recomputed by
    the learner's forward (so only the weights differ)."""
    outs = Sampler(model).generate(prompts, PARAMS)
    pairs = [(o.prompt_token_ids, s) for o in outs for s in o.samples]
    batch = SequenceBatch.from_samples([p for p, _ in pairs], [list(s.token_ids) for _, s in pairs],
                                       params=PARAMS)
    return mismatch_metrics(batch_logprobs(served, batch), batch_logprobs(model, batch), batch.mask())


def main(argv=None) -> None:
    args = parse_args(argv=argv)
    rows = []
    for kind, config in (("dense", tiny_qwen3()), ("moe", tiny_qwen3_moe())):
        for spread in (False, True):
            acc: dict[str, list[float]] = {}
            for seed in SEEDS:
                prompts = random_prompts(8, 12, config.vocab_size, seed)
                for fused in ("separate", "shared"):
                    recipe = get_recipe("aligned", fused_scale=fused)
                    model = model_of(config, recipe, seed, spread)
                    q = measure_agreement(model, prompts, PARAMS, learner_recipe="bf16",
                                          sampler_recipe=recipe)
                    acc.setdefault(f"{fused}_vs_bf16_k3", []).append(q["k3_kl"])
                    acc.setdefault(f"{fused}_vs_bf16_dlogp", []).append(q["logprob_abs_diff_mean"])
                    s = gap(served_by_vllm(model), model, prompts)
                    acc.setdefault(f"{fused}_served_k3", []).append(s["k3_kl"])
                    acc.setdefault(f"{fused}_served_dlogp", []).append(s["logprob_abs_diff_mean"])
            rows.append({"model": kind, "members": "spread" if spread else "same",
                         **{k: sum(v) / len(v) for k, v in acc.items()}})
    report("fused_scale_cost", rows, args.out, extra={"seeds": list(SEEDS), "params": str(PARAMS)})


if __name__ == "__main__":
    main()
