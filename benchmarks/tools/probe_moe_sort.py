"""The MoE assignments' counting sort (`kernels.moe_sort`) at a decode step's sizes (32, 256 and 512
tokens at top-8 of 128 experts): each chunk size against torch's sort (the reference), its integers
checked equal, timed as CUDA graphs of 8 calls (microseconds a call).

    python -m benchmarks.tools.probe_moe_sort OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import json
import sys

import torch

from benchmarks.common import env_info, graph_us
from minite.kernels import moe_sort as km
from minite.ref import moe_sort as ref

EXPERTS, TOP_K = 128, 8
CHUNKS = (128, 64, 32)


def main():
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (32, 256, 512):
        ids = torch.stack([torch.randperm(EXPERTS, device="cuda", generator=g)[:TOP_K]
                           for _ in range(tokens)])
        want = ref.sort_by_expert(ids, EXPERTS)
        row = dict(tokens=tokens, assignments=ids.numel(),
                   torch_us=graph_us([lambda: ref.sort_by_expert(ids, EXPERTS)] * 8))
        for chunk in CHUNKS:
            got = km._sort(ids, EXPERTS, chunk)
            row[f"chunk{chunk}"] = dict(us=graph_us([lambda: km._sort(ids, EXPERTS, chunk)] * 8),
                                        same=all(torch.equal(a, b) for a, b in zip(got, want)))
        rows.append(row)
        print(row, flush=True)
    json.dump(dict(benchmark="MoE assignments' counting sort variants", rows=rows, env=env_info()),
              open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
