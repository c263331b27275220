"""Attribution: how much of the learner-sampler gap each execution knob accounts for.

Start from a mismatched pair of execution paths (`Side`s, e.g. learner `te`/packed and sampler
`vllm`/alone). The sampler side stays fixed: its log-probs mu of the response tokens are the target.
Each knob, switched on the learner side to the sampler's setting, changes the learner's log-probs pi;
the gap is a mismatch metric of (pi, mu) over the response tokens (`k3_kl` by default, and
`logprob_abs_diff_mean` = mean |delta log-prob|, always reported). Two readings:

- in sequence: knobs switched cumulatively in `KNOBS` order; `closed` is the gap before the switch
  minus the gap after it; the closed amounts plus the residual add up to the initial gap.
- one at a time: only that knob switched from the initial learner side; `closed` = initial - after.

`closed_frac` divides by the initial gap. Knobs:

    activation_scale  recipe.activation.scaling (tensor / row / static)
    weight_block      recipe.weight.block (16x16 / 1x16)
    scale_chain       recipe.activation.chain and recipe.weight.chain (te / vllm / torchao)
    gemm_epilogue     recipe.epilogue (sdec / alpha / bf16_scalar)
    gemm_kernel       recipe.execution.backend (ref / triton)
    kv_cache          recipe.kv_cache (bf16 / fp8 / nvfp4): how attention stores keys and values
    batch_composition Side.batching (packed with the other sequences / each sequence alone)
    other_recipe      the remaining forward fields: fp4, rounding, hadamard, bf16 first/last layers,
                      fused-group scales
    attention_kernel  not available: both sides run the same attention (the Triton kernel on CUDA,
                      the reference elsewhere); the Side has no attention setting to switch yet
    sampler_path      not switchable: the learner has no decode path. When mu comes from the
                      sampler engine (decode with a paged KV cache), the residual after all switches
                      is the share of the sampler's execution path vs the sampler recipe's full forward

A knob whose setting is already equal on both sides is reported as `same` and closes nothing; one
that cannot be switched here is reported as `not available` with the reason, never emulated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minite import kernels
from minite.diagnostics.localize import Sequences, Side, prepare, side_logprobs
from minite.diagnostics.metrics import mismatch_metrics
from minite.recipe import QuantSpec


def _spec(spec: QuantSpec, **changes) -> QuantSpec:
    return QuantSpec(**{**spec.kwargs(), **changes})


def _act(a: Side, b: Side) -> Side:
    return a.replace(recipe=a.recipe.replace(activation=_spec(a.recipe.activation,
                                                              scaling=b.recipe.activation.scaling)))


def _block(a: Side, b: Side) -> Side:
    return a.replace(recipe=a.recipe.replace(weight=_spec(a.recipe.weight, block=b.recipe.weight.block)))


def _chain(a: Side, b: Side) -> Side:
    r = a.recipe
    return a.replace(recipe=r.replace(activation=_spec(r.activation, chain=b.recipe.activation.chain),
                                      weight=_spec(r.weight, chain=b.recipe.weight.chain)))


def _other(a: Side, b: Side) -> Side:
    r, o = a.recipe, b.recipe
    act = _spec(r.activation, rounding=o.activation.rounding, hadamard=o.activation.hadamard)
    wgt = _spec(r.weight, rounding=o.weight.rounding, hadamard=o.weight.hadamard)
    return a.replace(recipe=r.replace(fp4=o.fp4, activation=act, weight=wgt,
                                      bf16_first_layers=o.bf16_first_layers,
                                      bf16_last_layers=o.bf16_last_layers, fused_scale=o.fused_scale))


def _kernel_reason() -> str | None:
    if kernels.available():
        return None
    return "Triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"


@dataclass(frozen=True)
class Knob:
    name: str
    description: str
    apply: Callable[[Side, Side], Side] | None  # learner side with this knob taken from the sampler side
    unavailable: Callable[[], str | None] = lambda: None  # the reason it cannot be switched here


KNOBS = (
    Knob("activation_scale", "activation global-scale policy (tensor / row / static)", _act),
    Knob("weight_block", "weight block shape (16x16 / 1x16)", _block),
    Knob("scale_chain", "scale chain (te / vllm / torchao)", _chain),
    Knob("gemm_epilogue", "GEMM epilogue (sdec / alpha / bf16_scalar)", lambda a, b: a.replace(
        recipe=a.recipe.replace(epilogue=b.recipe.epilogue))),
    Knob("gemm_kernel", "GEMM kernel (ref / triton backend)", lambda a, b: a.replace(
        recipe=a.recipe.with_execution(backend=b.recipe.execution.backend)), _kernel_reason),
    Knob("kv_cache", "KV cache format (bf16 / fp8 / nvfp4)", lambda a, b: a.replace(
        recipe=a.recipe.replace(kv_cache=b.recipe.kv_cache))),
    Knob("batch_composition", "token computed with its batch (packed) or alone",
         lambda a, b: a.replace(batching=b.batching)),
    Knob("other_recipe", "fp4 on/off, rounding, Hadamard, bf16 first/last layers", _other),
    Knob("attention_kernel", "attention kernel", None,
         lambda: "both sides run the same attention (Triton kernel on CUDA, reference elsewhere)"),
    Knob("sampler_path", "sampler decode with KV cache vs full forward", None,
         lambda: "the learner has no decode path; the residual is this knob's share"),
)


def _gaps(pi: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    m = mismatch_metrics(pi, mu, mask)
    return {k: m[k] for k in ("k3_kl", "kl", "logprob_abs_diff_mean", "logprob_abs_diff_max",
                              "bitwise_equal_frac")}


@dataclass
class Attribution:
    metric: str
    initial: dict[str, float]
    residual: dict[str, float]
    rows: list[dict]  # one per knob, KNOBS order

    def to_dict(self) -> dict:
        return {"metric": self.metric, "initial": self.initial, "residual": self.residual, "rows": self.rows}


@torch.no_grad()
def attribute(model, learner: Side, sampler: Side, seqs: Sequences, metric: str = "k3_kl",
              sampler_logprobs: torch.Tensor | None = None, temperature: float = 1.0,
              knobs=KNOBS) -> Attribution:
    """Switch each knob of `learner` to `sampler`'s setting; see the module docstring.

    `sampler_logprobs` [B, T] (aligned with `seqs.padded()`): the target mu as the sampler reported it
    (e.g. from `minite.sampler`); by default the full forward of the `sampler` side.
    """
    _, mask = seqs.padded()
    candidates = [learner] + [k.apply(learner, sampler) for k in knobs if k.apply is not None]
    prepare(model, seqs, [sampler, *candidates])
    mu = side_logprobs(model, sampler, seqs, temperature) if sampler_logprobs is None else sampler_logprobs
    # Sides that differ only in their names compute the same numbers.
    key = lambda side: (side.recipe.replace(name=""), side.batching)
    cache = {key(sampler): _gaps(mu, mu, mask)} if sampler_logprobs is None else {}

    def gap(side: Side) -> dict[str, float]:
        if key(side) not in cache:
            cache[key(side)] = _gaps(side_logprobs(model, side, seqs, temperature), mu, mask)
        return cache[key(side)]

    initial = gap(learner)
    g0 = initial[metric]
    rows, current = [], learner
    for knob in knobs:
        row = {"knob": knob.name, "description": knob.description}
        reason = knob.unavailable()
        if knob.apply is None or reason is not None:
            rows.append({**row, "status": "not available", "reason": reason})
            continue
        switched = knob.apply(learner, sampler)
        if switched == learner and knob.apply(current, sampler) == current:
            rows.append({**row, "status": "same", "closed": 0.0, "closed_frac": 0.0,
                         "alone_closed": 0.0, "alone_closed_frac": 0.0, "gap_after": gap(current)[metric]})
            continue
        before, current = gap(current)[metric], knob.apply(current, sampler)
        after, alone = gap(current)[metric], gap(switched)[metric]
        rows.append({**row, "status": "switched", "from": _setting(knob, learner),
                     "to": _setting(knob, sampler), "gap_after": after, "closed": before - after,
                     "closed_frac": _frac(before - after, g0), "alone_closed": g0 - alone,
                     "alone_closed_frac": _frac(g0 - alone, g0),
                     "logprob_abs_diff_after": gap(current)["logprob_abs_diff_mean"]})
    return Attribution(metric, initial, gap(current), rows)


def _frac(x: float, total: float) -> float:
    return x / total if total > 0 else 0.0


def _setting(knob: Knob, side: Side) -> str:
    r = side.recipe
    return {
        "activation_scale": r.activation.scaling,
        "weight_block": "x".join(map(str, r.weight.block)),
        "scale_chain": f"{r.activation.chain}/{r.weight.chain}",
        "gemm_epilogue": r.epilogue,
        "gemm_kernel": r.execution.backend,
        "kv_cache": r.kv_cache,
        "batch_composition": side.batching,
        "other_recipe": f"fp4={r.fp4} rounding={r.activation.rounding}/{r.weight.rounding} "
                        f"hadamard={r.activation.hadamard}/{r.weight.hadamard} "
                        f"bf16_layers={r.bf16_first_layers}/{r.bf16_last_layers}",
    }[knob.name]


def format_table(att: Attribution) -> str:
    """A plain-text table of the attribution (sequence and one-at-a-time columns)."""
    lines = [f"gap ({att.metric}) learner vs sampler: initial {att.initial[att.metric]:.4g}, "
             f"after all switches {att.residual[att.metric]:.4g}",
             f"{'knob':18s} {'status':13s} {'from -> to':28s} {'closed (seq)':>13s} {'alone':>9s}"]
    for r in att.rows:
        if r["status"] == "switched":
            ft = f"{r['from']} -> {r['to']}"[:28]
            lines.append(f"{r['knob']:18s} {r['status']:13s} {ft:28s} {100 * r['closed_frac']:12.1f}% "
                         f"{100 * r['alone_closed_frac']:8.1f}%")
        else:
            lines.append(f"{r['knob']:18s} {r['status']:13s} {r.get('reason') or ''}")
    return "\n".join(lines)
