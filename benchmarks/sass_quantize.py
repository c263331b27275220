"""SASS instruction counts of the quantize kernels, compiled for the H200 (sm_90) on a machine without
a GPU: `triton.compile` to a cubin, `nvdisasm` (shipped with Triton) to SASS, ptxas -v for registers
and spills. The per-element cost is the main body (the IEEE-division slow path, a subroutine that
normally never runs, excluded) over the elements one thread handles: the number to move before
spending GPU time (the pair kernel went from ~25 to 15.5 instructions per element this way).

    python benchmarks/sass_quantize.py            # pair kernel, codes and fused values, 4096-wide rows
"""

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minite.kernels import nvfp4_pairs as kp

SIGNATURE = {"w_ptr": "*i32", "codes_ptr": "*u8", "scales_ptr": "*u8", "vals_ptr": "*i32",
             "sdec_out_ptr": "*fp32", "amax_out_ptr": "*fp32", "gs_ptr": "*fp32", "R": "i32",
             "stride_wr": "i32", "rows_per_gs": "i32"}


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int, aligned=()) -> tuple[str, str]:
    """(SASS text, ptxas -v summary) of fn for sm_90; pointers and the `aligned` ints are declared
    16-divisible, as Triton's launcher specializes them at run time."""
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n].startswith("*") or n in aligned}
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        cubin, ptx = os.path.join(d, "k.cubin"), os.path.join(d, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", cubin], capture_output=True,
                              text=True, check=True).stdout
        v = subprocess.run([os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o",
                            os.devnull], capture_output=True, text=True).stderr
    summary = " ".join(line.split("info    : ")[-1].strip() for line in v.splitlines()
                       if "Used" in line or "spill" in line)
    return sass, summary


def main_body_ops(sass: str) -> collections.Counter:
    """Opcode counts up to the first subroutine (the division slow path)."""
    ops = collections.Counter()
    for line in sass.splitlines():
        if "slowpath:" in line:
            break
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    return ops


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=4096, help="row width (elements)")
    args = p.parse_args()
    kw = args.k // 2
    block_w = triton.next_power_of_2(kw)
    block_r = max(1, kp.CONFIG["WORDS"] // block_w)
    warps = max(1, block_r * block_w // (32 * kp.CONFIG["WORDS_PER_THREAD"]))
    per_thread = 2 * block_r * block_w // (32 * warps)
    for mode in ("codes", "values"):
        const = dict(KW=kw, GS=0, CHAIN=0, IN_BF16=True, WRITE_CODES=mode == "codes",
                     WRITE_VALUES=mode == "values", OUT_BF16=True, HW=True, EVEN=True,
                     BLOCK_R=block_r, BLOCK_W=block_w)
        sass, summary = compile_sass(kp._pairs_kernel, SIGNATURE, const, warps, aligned=("stride_wr",))
        ops = main_body_ops(sass)
        total = sum(ops.values())
        print(f"pair kernel, {mode}: {total} instructions for {per_thread} elements a thread = "
              f"{total / per_thread:.1f} per element ({summary})")
        print("   ", ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))


if __name__ == "__main__":
    main()
