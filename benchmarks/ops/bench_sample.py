"""The sampler's draw: the Triton inverse-CDF kernel against the torch reference (exp, cumsum,
searchsorted), alone and inside `sampler.sample.sample`, against the same step in torch
(`processed_logprobs` of the bf16 logits, the reference draw, a gather): the default path draws
straight from the logits with the row's log-sum-exp (`minite.nn.token_logprobs`).

Shapes: a rollout decode step's rows (64 and 512 sequences) over Qwen3's 151936 ids. CUDA graphs over
2 input copies, interleaved rounds (`benchmarks.common.paired_graph_us`). The kernel reads the fp32
log-probs once (4 bytes an element): `frac_copy` is that against a device copy of them (8 bytes).

    python -m benchmarks.ops.bench_sample --out OUT.json [--quick]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
from statistics import median

import torch

from benchmarks.common import paired_graph_us, parse_args, ratio_stats, report, warm_up
from minite.kernels import sample as ks
from minite.ref.sample import draw as reference
from minite.sampler import sample as sampler_sample
from minite.sampler.rng import uniforms
from minite.sampling import SamplingParams, processed_logprobs

SHAPES = [(64, 151936), (512, 151936)]
COPIES = 2


def torch_sample(logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's draw in torch: the distribution's log-probs, the reference draw, a gather."""
    logp = processed_logprobs(logits, 1.0, 0, 1.0)
    tok = reference(logp, u)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def main():
    args = parse_args()
    warm_up()
    rows = []
    for b, v in SHAPES[1:] if args.quick else SHAPES:
        logits = [torch.randn(b, v, device="cuda").mul(4).to(torch.bfloat16) for _ in range(COPIES)]
        logps = [torch.log_softmax(z.float(), -1) for z in logits]
        keys, steps = torch.arange(b, device="cuda"), torch.full((b,), 7, device="cuda")
        u = uniforms(keys, steps)
        params = [SamplingParams(temperature=1.0)] * b
        variants = {
            "copy": [lambda x=x: x.clone() for x in logps],
            "draw, torch": [lambda x=x: reference(x, u) for x in logps],
            "draw": [lambda x=x: ks.draw(x, u) for x in logps],
            "sample, torch": [lambda z=z: torch_sample(z, u) for z in logits],
            "sample": [lambda z=z: sampler_sample.sample(z, params, keys, steps) for z in logits],
        }
        us = paired_graph_us(variants)
        n = b * v
        copy_us = median(us["copy"])
        same = (ks.draw(logps[0], u) == reference(logps[0], u)).float().mean().item()
        for name in variants:
            t = median(us[name])
            row = dict(shape=f"{b}x{v}", op=name, us=t)
            if name == "draw":
                row.update(frac_copy=(4 * n / t) / (8 * n / copy_us), same_token_frac=same)
                row["x_torch"] = ratio_stats(us["draw, torch"], us["draw"])[0]
            if name == "sample":
                row["x_torch"] = ratio_stats(us["sample, torch"], us["sample"])[0]
            rows.append(row)
    report("sampler draw", rows, args.out)


if __name__ == "__main__":
    main()
