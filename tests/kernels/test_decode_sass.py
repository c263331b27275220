"""The decode GEMM's main loop as compiled for the H200 (sm_90), on a machine without a GPU: its weight
operand stays in registers (no shared-memory round trip) and arrives in MMA register order (a few
ldmatrix-sized loads per K step, no gather), and it runs wgmma. A Triton upgrade or an edit that breaks
the layout's register match shows up here long before a GPU benchmark would show it: swapping two
of the layout's index digits (t and e) took the BK 256 loop from 11 to 39 shared-memory loads and
3.7 to 4.1 instructions per weight (Triton 3.6; Triton 3.9 compiles the same loop with 15 loads)."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _sass_tools() -> bool:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(bin_dir, tool)) for tool in ("ptxas", "nvdisasm"))


def run_sass_tool(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`benchmarks/tools/sass_kernels.py ARGS` in a process that compiles (no interpreter)."""
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}  # compile, not interpret
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root
    script = os.path.join(root, "benchmarks", "tools", "sass_kernels.py")
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, cwd=root,
                          timeout=900, check=check)


@pytest.mark.skipif(not _sass_tools(), reason="Triton's ptxas / nvdisasm not installed")
def test_decode_loop_keeps_its_weight_operand_in_registers():
    out = run_sass_tool("decode").stdout
    pattern = (r"decode M<=(\d+) \{'BM': \d+, 'BN': \d+, 'BK': (\d+)\}: "
               r".*?STS (\d+), LDS (\d+), HGMMA (\d+) \((.*)\)")
    loops = re.findall(pattern, out)
    assert [int(m) for m, *_ in loops] == [16, 32, 64], out
    for m, bk, sts, lds, hgmma, ptxas in loops:
        assert int(sts) == 0 and int(hgmma) > 0, (m, out)
        assert int(lds) <= int(bk) // 16 + 4, (m, out)  # about a load per 16 columns, plus the scales
        assert "0 bytes spill stores" in ptxas or not ptxas, (m, out)  # ptxas -v, where it runs


@pytest.mark.skipif(not _sass_tools(), reason="Triton's ptxas / nvdisasm not installed")
def test_grouped_decode_loop_keeps_its_weight_operand_in_registers():
    """The MoE grouped decode kernel (rows read through the sorted index, as the experts run) at
    each of its tiles: the same loop, no shared-memory stores, wgmma."""
    out = run_sass_tool("grouped").stdout
    loops = re.findall(r"grouped decode.*?STS (\d+), LDS (\d+), HGMMA (\d+)", out)
    assert len(loops) == 3, out
    assert all(int(sts) == 0 and int(hgmma) > 0 for sts, _, hgmma in loops), out
