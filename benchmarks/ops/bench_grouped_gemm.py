"""MoE grouped W4A4 GEMM vs a bf16 grouped baseline (torch._grouped_mm, else a per-expert loop).

Qwen3-30B-A3B experts: 128 experts, top-8, hidden 2048, expert intermediate 768; gate|up is
N = 1536, K = 2048 and down N = 2048, K = 768, over tokens * 8 routed rows sorted by expert. With
`--sweep`, also a few tiles around the configs in use, each checked bitwise against `aligned`.

    python -m benchmarks.ops.bench_grouped_gemm --out OUT.json [--sweep]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import argparse

import torch

from benchmarks.common import EXPERTS, MOE_OPS, TOP_K, bench_ms, report
from minite.kernels import gemm as kg
from minite.kernels import grouped_gemm as gg
from minite.kernels import nvfp4 as kq

# tiles around the configs in use (`grouped_gemm.CONFIGS`): TMA, persistent (one or two programs per
# SM), loop nest flattened or not
SWEEP = [dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=s, TMA=True, PERSIST=p, FLATTEN=f)
         for s, p, f in ((3, 0, False), (4, 0, False), (3, 1, True), (4, 1, True), (4, 1, False))]
SWEEP += [dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=s, TMA=True, PERSIST=p, FLATTEN=True)
          for s, p in ((4, 0), (3, 2), (4, 1))]


def torch_grouped(a, w_t, offs_end):
    return torch._grouped_mm(a, w_t, offs=offs_end)


def loop_grouped(a, w, offsets):
    o = offsets.tolist()
    return torch.cat([a[o[e]:o[e + 1]] @ w[e].t() for e in range(EXPERTS)])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="JSON file to write")
    p.add_argument("--sweep", action="store_true", help="also time the tiles in SWEEP")
    args = p.parse_args()
    rows, sweep = [], []
    for tokens in (4096, 16384):
        logits = torch.randn(tokens, EXPERTS, device="cuda")
        experts = logits.topk(TOP_K, dim=-1).indices.reshape(-1)
        counts = torch.bincount(experts, minlength=EXPERTS)
        offsets = torch.zeros(EXPERTS + 1, dtype=torch.int32, device="cuda")
        offsets[1:] = counts.cumsum(0)
        t = tokens * TOP_K
        for op, (n, k) in MOE_OPS.items():
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
            sw = torch.empty(EXPERTS, device="cuda")
            wc = torch.empty_like(w)
            for e in range(EXPERTS):
                q = kq.quantize(w[e], "tensor")
                wc[e], sw[e] = kg.unscaled_copy(q), q.global_scale
            a, sa = kq.quantize_unscaled(x)
            w_t = w.transpose(-2, -1)
            try:
                torch_grouped(x, w_t, offsets[1:])
                base_name, base = "torch._grouped_mm", bench_ms(lambda: torch_grouped(x, w_t, offsets[1:]))
            except (RuntimeError, AttributeError) as err:
                print(f"torch._grouped_mm unavailable ({err}); baseline is a per-expert loop")
                base_name, base = "per-expert matmul loop", bench_ms(lambda: loop_grouped(x, w, offsets))
            flop = 2 * t * n * k
            row = dict(tokens=tokens, op=op, rows=t, N=n, K=k, baseline=base_name,
                       baseline_tflops=flop / base / 1e9)
            for cfg in ("prefill", "aligned"):
                g = bench_ms(lambda: gg.grouped_w4a4_gemm(a, sa, wc, sw, offsets, config=cfg))
                gq = bench_ms(lambda: gg.grouped_w4a4_gemm(*kq.quantize_unscaled(x), wc, sw, offsets,
                                                           config=cfg))
                row[f"{cfg}_tflops"] = flop / g / 1e9
                row[f"{cfg}_vs_base"] = base / g
                row[f"{cfg}+quant_vs_base"] = base / gq
            rows.append(row)
            ref = gg.grouped_w4a4_gemm(a, sa, wc, sw, offsets, config="aligned")
            for i, c in enumerate(SWEEP if args.sweep else []):
                try:
                    same = torch.equal(gg.grouped_w4a4_gemm(a, sa, wc, sw, offsets, config=c), ref)
                    g = bench_ms(lambda: gg.grouped_w4a4_gemm(a, sa, wc, sw, offsets, config=c))
                except Exception as err:  # a tile that does not fit (shared memory, registers)
                    sweep.append(dict(tokens=tokens, op=op, cfg=i, **c, error=str(err)[:200]))
                    continue
                sweep.append(dict(tokens=tokens, op=op, cfg=i, **c, tflops=flop / g / 1e9, vs_base=base / g,
                                  aligned_bits=same))
    if sweep:
        report("grouped config sweep", sweep, None)
    report("grouped gemm (MoE)", rows, args.out,
           dict(target="prefill >= 0.9x bf16 grouped baseline", configs=gg.CONFIGS, sweep=sweep))


if __name__ == "__main__":
    main()
