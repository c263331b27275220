"""Host time of one linear layer's forward + backward, bf16 against NVFP4 `aligned`, and of its parts.

The dense learner step is close to host-bound (docs/performance.md): what an NVFP4 linear costs the
host is what the aligned step adds. This runs each piece many times on small shapes (the GPU never
the limit) and reports host microseconds per call (`host_us`: the time to enqueue, without
synchronizing), plus cProfile breakdowns.

    python -m benchmarks.tools.probe_linear_host --out OUT.json
"""

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
import triton

from benchmarks.common import cprofile_top, report
from minite.kernels import gemm as kg
from minite.kernels import nvfp4 as kq
from minite.kernels.scale import scale_rows
from minite.nn import refresh_quantized_weights
from minite.nn.forward_scope import forward_scope
from minite.nn.linear import Linear
from minite.recipe import get_recipe

M, K, N = 256, 1024, 1024
CALLS = 300


@triton.jit
def _empty_kernel(x_ptr):
    pass


def host_us(fn, calls: int = CALLS) -> float:
    """Host microseconds per call of fn (enqueue only; the device drained before and after)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def linear_step(lin, x, g):
    def run():
        with forward_scope():
            y = lin(x)
        y.backward(g)
    return run


class _MmBackward(torch.autograd.Function):
    """F.linear forward; a Python backward of `mms` torch.mm calls (dX, dW, then repeats of dX): what a
    custom Function's backward costs the host beside the GEMMs it launches."""

    @staticmethod
    def forward(ctx, x, w, mms):
        ctx.save_for_backward(x, w)
        ctx.mms = mms
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = torch.mm(dy, w)
        dw = torch.mm(dy.t(), x)
        for _ in range(ctx.mms - 2):
            torch.mm(dy, w)
        return dx, dw, None


def function_step(x, w, g, mms):
    def run():
        _MmBackward.apply(x, w, mms).backward(g)
    return run


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    recipes = {"bf16": "bf16", "aligned": get_recipe("aligned").with_execution(backend="triton")}
    lins = {name: Linear(K, N, recipe=r, dtype=torch.bfloat16, device=dev) for name, r in recipes.items()}
    xq = x.detach()
    a, sa = kq.quantize_unscaled(xq)
    qw = lins["aligned"].quantized_weight()
    w = qw.operand(torch.bfloat16)
    s_row = torch.rand(M, device=dev) + 0.5
    s_one = torch.tensor(0.75, device=dev)
    y = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    pieces = {
        "linear fwd+bwd bf16": linear_step(lins["bf16"], x, g),
        "linear fwd+bwd aligned": linear_step(lins["aligned"], x, g),
        "Function fwd+bwd, 2 mm in backward": function_step(x, lins["bf16"].weight, g, 2),
        "Function fwd+bwd, 12 mm in backward": function_step(x, lins["bf16"].weight, g, 12),
        "12 torch.mm": lambda: [torch.mm(g, lins["bf16"].weight) for _ in range(12)],
        "linear fwd bf16": lambda: lins["bf16"](x),
        "linear fwd aligned": lambda: lins["aligned"](x),
        "triton empty kernel": lambda: _empty_kernel[(1,)](xq),
        "torch add": lambda: torch.add(y, y, out=y),
        "torch matmul bf16": lambda: torch.matmul(xq, w.t()),
        "quantize_unscaled": lambda: kq.quantize_unscaled(xq),
        "w4a4_gemm aligned": lambda: kg.w4a4_gemm(a, sa, w, qw.global_scale, None, "sdec", torch.bfloat16,
                                                  "aligned"),
        "scale_rows per row": lambda: scale_rows(y, s_row, out=y),
        "scale_rows one scale": lambda: scale_rows(y, s_one, out=y),
        "mul_ python float": lambda: y.mul_(0.75),
        "torch.mul mixed out=bf16": lambda: torch.mul(y, s_row[:, None], out=y),
    }
    refresh_quantized_weights(lins["aligned"])  # as after an optimizer step: S_dec known on the host
    rows = []
    for name, fn in pieces.items():
        rows.append(dict(piece=name, host_us=host_us(fn)))
    profiles = {name: profile(pieces[name]) for name in PROFILED}
    report("probe_linear_host", rows, args.out, extra=dict(shape=dict(m=M, k=K, n=N), profiles=profiles))


PROFILED = ("linear fwd+bwd aligned", "scale_rows per row", "w4a4_gemm aligned", "quantize_unscaled")


def profile(fn, calls: int = 100, top: int = 25) -> list[dict]:
    """cProfile of `calls` calls of fn: the functions with the most own time, microseconds per call."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    rows = cprofile_top(pstats.Stats(prof), "tottime", top, calls)
    print(f"\n== cProfile: {fn.__name__ if hasattr(fn, '__name__') else fn}")
    for r in rows:
        print(f"{r['tottime_us']:8.1f} {r['cumtime_us']:8.1f} {r['calls']:5.1f}  {r['function']}")
    return rows


if __name__ == "__main__":
    main()
