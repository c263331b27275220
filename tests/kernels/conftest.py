"""Kernel tests run real Triton kernels on CUDA and the Triton interpreter on the CPU.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is set here, when
this directory is collected and before the test modules import `minite.kernels.*`; only without CUDA,
so that GPU runs execute compiled kernels. The rest of the suite does not use Triton.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
