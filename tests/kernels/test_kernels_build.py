"""Built for the GPU on the CPU (sm_90, Triton's compiler and ptxas, no GPU needed). The kernels whose
helpers branch on the operand dtype build in every variant: decode attention for every operand dtype
and KV cache format, the q/k norm + RoPE with its cache stores for each operand dtype, the W4A4 GEMM
on packed weights for bf16 and fp16 activations (the compiler types every return of a helper alike,
constexpr branches included, which the interpreter does not check). The kernels the two engines
launch in different variants sum in one layout in each (docs/facts.md, "One build for both
engines"). In a process of its own: the tests' interpreter mode replaces the kernels by Python
functions."""


import pytest

from tests.kernels.test_decode_sass import _sass_tools, run_sass_tool


@pytest.mark.skipif(not _sass_tools(), reason="Triton's ptxas / nvdisasm not installed")
def test_dtype_branching_kernels_build_for_sm90():
    run = run_sass_tool("builds", check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": built") == 14, run.stdout


@pytest.mark.skipif(not _sass_tools(), reason="Triton's ptxas / nvdisasm not installed")
def test_engine_variants_sum_in_one_layout():
    """The kernels the learner and the sampler launch in different variants (the norm with or without
    the residual add, whole blocks of rows or not; the MoE gate split over programs at a decode step
    or not; attention on paged or packed keys, with or without the log-sum-exp) lay each sum out alike
    in every variant, so the engines' sums run in one order. Builds that broke this: the q/k norm with
    an fp8 cache store (q and k a last bit apart on an H100), the gate routing from the sum's registers
    (the softmax over the experts in the MMA's layout unsplit, a load's split)."""
    run = run_sass_tool("layouts", check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("one layout each") == 7, run.stdout
