"""Kernel tests run real Triton kernels on CUDA and the Triton interpreter on the CPU (tests/conftest.py
sets TRITON_INTERPRET=1 for the whole suite when there is no CUDA, before any kernel is defined)."""
