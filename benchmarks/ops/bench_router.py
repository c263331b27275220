"""The MoE router's top-k routing (`kernels.router.route`, one launch) against torch's softmax, top-k,
sum, division and cast, on the router logits of a Qwen3-30B-A3B decode step (128 experts, top-8,
renormalized) at 64-1024 tokens; and the gate with it (`kernels.router.gate_route`, one launch)
against the gate as cuBLAS's bf16 linear followed by the routing kernel, each counting for the sort
as a MoE layer does (hidden 2048, each call its own gate weight, as the layers of a step). CUDA
graphs of several calls, interleaved rounds (`benchmarks.common.paired_graph_us`); the tensors are
tiny, so the times are launch and latency bound.

    python -m benchmarks.ops.bench_router --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
from statistics import median

import torch

from benchmarks.common import (
    EXPERTS,
    MOE_HIDDEN,
    TOP_K,
    paired_graph_us,
    parse_args,
    ratio_stats,
    report,
    warm_up,
)
from minite.kernels import router as kr

TOKENS = (64, 128, 256, 512, 1024)
CALLS = 8
GATES = 192  # gate weights a graph cycles through: 96 MB, twice the L2, as the layers of a step


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
    for t in TOKENS:
        xs = [torch.randn(t, MOE_HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(CALLS)]
        gs = [(torch.randn(EXPERTS, MOE_HIDDEN, device="cuda") / MOE_HIDDEN**0.5).to(torch.bfloat16)
              for _ in range(GATES)]
        pairs = [(xs[i % CALLS], g) for i, g in enumerate(gs)]
        times = paired_graph_us({
            "linear+kernel": [lambda x=x, g=g: kr.route(torch.nn.functional.linear(x, g), TOP_K, True, 128)
                              for x, g in pairs],
            "gate_route": [lambda x=x, g=g: kr.gate_route(x, g, TOP_K, True, 128) for x, g in pairs]})
        (_, ids, _), (logits, _, ids2, _) = (kr.route(xs[0] @ gs[0].t(), TOP_K, True, 128),
                                              kr.gate_route(xs[0], gs[0], TOP_K, True, 128))
        mid, lo, hi = ratio_stats(times["linear+kernel"], times["gate_route"])
        rows.append(dict(tokens=t, experts=EXPERTS, hidden=MOE_HIDDEN, top_k=TOP_K,
                         linear_and_kernel_us=median(times["linear+kernel"]),
                         gate_route_us=median(times["gate_route"]), speedup=mid, speedup_min=lo,
                         speedup_max=hi, same_ids_as_cublas_logits=torch.equal(ids, ids2),
                         max_logit_diff=(logits.float() - (xs[0] @ gs[0].t()).float()).abs().max().item()))
        print(rows[-1], flush=True)
    report("MoE router: one kernel vs torch's softmax / top-k / renormalize", rows, args.out)


if __name__ == "__main__":
    main()
