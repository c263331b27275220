"""Shared by the benchmarks: shapes, timing (do_bench, CUDA graphs, interleaved rounds), the environment
record, table and JSON output, and a profiler table. Imported as `benchmarks.common`; run the scripts
from the repository root as modules (`python -m benchmarks.ops.bench_gemm`)."""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch

# Measured on the H200 (docs/facts.md, "The GPU")
HBM_COPY_TBPS = 4.25
CUBLAS_BF16_TFLOPS = 743.0
DECODE_CEILING = 2.0 / (0.5 + 1.0 / 16.0)  # bf16 bytes / NVFP4 bytes per weight = 3.56

# Qwen3-8B linear layers (N, K): the dense GEMM benchmarks' shapes
QWEN3_8B = {"q|o": (4096, 4096), "k|v": (1024, 4096), "qkv": (6144, 4096), "gate|up": (12288, 4096),
            "gate+up": (24576, 4096), "down": (4096, 12288)}
# Qwen3-30B-A3B experts: 128 experts, top-8, hidden 2048, expert intermediate 768
EXPERTS, TOP_K, MOE_HIDDEN, MOE_INTER = 128, 8, 2048, 768
MOE_OPS = {"gate|up": (2 * MOE_INTER, MOE_HIDDEN), "down": (MOE_HIDDEN, MOE_INTER)}
ROTATE_BYTES = 256 << 20  # bytes a graph's calls cycle through (> 5x the 50 MB L2: every call reads HBM)


def parse_args(default_out: str | None = None, argv=None):
    """The per-op benchmarks' common flags: --out (JSON file) and --quick (fewer shapes)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=default_out, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    return p.parse_args(argv)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def warm_up(seconds: float = 2.0) -> None:
    """Keep the GPU busy for a while first: an idle H200 sits at a low clock (345 MHz at the start of a
    call) and the first kernels timed after a pause ran up to 2.5x slow."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


def bench_ms(fn, warmup=25, rep=100) -> float:
    """Median milliseconds of fn() (CUDA events; L2 flushed between runs by triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def capture_graph(calls):
    """`calls` (a list of thunks) captured as one CUDA graph, after one warm (allocating) run."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_us(calls) -> float:
    """Microseconds per call of `calls` (a list of thunks) replayed as one CUDA graph."""
    return bench_ms(capture_graph(calls).replay, warmup=10, rep=60) * 1e3 / len(calls)


def copies(t: torch.Tensor, per_copy_bytes: int) -> list:
    """Enough clones of t (2 to 64) that a graph cycling through them reads ROTATE_BYTES from HBM."""
    n = max(2, min(64, -(-ROTATE_BYTES // per_copy_bytes)))
    return [t.clone() for _ in range(n)]


def paired_graph_us(variants: dict, rounds: int = 7, reps: int = 10) -> dict:
    """Microseconds per call of each variant ({name: list of thunks}, each captured as one CUDA graph),
    timed in `rounds` interleaved rounds (the order reversed every other round) so that every variant
    sees the same clock and power state: {name: [us per round]}. Take ratios between variants per
    round: an H200 running compute-bound kernels moves its clock between calls, so one variant timed
    long after another is noise (the same kernel read 0.85 and 1.01x cuBLAS in one call that way)."""
    graphs = {name: (capture_graph(calls), len(calls)) for name, calls in variants.items()}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            g, n = graphs[name]
            g.replay()
            start.record()
            for _ in range(reps):
                g.replay()
            end.record()
            end.synchronize()
            out[name].append(start.elapsed_time(end) * 1e3 / reps / n)
    return out


def ratio_stats(base: list, ours: list) -> tuple:
    """Per-round base / ours time ratios -> (median, min, max)."""
    r = sorted(b / o for b, o in zip(base, ours, strict=True))
    return r[len(r) // 2], r[0], r[-1]


def heavy(m: int, k: int, seed: int, device="cuda") -> torch.Tensor:
    """Heavy-tailed fp32 data (x^3 of a Gaussian, 0.1 % of it 50x larger): where the fp32 accumulation
    order of a GEMM changes bits."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device) ** 3
    return torch.where(torch.rand(m, k, generator=g, device=device) < 0.001, 50 * x, x)


def env_info() -> dict:
    """GPU, date, commit (GIT_COMMIT, else `git rev-parse HEAD`), torch and triton versions, argv."""
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
            commit = out.stdout.strip() if out.returncode == 0 else "unknown (no git; set GIT_COMMIT)"
        except OSError:
            commit = "unknown (no git; set GIT_COMMIT)"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return dict(gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                commit=commit, torch=torch.__version__, triton=triton_version,
                argv=" ".join(os.path.relpath(a) if os.path.isabs(a) else a for a in sys.argv))


def write_json(out: str, doc: dict) -> None:
    """doc with the environment record added, written to `out`."""
    with open(out, "w") as f:
        json.dump(dict(doc, env=env_info()), f, indent=1)


def report(name: str, rows: list[dict], out: str | None, extra: dict | None = None) -> None:
    """Print rows as a table and, with out, write {benchmark, env, rows, extra} as JSON (and a JSON line)."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    width = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols}
    print(f"\n== {name}")
    print("  ".join(c.rjust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(width[c]) for c in cols))
    if out is None:
        return
    write_json(out, dict(benchmark=name, rows=rows, **(extra or {})))
    print(json.dumps(dict(benchmark=name, out=out, n_rows=len(rows))))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def profile_table(fn, reps: int = 1, top: int = 40) -> list[dict]:
    """torch.profiler over `reps` calls of fn(): the ops (CPU) or kernels (CUDA) with the most self
    time, per call and as a share of the total; then two summary rows, "(all kernels)" (the sum over
    every kernel, not only the top ones) and "(wall)" (the profiled wall time: more than the sum means
    the GPU idled, waiting for the host). Keep CUDA graph replays out of fn."""
    cuda = torch.cuda.is_available()
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CUDA] if cuda else [act.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        wall_us = (time.perf_counter() - start) * 1e6
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    total = sum(getattr(e, attr) for e in events)
    events.sort(key=lambda e: -getattr(e, attr))
    rows = [dict(name=e.key[:120], calls=e.count / reps, us=getattr(e, attr) / reps,
                 share=getattr(e, attr) / total) for e in events[:top]]
    calls = sum(e.count for e in events) / reps
    rows.append(dict(name="(all kernels)" if cuda else "(all ops)", calls=calls, us=total / reps, share=1.0))
    rows.append(dict(name="(wall)", calls=1.0, us=wall_us / reps, share=wall_us / max(total, 1e-9)))
    return rows


def print_profile(title: str, rows: list[dict]) -> None:
    print(f"\n-- {title}")
    for r in rows:
        print(f"{100 * r['share']:6.1f}%  {r['us']:10.1f} us  {r['calls']:6.1f} x  {r['name']}")


def cprofile_top(stats, key: str, top: int = 30, calls: int = 1) -> list[dict]:
    """The `top` functions of a pstats.Stats sorted by `key` ("tottime" / "cumulative"), per call of
    the profiled thunk (`calls` of them): own and total host microseconds."""
    stats.sort_stats(key)
    rows = []
    for func in stats.fcn_list[:top]:
        _, nc, tt, ct, _ = stats.stats[func]
        rows.append(dict(function=f"{func[0].split('site-packages/')[-1]}:{func[1]}({func[2]})",
                         calls=nc / calls, tottime_us=tt / calls * 1e6, cumtime_us=ct / calls * 1e6))
    return rows
