"""The sampler's draw: the Triton inverse-CDF kernel against the torch reference (exp, cumsum,
searchsorted), alone and inside `sampler.sample.sample`: torch throughout (log-softmax of the bf16
logits, draw, gather), the kernel draw on torch's log-probs, and the default (the row's log-sum-exp
and the draw straight from the logits, `minite.nn.token_logprobs`).

Shapes: a rollout decode step's rows (64 and 512 sequences) over Qwen3's 151936 ids. CUDA graphs over
2 input copies, interleaved rounds (`bench_common.paired_graph_us`). The kernel reads the fp32
log-probs once (4 bytes an element): `frac_copy` is that against a device copy of them (8 bytes).
Expected before the first run: the reference ~3 passes over [B, V] fp32 (~0.6 ms at 512 rows), the
kernel one read (~0.1 ms at 512 rows, 0.7-0.9 of the copy's bandwidth).
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
from statistics import median

import torch
from bench_common import paired_graph_us, parse_args, ratio_stats, report, warm_up, with_flag

from minite.kernels import sample as ks
from minite.nn import token_logprobs
from minite.ref.sample import draw as reference
from minite.sampler import sample as sampler_sample
from minite.sampler.rng import uniforms
from minite.sampling import SamplingParams

SHAPES = [(64, 151936), (512, 151936)]
COPIES = 2


def main():
    args = parse_args("benchmarks/results/kernels_sample.json")
    warm_up()
    rows = []
    for b, v in SHAPES[1:] if args.quick else SHAPES:
        logits = [torch.randn(b, v, device="cuda").mul(4).to(torch.bfloat16) for _ in range(COPIES)]
        logps = [torch.log_softmax(z.float(), -1) for z in logits]
        keys, steps = torch.arange(b, device="cuda"), torch.full((b,), 7, device="cuda")
        u = uniforms(keys, steps)
        params = [SamplingParams(temperature=1.0)] * b
        full = [lambda z=z: sampler_sample.sample(z, params, keys, steps) for z in logits]
        variants = {
            "copy": [lambda x=x: x.clone() for x in logps],
            "draw, torch": [lambda x=x: reference(x, u) for x in logps],
            "draw": [lambda x=x: ks.draw(x, u) for x in logps],
            "sample, torch draw": [with_flag(sampler_sample, "USE_KERNEL", False, f) for f in full],
            "sample, kernel draw on torch log-probs": [with_flag(token_logprobs, "USE_KERNEL", False, f)
                                                       for f in full],
            "sample": full,
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
                row["x_torch"] = ratio_stats(us["sample, torch draw"], us["sample"])[0]
            rows.append(row)
    report("sampler draw", rows, args.out)


if __name__ == "__main__":
    main()
