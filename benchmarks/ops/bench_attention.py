"""Decode attention (one query per sequence) over a paged KV cache, Qwen3-1.7B heads (16 q / 8 kv,
head_dim 128), 512 sequences x context {512, 1024}:

- ours: `kernels.attention.paged_attention` (the batch-invariant config, keys read in place) on the
  bf16 cache, and `ours_fp8` / `ours_nvfp4` on the same keys and values quantized by the cache's
  formats (`Recipe.kv_cache`, `minite.ref.kv_quant`; one kernel, dequantized in registers);
- sdpa: torch SDPA on a contiguous padded bf16 cache [B, Hkv, T, D] with enable_gqa (the HF-like
  baseline);
- gather_ref: the reference, keys gathered into a padded copy + `minite.nn.attention.attention`.

Bandwidth: KV bytes read per format (B x T x `kv_quant.bytes_per_token`: bf16 4 x Hkv x D, fp8 2 x Hkv x
(D + 4), nvfp4 2 x Hkv x (D / 2 + D / 16 + 4)) / time, as a fraction of the 4.25 TB/s HBM copy rate
(docs/facts.md); `speedup_<fmt>_vs_bf16` is the bf16 kernel's time over the quantized one's,
`max_abs_<fmt>_vs_ref` the kernel against `minite.ref.attention` on the same quantized cache. Also: a
prefill row (causal, 8 x 1024 tokens) vs SDPA's flash path, and a small sweep of launch configs
(measurements only; the config in use stays CONFIGS["gpu"]). Whether sampler and learner agree through
the kernel is the GPU tests' and `minite agreement`'s job.

    python -m benchmarks.ops.bench_attention --out OUT.json [--quick]
"""

# ruff: noqa: B023  (lambdas are timed at once, inside the loop that binds them)
import torch
import torch.nn.functional as F
import triton

from benchmarks.common import HBM_COPY_TBPS, bench_ms, parse_args, report
from minite.kernels import attention as ka
from minite.nn.attention import attention
from minite.ref import attention as ref
from minite.ref.kv_quant import bytes_per_token
from minite.sampler.kv_cache import KVCache

HQ, HKV, D, BLOCK = 16, 8, 128, 16
KV_FORMATS = ("fp8", "nvfp4")
# launch configurations of the 64-key chunks the kernel's contract fixes (BLOCK_N = KV_BLOCK)
SWEEP = [dict(BLOCK_M=bm, BLOCK_N=64, num_warps=w, num_stages=st)
         for bm, w, st in ((16, 4, 2), (16, 4, 3), (16, 4, 4), (16, 2, 2), (16, 2, 3), (16, 8, 2), (32, 4, 2),
                           (64, 4, 3))]


def decode_inputs(B: int, T: int):
    """A shuffled paged cache holding B sequences of T keys; one query per sequence at position T - 1."""
    g = torch.Generator(device="cuda").manual_seed(0)
    W = T // BLOCK
    cache = KVCache(1, B * W, BLOCK, HKV, D, torch.bfloat16, "cuda")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    tables = torch.randperm(B * W, device="cuda", generator=g).view(B, W)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seq = torch.arange(B, device="cuda")
    pos = torch.full((B,), T - 1, device="cuda")
    lens = torch.full((B,), T, device="cuda")
    return cache, tables, q, seq, pos, lens


def quantized_cache(cache: KVCache, kv_format: str) -> KVCache:
    """`cache`'s keys and values in `kv_format`, quantized as the sampler's writes quantize them."""
    out = KVCache(1, cache.num_blocks, BLOCK, HKV, D, torch.bfloat16, "cuda", kv_format)
    slots = torch.arange((cache.num_blocks + 1) * BLOCK, device="cuda")
    out.write(0, slots, cache.k[0].flatten(0, 1), cache.v[0].flatten(0, 1))
    return out


def decode_rows(B: int, T: int, configs: list[dict]) -> tuple[list[dict], list[dict]]:
    cache, tables, q, seq, pos, lens = decode_inputs(B, T)
    kv_bytes = B * T * bytes_per_token("bf16", HKV, D, torch.bfloat16)

    def ours(cfg=None, c=cache):
        cfg = cfg or ka.CONFIGS["gpu"]
        tiles = ka.plan_tiles(seq, B, HQ // HKV, cfg["BLOCK_M"])  # once per forward, shared by all layers
        return lambda: ka.paged_attention(q, c.k[0], c.v[0], seq, pos, tables, lens, tiles=tiles, cfg=cfg)

    k_pad, v_pad = cache.gather(0, tables)  # [B, T, Hkv, D]
    k_sdpa, v_sdpa = k_pad.transpose(1, 2).contiguous(), v_pad.transpose(1, 2).contiguous()  # [B, Hkv, T, D]
    q_sdpa = q[:, :, None]  # [B, Hq, 1, D]
    sdpa = lambda: F.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)  # noqa: E731
    kpos = torch.arange(T, device="cuda").expand(B, T)

    def gather_ref():
        keys, values = cache.gather(0, tables)
        return attention(q[:, None], keys, values, pos[:, None], kpos)

    want = sdpa()[:, :, 0].float()
    err = (ours()().float() - want).abs().max().item()
    row = dict(B=B, context=T, kv_MB=kv_bytes / 2**20, max_abs_vs_sdpa=err)
    for name, fn in (("ours", ours()), ("sdpa", sdpa), ("gather_ref", gather_ref)):
        t = bench_ms(fn, warmup=5 if name == "gather_ref" else 25, rep=30 if name == "gather_ref" else 100)
        row[f"{name}_us"] = t * 1e3
        row[f"{name}_hbm_frac"] = kv_bytes / (t * 1e-3) / (HBM_COPY_TBPS * 1e12)
    row["speedup_vs_sdpa"] = row["sdpa_us"] / row["ours_us"]
    row["speedup_vs_gather_ref"] = row["gather_ref_us"] / row["ours_us"]
    bf16_out = ours()().float()
    for fmt in KV_FORMATS:
        qc = quantized_cache(cache, fmt)
        fmt_bytes = B * T * bytes_per_token(fmt, HKV, D, torch.bfloat16)
        fn = ours(c=qc)
        got = fn().float()
        want = ref.paged_attention(q, qc.k[0], qc.v[0], seq, pos, tables, lens).float()
        t = bench_ms(fn)
        row.update({f"kv_{fmt}_MB": fmt_bytes / 2**20, f"ours_{fmt}_us": t * 1e3,
                    f"ours_{fmt}_hbm_frac": fmt_bytes / (t * 1e-3) / (HBM_COPY_TBPS * 1e12),
                    f"speedup_{fmt}_vs_bf16": row["ours_us"] / (t * 1e3),
                    f"speedup_{fmt}_vs_sdpa": row["sdpa_us"] / (t * 1e3),
                    f"max_abs_{fmt}_vs_ref": (got - want).abs().max().item(),
                    f"max_abs_{fmt}_vs_bf16_kv": (got - bf16_out).abs().max().item()})
        del qc
    sweep = []
    for cfg in configs:
        try:
            t = bench_ms(ours(cfg))
        except triton.runtime.errors.OutOfResources:
            continue
        sweep.append(dict(regime="decode", B=B, context=T, **cfg, us=t * 1e3,
                          hbm_frac=kv_bytes / (t * 1e-3) / (HBM_COPY_TBPS * 1e12)))
    return [row], sweep


def prefill_rows(configs: list[dict], S: int = 8, T: int = 1024) -> tuple[list[dict], list[dict]]:
    """Causal prefill of S sequences of T tokens, packed (the learner's layout) vs SDPA causal."""
    g = torch.Generator(device="cuda").manual_seed(1)
    N = S * T
    q = torch.randn(N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seq = torch.arange(S, device="cuda").repeat_interleave(T)
    pos = torch.arange(T, device="cuda").repeat(S)
    start = torch.arange(0, N, T, device="cuda")
    lens = torch.full((S,), T, device="cuda")
    ours = lambda cfg=None: ka.contiguous_attention(q, k, v, seq, pos, start, lens, cfg=cfg)  # noqa: E731
    qs, ks, vs = (t.view(S, T, -1, D).transpose(1, 2) for t in (q, k, v))
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # noqa: E731
    flops = 4 * S * HQ * D * T * T / 2  # causal half of QK^T and PV
    err = (ours().float() - sdpa().transpose(1, 2).reshape(N, HQ, D).float()).abs().max().item()
    row = dict(S=S, T=T, max_abs_vs_sdpa=err)
    for name, fn in (("ours", ours), ("sdpa", sdpa)):
        t = bench_ms(fn)
        row[f"{name}_us"] = t * 1e3
        row[f"{name}_tflops"] = flops / (t * 1e-3) / 1e12
    sweep = []
    for cfg in configs:
        try:
            t = bench_ms(lambda: ours(cfg))
        except triton.runtime.errors.OutOfResources:
            continue
        sweep.append(dict(regime="prefill", S=S, T=T, **cfg, us=t * 1e3, tflops=flops / (t * 1e-3) / 1e12))
    return [row], sweep


def main():
    args = parse_args()
    rows, sweep = [], []
    configs = [] if args.quick else SWEEP
    for T in (512, 1024):
        r, s = decode_rows(512, T, configs)
        rows += r
        sweep += s
    prefill, psweep = prefill_rows(configs)
    report("attention prefill (packed, causal; ours includes planning its tiles)", prefill, None)
    report("attention config sweep (measurement only)", sweep + psweep, None)
    report("attention decode (512 seqs, Qwen3-1.7B heads; bf16, fp8 and nvfp4 KV)", rows, args.out,
           extra=dict(config=ka.CONFIGS["gpu"], prefill=prefill, sweep=sweep + psweep))


if __name__ == "__main__":
    main()
