"""Sweep of the row-scaled 1x16 quantize kernel's launch configuration (one GPU call), 16384 x 4096
bf16 (the issue's shape; session 4 also ran 4096 x 12288), for the pair kernel that 16-bit inputs take
(`minite/kernels/nvfp4_pairs.py`: words per program, warps) plus the general kernel as before. Every
candidate's codes, block scales and S_dec are compared bit for bit with the current configuration's;
throughput counts the input read once plus the outputs written once, as `bench_quantize.py` does,
against a device copy in the same process, all timed as CUDA graphs over 8 input copies (s7 run2's
do_bench rounds swung 2x from round to round).

Expectation written before the first run of the pair kernel (2026-11-30, session 4): the general
kernel runs ~25 instructions per element (SASS compiled on the CPU machine), the pair kernel ~17.5 at
one 4096-wide row per program (14 per element plus ~110 per program): 0.40 -> ~0.6 of the copy if
instruction issue is the bound; 0.85 would need ~12.7.

Session 7 (run1-run3) also tried, and dropped: E2M1 rounding with one min and two saturating fmas
instead of three mins (moves 128 of ~430 logic-pipe instructions a thread to the FMA pipe; exact for
every non-negative fp32, but codes 0.765 against 0.856 of the copy: 128 -> 166 registers), streaming
cache hints (0.834) and persistent programs looping over rows (0.56-0.63). Timing each candidate once
with do_bench swung 2x between rounds; CUDA graphs over 8 input copies agree to 0.2 % across rounds.
Codes and fused values now take their own words per thread (`VALUES_WORDS_PER_THREAD`).

    python benchmarks/sweep_quantize.py --out OUT.json
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse
import json

import torch
from bench_common import env_info, warm_up
from bench_decode_gemm import graph_us

from minite.kernels import nvfp4 as kq
from minite.kernels import nvfp4_pairs as kp

SHAPES = [(16384, 4096)]
GRID = dict(WORDS_WPT=[(2048, 32), (2048, 16), (2048, 8), (4096, 32), (4096, 16)])
ROUNDS = 3  # interleaved rounds over all candidates, the best of each: single timings have slow spells
INPUTS = 8  # timed as CUDA graphs over this many input copies (128 MiB each: never L2-resident)


def candidates():
    """(label, pair CONFIG or None for the general kernel): codes and values with the same words a
    thread."""
    yield "general kernel", None
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
        kp.ENABLED = cfg is not None
        kp.CONFIG.update(cfg or default)

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
                rows.append(dict(shape=f"{r}x{k}", kernel=label, **(cfg or {}), error=str(e)[:200]))
                continue
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(got[:3], want[:3]))
            same_vals = all(torch.equal(a, b) for a, b in zip(vals, want_vals))
            cands.append((dict(shape=f"{r}x{k}", kernel=label, **(cfg or {}), bitwise=same,
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
    kp.ENABLED = True
    for shape in {r["shape"] for r in rows}:
        ok = [r for r in rows if r["shape"] == shape and r.get("bitwise") and r.get("values_bitwise")]
        print(f"{shape}: best codes {max(ok, key=lambda r: r['frac_copy'])}")
        print(f"{shape}: best values {max(ok, key=lambda r: r['values_frac_copy'])}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(env=env_info(), grid=GRID, rounds=ROUNDS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
