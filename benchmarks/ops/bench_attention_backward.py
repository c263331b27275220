"""The learner's attention backward on the H200: our Triton backward (`kernels.attention_backward`)
against torch's SDPA flash backward (bf16, the baseline measured in the same run) and against the
reference backward (`minite.nn.attention.varlen_attention` under autograd, fp32), at the learner
benchmark's shapes (16 sequences x 1024 tokens; Qwen3-1.7B heads 16 / 8 and Qwen3-30B-A3B 32 / 4,
head dim 128). Also a few launch configurations of the two kernels, each checked against the default.

    python -m benchmarks.ops.bench_attention_backward --out OUT.json [--quick]
"""

import argparse

import torch
import torch.nn.functional as F

from benchmarks.common import CUBLAS_BF16_TFLOPS, bench_ms, report, warm_up, write_json
from minite.kernels import attention_backward as bwd
from minite.kernels.attention import contiguous_attention, plan_tiles
from minite.nn.attention import varlen_attention

HEADS = {"qwen3-1.7b": (16, 8), "qwen3-30b-a3b": (32, 4)}
# (dq, dkdv) launch configurations tried beside the default: (BLOCK_M, BLOCK_N, num_warps, num_stages)
CANDIDATES = [((64, 64, 4, 2), (64, 64, 4, 2)), ((64, 64, 4, 3), (64, 64, 4, 3)),
              ((128, 64, 8, 2), (64, 128, 8, 2)), ((128, 32, 4, 2), (64, 64, 8, 2)),
              ((64, 64, 8, 2), (64, 64, 8, 2)), ((64, 32, 4, 3), (32, 64, 4, 3))]


def cfg_of(dq, dkdv) -> dict:
    keys = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
    return dict(dq=dict(zip(keys, dq)), dkdv=dict(zip(keys, dkdv)))


def flops(lens, hq, d) -> float:
    """Backward matmul FLOPs of causal attention: 5 products of 2 * D per visible (query, key, head)."""
    return 5 * 2 * d * hq * sum(t * (t + 1) / 2 for t in lens)


def bench_shape(name, hq, hkv, seqs, seq_len, d, quick) -> list[dict]:
    lens = [seq_len] * seqs
    n = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(n, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    grad = torch.randn(n, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    lengths = torch.tensor(lens, device="cuda")
    start = torch.cumsum(lengths, 0) - lengths
    cu = torch.cat([start, lengths[-1:] + start[-1:]])
    seq = torch.repeat_interleave(torch.arange(seqs, device="cuda"), lengths)
    pos = torch.arange(n, device="cuda") - start[seq]
    lse = torch.empty(n, hq, device="cuda", dtype=torch.float32)
    fwd = lambda: contiguous_attention(q, k, v, seq, pos, start, lengths, lse=lse)  # noqa: E731
    out = fwd()

    def ours(cfg=None):
        cfg = cfg or bwd.config(q.dtype)
        qt = plan_tiles(seq, seqs, hq // hkv, cfg["dq"]["BLOCK_M"])
        kt = plan_tiles(seq, seqs, 1, cfg["dkdv"]["BLOCK_N"])
        return lambda: bwd.contiguous_attention_backward(grad, q, k, v, out, lse, seq, pos, start, lengths,
                                                         q_tiles=qt, k_tiles=kt, cfg=cfg)

    # SDPA on [B, H, T, D] (equal lengths: the packed batch is a padded-free batch)
    qs, ks, vs = (t.view(seqs, seq_len, -1, d).transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    o_sdpa = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    g_sdpa = grad.view(seqs, seq_len, hq, d).transpose(1, 2)
    sdpa_bwd = lambda: torch.autograd.grad(o_sdpa, (qs, ks, vs), g_sdpa, retain_graph=True)  # noqa: E731
    sdpa_fwd = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
    fl = flops(lens, hq, d)
    rows = []

    def row(what, ms, base_ms=None, err=None):
        tflops = fl / ms / 1e9
        r = dict(shape=name, what=what, ms=ms, tflops=tflops, of_cublas_peak=tflops / CUBLAS_BF16_TFLOPS)
        if base_ms is not None:
            r["x_sdpa"] = base_ms / ms
        if err is not None:
            r["max_rel_rms_vs_default"] = err
        rows.append(r)
        return ms

    rounds = [(bench_ms(sdpa_bwd), bench_ms(ours())) for _ in range(3)]
    ratios = sorted(s / o for s, o in rounds)
    sdpa_ms, ours_ms = sorted(s for s, _ in rounds)[1], sorted(o for _, o in rounds)[1]
    row("sdpa flash backward (bf16)", sdpa_ms)
    row("ours backward", ours_ms, sdpa_ms)
    rows[-1]["x_sdpa_rounds"] = ratios
    f_ours, f_sdpa = bench_ms(fwd), bench_ms(sdpa_fwd)
    rows.append(dict(shape=name, what="forward, ours (with lse) / sdpa", ms=f_ours, sdpa_ms=f_sdpa,
                     x_sdpa=f_sdpa / f_ours, tflops=fl / 2.5 / f_ours / 1e9))
    if not quick:
        want = ours()()
        for dq, dkdv in CANDIDATES:
            cfg = cfg_of(dq, dkdv)
            try:
                got = ours(cfg)()
                err = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                          for a, b in zip(got, want))
                row(f"ours dq{dq} dkdv{dkdv}", bench_ms(ours(cfg)), sdpa_ms, err)
            except Exception as e:  # a tile that does not fit (shared memory, registers) is reported
                rows.append(dict(shape=name, what=f"ours dq{dq} dkdv{dkdv}", error=str(e)[:200]))
        # the reference backward: autograd through the fp32 reference attention
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]

        def reference():
            with torch.enable_grad():
                o = varlen_attention(*inputs, pos, cu)
                return torch.autograd.grad(o, inputs, grad)
        row("reference backward (fp32, autograd)", bench_ms(reference, warmup=2, rep=5), sdpa_ms)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="the default configuration only, no reference")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_backward needs CUDA")
    warm_up()
    rows = []
    for name, (hq, hkv) in HEADS.items():
        rows += bench_shape(name, hq, hkv, args.seqs, args.seq_len, 128, args.quick)
    report("attention backward (16 x 1024 tokens, causal, bf16)", rows, None)
    if args.out:
        write_json(args.out, dict(benchmark="attention_backward", default=bwd.config(), rows=rows))


if __name__ == "__main__":
    main()
