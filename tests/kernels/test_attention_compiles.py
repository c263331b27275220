"""The attention kernel builds for the GPU (sm_90, Triton's own compiler and ptxas, no GPU needed) for
every operand dtype and KV cache format, so a GPU-only compile error shows up on the CPU (fp16 / fp32
operands on quantized caches failed there once: a helper returned other dtypes in constexpr branches,
which the interpreter does not check). Run in a process of its own: the tests' interpreter mode
replaces the kernels by Python functions."""

import os
import subprocess
import sys

import pytest
import triton

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "nvdisasm")), reason="Triton without the CUDA tools")
def test_attention_builds_for_sm90_for_every_operand_dtype_and_kv_format():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.tools.sass_kernels", "attention_builds"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("built") == 9
