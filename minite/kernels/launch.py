"""Repeat launches of our Triton kernels without Triton's per-call argument binding.

The learner step is host-bound: on the H200 machines' hosts a launch through `kernel[grid](...)`
costs 9-16 us for an empty kernel, and our GEMM or quantizer call with its 15-20 arguments 80-100
us, wrapper included (`benchmarks/tools/probe_linear_host.py`), a good part of it Triton's per-call
binding: argument specialization, cache key, launch metadata. The direct path below saves ~20 us a
launch there (H200 at 0b8a53e: a dense learner step 1.10 s instead of 1.18).

`launch(kernel, grid, args, **meta)`: `args` are the kernel's leading runtime arguments in signature
order (tensors, ints, floats), `meta` its remaining (constexpr) parameters and launch options by
name. The first launch of a specialization goes through Triton, which compiles and returns the
compiled kernel; later launches with the same specialization call its launcher directly (the raw
launcher where the kernel needs no scratch memory, else Triton's launcher object). The key
covers everything Triton specializes on: each tensor's dtype and 16-byte alignment, each integer's
`== 1`, divisibility by 16 and 32/64-bit range, the other arguments' types, `meta`, the device.
Triton's own path runs under the interpreter, while launch hooks are installed (profilers), for
grids given as functions, argument types the key does not know, kernels that are not plain
`@triton.jit` functions. The launcher arguments are those of Triton 3.6
(`tests/kernels/test_launch.py` checks the results against Triton's own path on the GPU).
"""

from __future__ import annotations

import torch
import triton

from minite.kernels import interpreted

_COMPILED: dict = {}  # key -> (launch function, the constexpr values in signature order)
_I32 = (-(2**31), 2**31)
_CONSTANT_TYPES = (int, bool, float, str)


class _Declined(Exception):
    pass


def _decline(v):
    raise _Declined


def specialization_key(kernel, meta: dict, args: tuple, device: int):
    """The cache key of a launch (module docstring), None for argument types it does not cover. Runs
    on every launch, hence inline and flat."""
    lo, hi = _I32
    try:
        spec = [(v.dtype, v.data_ptr() % 16 == 0) if isinstance(v, torch.Tensor)
                else (v == 1, v % 16 == 0, lo <= v < hi, v >= 2**63) if type(v) is int
                else float if type(v) is float else _decline(v) for v in args]
    except _Declined:
        return None
    return (id(kernel), device, *spec, *meta.items())


def _hooks_installed() -> bool:
    rt = triton.knobs.runtime
    return bool(getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)) or \
        bool(getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook))


def _constexpr_tail(kernel, n_args: int, meta: dict):
    """The values of the kernel's parameters after the first n_args, in order, from meta; None when
    some parameter is missing there (Triton's own path fills defaults) or meta holds anything but
    plain constants (a tensor there would be kept alive by the cache)."""
    names = getattr(kernel, "arg_names", None)  # None: not a plain @triton.jit function (autotuner, ...)
    if names is None:
        return None
    names = names[n_args:]
    if any(name not in meta for name in names) or any(type(v) not in _CONSTANT_TYPES for v in meta.values()):
        return None
    return tuple(meta[name] for name in names)


def _direct(compiled):
    """A function (grid3, stream, args, tail) launching `compiled`: its raw launcher where the kernel
    needs no scratch memory, else Triton's launcher object (which allocates the scratch)."""
    runner, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    raw = getattr(runner, "launch", None)
    if raw is not None and getattr(runner, "global_scratch_size", 1) == 0 and \
            getattr(runner, "profile_scratch_size", 1) == 0:
        coop, pdl = runner.launch_cooperative_grid, runner.launch_pdl

        def run_raw(g, stream, args, tail):
            raw(g[0], g[1], g[2], stream, function, coop, pdl, None, None, packed, None, None, None, *args,
                *tail)
        return run_raw

    def run(g, stream, args, tail):
        runner(g[0], g[1], g[2], stream, function, packed, None, None, None, *args, *tail)
    return run


def launch(kernel, grid: tuple, args: tuple, **meta) -> None:
    """`kernel[grid](*args, **meta)`, the binding skipped after the first launch of a specialization."""
    if interpreted() or _hooks_installed() or callable(grid):
        kernel[grid](*args, **meta)
        return
    device = torch._C._cuda_getDevice()
    key = specialization_key(kernel, meta, args, device)
    hit = _COMPILED.get(key) if key is not None else None
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        tail = _constexpr_tail(kernel, len(args), meta)
        if key is not None and tail is not None:
            _COMPILED[key] = (_direct(compiled), tail)
        return
    run, tail = hit
    run((*grid, 1, 1), torch._C._cuda_getCurrentRawStream(device), args, tail)


# a row-wise kernel whose grid holds fewer programs than this takes fewer rows a program, or a shorter
# chain a program (two programs an SM on the H200's 132), only where a row's arithmetic stays as it
# was: a row max (the quantizers' amax) may be split otherwise, a row sum (the norm's) may not
MIN_ROW_PROGRAMS = 264


def cdiv(x: int, y: int) -> int:
    """`triton.cdiv` for host code: Triton 3.6 makes that a constexpr function, a few us a host call."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (the same values; 0 for n <= 0)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
