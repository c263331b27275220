"""The kernels whose helpers branch on the operand dtype build for the GPU (sm_90, Triton's compiler and
ptxas, no GPU needed): decode attention for every operand dtype and KV cache format, the q/k norm +
RoPE with its cache stores for each operand dtype, the W4A4 GEMM on packed weights for bf16 and fp16
activations. A GPU-only compile error shows up on the CPU: the
compiler types every return of a helper alike, constexpr branches included, which the interpreter
does not check (a helper returning fp16 in one branch and bf16 in another builds only there). In a
process of its own: the tests' interpreter mode replaces the kernels by Python functions."""


import pytest

from tests.kernels.test_decode_sass import _sass_tools, run_sass_tool


@pytest.mark.skipif(not _sass_tools(), reason="Triton's ptxas / nvdisasm not installed")
def test_dtype_branching_kernels_build_for_sm90():
    run = run_sass_tool("builds", check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": built") == 14, run.stdout
