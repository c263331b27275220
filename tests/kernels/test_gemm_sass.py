"""The W4A4 GEMM kernels compiled for the H200 (sm_90) on a machine without a GPU: every aligned config,
alone and segmented (`gemm.gemm_segments`), compiles (the CPU interpreter accepts code that the GPU
compiler rejects: a helper returning a tuple from one branch did), runs wgmma in its main
loop, and the TMA kernels (the ones the GPU runs on aligned operands) do not spill registers (the
first segmented epilogue, with 64-bit offsets per element, spilled 2.8 KB a thread at 128 x 256)."""

import re

import pytest

from tests.kernels.test_decode_sass import _sass_tools, run_sass_tool

pytest.importorskip("triton")


@pytest.mark.skipif(not _sass_tools(), reason="Triton's ptxas / nvdisasm not installed")
def test_gemm_kernels_compile_for_sm90_without_spills():
    out = run_sass_tool("gemm", "--k", "2048").stdout
    rows = re.findall(r"gemm (\w+) (tma|pointer) segmented=(True|False): main loop HGMMA (\d+) \((.*)\)", out)
    assert len(rows) == 8, out
    for config, kernel, segmented, hgmma, ptxas in rows:
        assert int(hgmma) > 0, (config, kernel, segmented, out)
        if kernel == "tma" and ptxas:  # ptxas -v, where it runs
            assert "0 bytes spill stores" in ptxas, (config, segmented, ptxas)
