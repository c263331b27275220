"""Where the aligned linear's backward spends its host time: the NVFP4 Function's backward with its
pieces taken away one at a time (`_grads` replaced), host microseconds per forward + backward.

Session 13: a 1024 x 1024 aligned linear on 256 rows took ~810 us of host per forward + backward
against ~180 for bf16, and a custom Function whose Python backward runs the same two torch.mm ~170:
the NVFP4 backward's own pieces (two mm, a mul_, the dW row scale) add up to ~200 us, not ~575.
Since dd347cc a Linear whose S_dec is on the host takes the lean backward (`_dense_bf16_grads`); the
`_grads` variants run the general one (S_dec hidden from the host). Runs before dd347cc (s13 run3)
time the general one in every row; run5's variant rows timed the lean one whatever `_grads` was.

    python benchmarks/probe_backward_host.py --out OUT.json
"""

import argparse
import sys
import threading

import torch
from bench_common import report
from probe_linear_host import K, M, N, host_us, linear_step

from minite.nn import nvfp4_matmul as nm
from minite.nn import refresh_quantized_weights
from minite.nn.linear import Linear
from minite.nn.quantized_weight import QuantizedWeight
from minite.recipe import get_recipe


def grads_bare(ctx, dy, wu, ws, saved, host_ws=None):
    xu, _ = saved
    return torch.mm(dy[0], wu[0]).unsqueeze(0), torch.mm(dy[0].t(), xu[0]).unsqueeze(0)


def grads_mul(ctx, dy, wu, ws, saved, host_ws=None):
    dx, dw = grads_bare(ctx, dy, wu, ws, saved)
    dx.mul_(0.5)
    return dx, dw


def grads_scale_torch(ctx, dy, wu, ws, saved, host_ws=None):
    xu, xs = saved
    dx = torch.mm(dy[0], wu[0]).unsqueeze(0)
    dyx = torch.mul(dy, xs, out=torch.empty_like(dy))
    return dx, torch.mm(dyx[0].t(), xu[0]).unsqueeze(0)


def grads_scale_kernel(ctx, dy, wu, ws, saved, host_ws=None):
    xu, xs = saved
    dx = torch.mm(dy[0], wu[0]).unsqueeze(0)
    dyx = nm._scale_bf16(dy, xs)
    return dx, torch.mm(dyx[0].t(), xu[0]).unsqueeze(0)


class _SevenArgs(torch.autograd.Function):
    """The NVFP4 Function's signature (x, weight, then five non-tensor arguments) around F.linear and
    a two-mm backward: what the autograd machinery costs with our arguments."""

    @staticmethod
    def forward(ctx, x, weight, qweight, recipe, static_scale, experts, fast):
        ctx.save_for_backward(x, weight)
        ctx.qweight, ctx.recipe = qweight, recipe
        return torch.nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy.matmul(w), dy.flatten(0, -2).t().mm(x.flatten(0, -2)), None, None, None, None, None


def trivial_forward(ctx, x, weight, qweight, recipe, static_scale, experts, fast):
    ctx.save_for_backward(x, weight)
    return torch.nn.functional.linear(x, weight)


def trivial_backward(ctx, dy):
    x, w = ctx.saved_tensors
    return dy.matmul(w), dy.flatten(0, -2).t().mm(x.flatten(0, -2)), None, None, None, None, None


VARIANTS = {"as is": None, "two mm only": grads_bare, "two mm + mul_": grads_mul,
            "two mm + torch.mul row scale": grads_scale_torch, "two mm + scale_rows": grads_scale_kernel}


def timed_sections(lin, x, g, calls: int = 300) -> dict:
    """Host us per forward + backward spent in each function of the aligned path (inclusive), measured
    by wrapping them with perf_counter (on whatever thread runs them: the backward's run on autograd's
    device thread)."""
    import time

    from minite.kernels import gemm as kg
    from minite.kernels import nvfp4 as kq
    from minite.kernels import nvfp4_pairs
    from minite.kernels import scale as ks

    totals: dict = {}

    def wrap(owner, name, label, static=False):
        real = getattr(owner, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                totals[label] = totals.get(label, 0.0) + time.perf_counter() - t0
        setattr(owner, name, staticmethod(timed) if static else timed)
        return lambda: setattr(owner, name, staticmethod(real) if static else real)

    targets = [(nm.NVFP4Matmul, "forward", "Function.forward", True),
               (nm.NVFP4Matmul, "backward", "Function.backward", True),
               (nm, "_grads", "_grads"), (nm, "_bmm", "_bmm"), (nm, "_scale_bf16", "_scale_bf16"),
               (nm, "_kernel_rows", "_kernel_rows"), (nm, "_quantize_rows", "_quantize_rows"),
               (nm, "_dense_kernel", "_dense_kernel"), (kq, "quantize_unscaled", "quantize_unscaled"),
               (kg, "w4a4_gemm", "w4a4_gemm"), (ks, "scale_rows", "scale_rows"),
               (nvfp4_pairs, "launch_kernel", "launch (quantizer)"), (kg, "launch_kernel", "launch (GEMM)"),
               (ks, "launch_kernel", "launch (scale_rows)"), (QuantizedWeight, "batched", "batched"),
               (lin, "quantized_weight", "Linear.quantized_weight"), (torch, "mm", "torch.mm")]
    undo = [wrap(*t) for t in targets]
    try:
        step = linear_step(lin, x, g)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        wall = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for u in undo:
            u()
    out = {"forward + backward (wrapped)": wall / calls * 1e6}
    out.update({k: v / calls * 1e6 for k, v in sorted(totals.items(), key=lambda kv: -kv[1])})
    for k, v in out.items():
        print(f"{v:9.1f} us  {k}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="also torch.profiler tables (CPU self time)")
    p.add_argument("--sections", action="store_true", help="also host us per call of the path's functions")
    args = p.parse_args()
    dev = "cuda"
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    lin = Linear(K, N, recipe=get_recipe("aligned", backend="triton"), dtype=torch.bfloat16, device=dev)
    bf16 = Linear(K, N, recipe="bf16", dtype=torch.bfloat16, device=dev)
    refresh_quantized_weights(lin)
    real = nm._grads
    rows = [dict(variant="bf16 linear", host_us=host_us(linear_step(bf16, x, g))),
            dict(variant="as is (the lean backward, `_dense_bf16_grads`)",
                 host_us=host_us(linear_step(lin, x, g)))]
    # the variants replace `_grads`, the general backward: with S_dec not on the host, which a Linear
    # takes since dd347cc only when the lean one does not apply
    lean_off = QuantizedWeight.host_global_scale
    QuantizedWeight.host_global_scale = lambda self: None
    try:
        for name, fn in VARIANTS.items():
            nm._grads = fn or real
            try:
                us = host_us(linear_step(lin, x, g))
                rows.append(dict(variant=f"general backward, {name}", host_us=us))
            finally:
                nm._grads = real
    finally:
        QuantizedWeight.host_global_scale = lean_off
    qw = lin.quantized_weight()
    rows.append(dict(variant="Function with our 7 arguments, F.linear + 2 mm", host_us=host_us(
        lambda: _SevenArgs.apply(x.reshape(1, M, K), lin.weight, qw, lin.recipe, None, None, False).backward(
            g.reshape(1, M, N)))))
    real_fwd, real_bwd = nm.NVFP4Matmul.forward, nm.NVFP4Matmul.backward
    nm.NVFP4Matmul.forward = staticmethod(trivial_forward)
    nm.NVFP4Matmul.backward = staticmethod(trivial_backward)
    try:
        rows.append(dict(variant="aligned Linear, Function bodies F.linear + 2 mm",
                         host_us=host_us(linear_step(lin, x, g))))
    finally:
        nm.NVFP4Matmul.forward, nm.NVFP4Matmul.backward = staticmethod(real_fwd), staticmethod(real_bwd)
    x.grad = lin.weight.grad = None
    rows.append(dict(variant="as is, grads set to None before each call",
                     host_us=host_us(lambda: (setattr(x, "grad", None), setattr(lin.weight, "grad", None),
                                              linear_step(lin, x, g)()))))
    rows.append(dict(variant="as is, x without grad", host_us=host_us(linear_step(lin, x.detach(), g))))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, lin_ in (("aligned", lin), ("bf16", bf16)):
            step = linear_step(lin_, x, g)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    step()
                torch.cuda.synchronize()
            print(f"== {name}: 50 linear forward + backward")
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                              max_name_column_width=70)
            print(table)
    sections = timed_sections(lin, x, g) if args.sections else None
    threads = [t.name for t in threading.enumerate()]
    report("aligned backward host us", rows, args.out,
           extra=dict(threads=threads, switch_interval=sys.getswitchinterval(), sections=sections))
    print("threads:", [t.name for t in threading.enumerate()], "switch interval", sys.getswitchinterval())


if __name__ == "__main__":
    main()
