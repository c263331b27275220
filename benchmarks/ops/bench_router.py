"""The MoE router's top-k routing (`kernels.router.route`, one launch) against torch's softmax, top-k,
sum, division and cast, on the router logits of a Qwen3-30B-A3B decode step (128 experts, top-8,
renormalized) at 64-1024 tokens. CUDA graphs of several calls, interleaved rounds
(`benchmarks.common.paired_graph_us`); the logits are tiny, so the times are launch and latency bound.

    python -m benchmarks.ops.bench_router --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
from statistics import median

import torch

from benchmarks.common import EXPERTS, TOP_K, paired_graph_us, parse_args, ratio_stats, report, warm_up
from minite.kernels import router as kr

TOKENS = (64, 128, 256, 512, 1024)
CALLS = 8


def torch_route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, ids = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), TOP_K, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(logits.dtype), ids


def main():
    args = parse_args()
    warm_up()
    rows = []
    for t in TOKENS:
        xs = [torch.randn(t, EXPERTS, device="cuda").to(torch.bfloat16) for _ in range(CALLS)]
        times = paired_graph_us({"torch": [lambda x=x: torch_route(x) for x in xs],
                                 "kernel": [lambda x=x: kr.route(x, TOP_K, True) for x in xs]})
        (w, ids), (tw, tids) = kr.route(xs[0], TOP_K, True), torch_route(xs[0])
        same_logits = torch.equal(xs[0].gather(-1, ids), xs[0].gather(-1, tids))
        mid, lo, hi = ratio_stats(times["torch"], times["kernel"])
        rows.append(dict(tokens=t, experts=EXPERTS, top_k=TOP_K, torch_us=median(times["torch"]),
                         kernel_us=median(times["kernel"]), speedup=mid, speedup_min=lo, speedup_max=hi,
                         same_picked_logits=same_logits,
                         max_weight_diff=(w.float() - tw.float()).abs().max().item()))
        print(rows[-1], flush=True)
    report("MoE router: one kernel vs torch's softmax / top-k / renormalize", rows, args.out)


if __name__ == "__main__":
    main()
