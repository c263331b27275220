"""How a model's numerics execute: one frozen value, carried by its recipe (`Recipe.execution`).

The recipe says which numbers a model computes; `Execution` says which code computes them. Every
choice of an engine's hot path reads it, nothing reads a module global:

- `backend`: the NVFP4 quantizer and GEMMs. `auto` (the default) runs the Triton kernels on CUDA
  where they cover the recipe and the reference elsewhere; `ref` always the reference; `triton` the
  kernels, also on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1).
- `elementwise`: the one-launch kernels of RMSNorm, RoPE, SwiGLU, the MoE combine and the plain
  distribution's log-probs and draw (`auto` / `ref` / `triton` as for `backend`).
- `attention` / `attention_backward`: the attention kernel (`auto` / `ref` / `triton`) and, where it
  runs, its backward (`kernel`: the Triton backward; `reference`: the reference math recomputed under
  autograd). `sdpa`: a cached step (the sampler's) through torch's `scaled_dot_product_attention`, a
  serving engine's arithmetic rather than the learner's (full sequences run the reference): with the
  `bf16` recipe, the fast unaligned bf16 sampler (`[sampler] engine = "fast"`).
- `fast`: give up the learner/sampler alignment for speed (M-dependent GEMM configs: the `decode`
  config on packed weights for M <= 64, `prefill` above).
- `decode_max_m`: at most this many rows, an aligned dense GEMM reads the packed weight in the
  decode layout instead of the bf16 copy (the same bits; 0: never); `decode_max_rows_per_expert`:
  the same for MoE experts, in rows per expert on average.
  A weight in the sampler form (`minite.nn.sampler_weights`: no bf16 copy kept) reads its decode
  layout at every row count, in row tiles, the same bits (docs/memory.md).
- `fused_projections`: a segmented projection (q|k|v, gate|up) as one GEMM launch
  (`minite.nn.segmented_matmul`); off, each segment's GEMM runs on its own (the same outputs).
- `grouped_mm`: bf16 MoE experts on `torch._grouped_mm` (None: on CUDA weights).

None of these changes a result the aligned contract fixes: the kernels and the reference agree as
`minite.ref` states, and every threshold only picks between paths with the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

KERNEL_CHOICES = ("auto", "ref", "triton")
ATTENTION_CHOICES = (*KERNEL_CHOICES, "sdpa")
ATTENTION_BACKWARDS = ("kernel", "reference")


def check_choice(what: str, value, allowed) -> None:
    """A ValueError naming `what` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is not supported; choose one of {list(allowed)}")


@dataclass(frozen=True)
class Execution:
    backend: str = "auto"
    elementwise: str = "auto"
    attention: str = "auto"
    attention_backward: str = "kernel"
    fast: bool = False
    decode_max_m: int = 64
    decode_max_rows_per_expert: int = 64
    fused_projections: bool = True
    grouped_mm: bool | None = None

    def __post_init__(self):
        for what in ("backend", "elementwise"):
            check_choice(what, getattr(self, what), KERNEL_CHOICES)
        check_choice("attention", self.attention, ATTENTION_CHOICES)
        check_choice("attention_backward", self.attention_backward, ATTENTION_BACKWARDS)
        if self.decode_max_m < 0 or self.decode_max_rows_per_expert < 0:
            raise ValueError("decode_max_m and decode_max_rows_per_expert must be >= 0")

    def replace(self, **changes) -> Execution:
        return replace(self, **changes)

    def elementwise_kernels(self, x: torch.Tensor) -> bool:
        """Whether an element-wise op on `x` runs its fused kernel."""
        return runs_kernels(self.elementwise, x.device)

    def attention_kernel(self, device: torch.device) -> bool:
        """Whether attention on `device` runs the Triton kernel."""
        return self.attention != "sdpa" and runs_kernels(self.attention, device)

    def grouped_mm_on(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.grouped_mm is None else self.grouped_mm


DEFAULT = Execution()


def runs_kernels(choice: str, device) -> bool:
    """Whether `choice` (`auto` / `ref` / `triton`) runs the Triton kernels on `device`: `auto` on CUDA,
    `triton` also on the CPU under the interpreter, `ref` never; always only where Triton is available."""
    if choice == "ref":
        return False
    from minite import kernels

    dev = device.type if isinstance(device, torch.device) else torch.device(device).type
    if not kernels.available():
        return False
    return dev == "cuda" or (choice == "triton" and kernels.interpreted())
