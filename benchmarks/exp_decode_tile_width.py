"""Probe: the library's tiled decode layout at memory tiles 128 and 256 columns wide against session 9
run1's probe kernels (row-major `plain`, and `tiled` with tiles as wide as the K step). Call 2 of s9
measured the library (128-wide tiles) 10-12 % slower than `plain` on the BK 256 tiles while the probe's
BK-wide tiles were faster; same bytes per step, same SASS counts on the CPU. Same bits everywhere.

    python benchmarks/exp_decode_tile_width.py --out OUT.json
"""

# ruff: noqa: B023
import argparse
import json

import torch
from bench_common import env_info, warm_up
from bench_decode_gemm import SHAPES, copies, graph_us, operands
from exp_decode_compact import operands_for, variant_gemm

from minite.kernels import decode_gemm as kd


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="exp_decode_tile_width.json")
    args = p.parse_args()
    warm_up()
    rows = []
    for layer in ("q|o", "gate+up", "down"):
        n, k = SHAPES[layer]
        for m in (1, 32, 64):
            _, _, wq, a, sa = operands(n, k, m)
            cfg = kd.decode_config(m, n, k)
            row = dict(layer=layer, M=m, BK=cfg["BK"], split=cfg["SPLIT_K"])
            ref = None
            for width in (128, 256):
                kd.TILE_K = width
                dw = kd.pack_weight(wq.codes, wq.block_scales)
                got = kd.decode_gemm(a, sa, dw, wq.global_scale, out_dtype=torch.float32, config=cfg)
                ref = got if ref is None else ref
                row[f"lib{width}_same_bits"] = bool(torch.equal(got, ref))
                dws = [kd.DecodeWeight(c, dw.scales.clone(), dw.n) for c in copies(dw.codes, n * k * 5 // 8)]
                row[f"lib{width}_us"] = graph_us(
                    [lambda d=d: kd.decode_gemm(a, sa, d, wq.global_scale, config=cfg) for d in dws])
                del dws
            kd.TILE_K = 128
            flat = kd.DecodeWeight(*kd.pack_weight(wq.codes, wq.block_scales).rows(), n)
            for variant in ("plain", "tiled"):
                ops = operands_for(flat, cfg, variant)
                got = variant_gemm(a, sa, *ops, wq.global_scale, n, cfg, variant, torch.float32)
                row[variant + "_same_bits"] = bool(torch.equal(got, ref))
                sets = [(ops[0].clone(), ops[1].clone()) for _ in copies(ops[0][:1], n * k * 5 // 8)]
                row[variant + "_us"] = graph_us(
                    [lambda o=o: variant_gemm(a, sa, *o, wq.global_scale, n, cfg, variant) for o in sets])
                del sets
            rows.append(row)
            print({key: (round(v, 3) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(benchmark="decode tile-width probe", env=env_info(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
