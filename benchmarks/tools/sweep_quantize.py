"""Sweep of the row-scaled 1x16 quantize kernel's launch configuration (one GPU call), 16384 x 4096
bf16, for the pair kernel that 16-bit inputs take (`minite/kernels/nvfp4/pairs.py`: words per
program, words a thread). Every candidate's codes, block scales and S_dec are compared bit for bit with
the current configuration's; throughput counts the input read once plus the outputs written once, as
`ops/bench_quantize.py` does, against a device copy in the same process, all timed as CUDA graphs
over 8 input copies (do_bench rounds swing up to 2x; the graphs agree to 0.2 % across rounds).

    python -m benchmarks.tools.sweep_quantize --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse
import json

import torch

from benchmarks.common import env_info, graph_us, warm_up
from minite.kernels import nvfp4 as kq
from minite.kernels.nvfp4 import pairs as kp

SHAPES = [(16384, 4096)]
GRID = dict(WORDS_WPT=[(2048, 32), (2048, 16), (2048, 8), (4096, 32), (4096, 16)])
ROUNDS = 3  # interleaved rounds over all candidates, the best of each: single timings have slow spells
INPUTS = 8  # timed as CUDA graphs over this many input copies (128 MiB each: never L2-resident)


def candidates():
    """(label, pair CONFIG): codes and values with the same words a thread."""
    for words, wpt in GRID["WORDS_WPT"]:
        yield "pairs", dict(kp.CONFIG, WORDS=words, WORDS_PER_THREAD=wpt, VALUES_WORDS_PER_THREAD=wpt)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    default = dict(kp.CONFIG)
    rows = []
    warm_up()

    def use(cfg):
        kp.CONFIG.update(cfg)

    for r, k in SHAPES:
        x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
        n = x.numel()
        nbytes = 2 * n + n // 2 + n // 16 + 8 * r
        vals_bytes = 4 * n + n // 16 + 4 * r
        use(default)
        want = kq.quantize_packed(x, "row")
        want_vals = kq.quantize_unscaled(x)
        cands = []
        for label, cfg in [("pairs (current)", default), *candidates()]:
            use(cfg)
            try:
                got = kq.quantize_packed(x, "row")
                vals = kq.quantize_unscaled(x)
            except Exception as e:  # a configuration Triton cannot build (registers, shared memory)
                rows.append(dict(shape=f"{r}x{k}", kernel=label, **cfg, error=str(e)[:200]))
                continue
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(got[:3], want[:3]))
            same_vals = all(torch.equal(a, b) for a, b in zip(vals, want_vals))
            cands.append((dict(shape=f"{r}x{k}", kernel=label, **cfg, bitwise=same,
                               values_bitwise=same_vals), cfg))
        xs = [x.clone() for _ in range(INPUTS)]
        copy, codes, values = [], [[] for _ in cands], [[] for _ in cands]
        for _ in range(ROUNDS):
            copy.append(graph_us([lambda xi=xi: xi.clone() for xi in xs]) / 1e3)
            for i, (_, cfg) in enumerate(cands):
                use(cfg)  # read while the graph is captured
                codes[i].append(graph_us([lambda xi=xi: kq.quantize_packed(xi, "row") for xi in xs]) / 1e3)
                values[i].append(graph_us([lambda xi=xi: kq.quantize_unscaled(xi) for xi in xs]) / 1e3)
        copy_tbps = 4 * n / min(copy) / 1e9
        for (row, _), c, v in zip(cands, codes, values):
            row.update(ms=min(c), ms_rounds=c, frac_copy=nbytes / min(c) / 1e9 / copy_tbps,
                       values_ms=min(v), values_ms_rounds=v,
                       values_frac_copy=vals_bytes / min(v) / 1e9 / copy_tbps, copy_tb_s=copy_tbps)
            rows.append(row)
            print(row, flush=True)
    use(default)
    for shape in {r["shape"] for r in rows}:
        ok = [r for r in rows if r["shape"] == shape and r.get("bitwise") and r.get("values_bitwise")]
        print(f"{shape}: best codes {max(ok, key=lambda r: r['frac_copy'])}")
        print(f"{shape}: best values {max(ok, key=lambda r: r['values_frac_copy'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env_info(), grid=GRID, rounds=ROUNDS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
