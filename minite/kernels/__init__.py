"""Triton kernels: the fast counterparts of `minite.ref` (same names, same arguments where one exists).

- `nvfp4.quantize_packed` / `nvfp4.quantize`: NVFP4 quantization, bitwise equal to the reference (RNE).
- `nvfp4.quantize_unscaled`: the fused activation form for the compute-bound GEMM (row scaling).
- `gemm.w4a4_gemm` / `gemm.nvfp4_gemm`: W4A4 GEMM (compute-bound and decode regimes, aligned config).
- `decode_gemm.decode_gemm`: the decode regime (M <= 64) on a weight in its decode layout
  (`decode_gemm.pack_weight`, made once per update); `aligned_decode_config` keeps the aligned K order.
- `grouped_gemm.grouped_w4a4_gemm`: MoE grouped GEMM over experts in one launch.
- `grouped_decode.grouped_decode_gemm`: MoE experts of a decode step on their decode layouts, aligned K
  order, one launch.
- `moe_combine.combine`: the MoE combine (gather, weight, sum over top-k) in one launch.
- `moe_sort.sort_by_expert`: a decode step's MoE assignments sorted by expert, a counting sort.
- `sample.draw` / `draw_from_logits`: the sampler's inverse-CDF token draw, one read of the row.
- `logprobs.row_lse` / `token_logprob_grad`: the plain distribution's log-sum-exp and gradient.

Nothing here imports Triton at package import time: `available()` says whether the kernels can run
(Triton importable and CUDA present, or the CPU interpreter requested with TRITON_INTERPRET=1).
"""

import functools
import importlib
import importlib.util
import os


@functools.cache
def interpreted() -> bool:
    """TRITON_INTERPRET=1 (read once: Triton itself reads it when the kernels are defined)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None  # ~30 us: asked once per layer call otherwise


def available() -> bool:
    if not _triton_importable():
        return False
    if interpreted():
        return True
    import torch

    return torch.cuda.is_available()


class _Lazy:
    """`lazy.gemm`, `lazy.norm`, ...: the kernel modules, imported on first use (a module-level import in
    `minite.nn` would import Triton); later reads are plain attribute lookups, cheaper than an import
    statement in every layer call (the learner step is host-bound)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        module = importlib.import_module(f"{__name__}.{name}")
        setattr(self, name, module)
        return module


lazy = _Lazy()
