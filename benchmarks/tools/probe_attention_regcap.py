"""Decode attention on quantized KV caches with the registers a thread capped (`maxnreg`), paired CUDA
graphs against each format's configuration in force: does more programs an SM shorten the kernel?

What to expect (the GPU machine's Triton 3.6, `sass_kernels attention` under it): the fp8 kernel
holds 248 registers a thread and 20.7 KB of shared memory, eight one-warp programs an SM. Capped at
168 registers (56 bytes of spills) shared memory allows ten: at 512 sequences x 8 kv heads (4096
programs, 132 SMs) still four waves, so little should move; with one stage as well (12.4 KB, 116
bytes of spills) twelve fit, three waves: up to ~25 % shorter if a chunk's latency holds without the
asynchronous copy. A cap or a stage count changes no arithmetic: every variant's output must equal
the configuration's bitwise (`bitwise` column).

    python -m benchmarks.tools.probe_attention_regcap --out OUT.json
"""

import argparse

import torch

from benchmarks.common import HBM_COPY_TBPS, paired_graph_us, report
from benchmarks.ops.bench_attention import HKV, HQ, D, decode_inputs, quantized_cache
from minite.kernels import attention as ka
from minite.ref.kv_quant import bytes_per_token

VARIANTS = {"in force": {}, "maxnreg 168": dict(maxnreg=168),
            "1 stage, maxnreg 168": dict(num_stages=1, maxnreg=168), "maxnreg 128": dict(maxnreg=128)}


def rows_for(B: int, T: int, kv_format: str) -> list[dict]:
    cache, tables, q, seq, pos, lens = decode_inputs(B, T)
    qc = quantized_cache(cache, kv_format)
    base = ka.config(torch.bfloat16, kv_format)
    tiles = ka.plan_tiles(seq, B, HQ // HKV, base["BLOCK_M"])

    def call(cfg):
        return lambda: ka.paged_attention(q, qc.k[0], qc.v[0], seq, pos, tables, lens, tiles=tiles, cfg=cfg)

    cfgs = {name: dict(base, **change) for name, change in VARIANTS.items()}
    want = call(base)()
    bitwise = {name: torch.equal(call(cfg)(), want) for name, cfg in cfgs.items()}
    us = paired_graph_us({name: [call(cfg)] for name, cfg in cfgs.items()})
    kv_bytes = B * T * bytes_per_token(kv_format, HKV, D, torch.bfloat16)
    rows = []
    for name, times in us.items():
        t = sorted(times)[len(times) // 2]
        ratios = sorted(a / b for a, b in zip(us["in force"], times))
        rows.append(dict(kv=kv_format, B=B, context=T, variant=name, us=t,
                         vs_in_force=ratios[len(ratios) // 2],
                         hbm_frac=kv_bytes / (t * 1e-6) / (HBM_COPY_TBPS * 1e12), bitwise=bitwise[name]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default="fp8,nvfp4")
    p.add_argument("--shapes", default="512x512,128x384", help="sequences x context")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        B, T = (int(x) for x in shape.split("x"))
        for fmt in args.formats.split(","):
            rows += rows_for(B, T, fmt)
    report("decode attention, registers capped (paired CUDA graphs)", rows, args.out)


if __name__ == "__main__":
    main()
