"""Mixture-of-experts FFN of Qwen3-MoE: a bf16 top-k router and SwiGLU experts as NVFP4 linears.

Routing (as HF Qwen3-MoE): logits = gate(x) [T, E] (bf16 Linear, never quantized); p = softmax of
the logits in fp32; the top-k of p, renormalized to sum 1 if `norm_topk_prob`, cast to x.dtype. Where
the fused kernels run, the gate and the routing are one kernel (`minite.nn.router.gate_route`: the
logits summed in a fixed order over the hidden size, equal logits to the lower expert).
Expert e computes down_e(silu(x W_gate,e^T) * (x W_up,e^T)) with gate_up_proj[e] = [W_gate,e; W_up,e].

Grouped execution (one path for all experts; no Python loop over tokens): the T*k token-expert
assignments are sorted by expert (stable; `sort_by_expert`, computed on the device: a counting sort in
two launches where the element-wise kernels run, `minite.kernels.moe_sort`). Then:

- Triton kernels (the recipe's backend runs them on CUDA, row-scaled recipes they cover, see
  `minite.nn.nvfp4_matmul`): the tokens' rows in sorted order [T*k, H] (gate|up: each token quantized
  once, by the norm before where it hands that over, and read through the sorted index for each of
  its k experts) and the per-expert row offsets [E + 1] go to one grouped W4A4 launch per projection
  (`grouped_nvfp4_matmul`, 'aligned' config). Nothing in the forward synchronizes with the host, so a
  decode step can be captured in a CUDA graph.
- bf16 experts with `execution.grouped_mm` on (the default on CUDA, `minite.execution`): the
  same sorted rows and offsets go to `torch._grouped_mm`, one call per projection, with autograd; no
  host sync, no copy of the expert weights (the padded path below gathers `w[experts]` per call).
  On the H200 this made bf16 MoE rollout 1.75x faster (41.7k -> 72.9k tokens/s, 4 layers).
- Otherwise (the reference path, bf16 experts): the rows are laid out as [A, C, H] (A = experts that
  received tokens, C = the largest expert's token count, zero rows below; `group_by_expert`, whose
  A and C are read on the host) and each projection is one batched matmul (`nvfp4_matmul`) over the
  A experts. Activation quantization is one call for per-token ('row') scaling and one call per
  active expert for per-tensor or static scaling (TE and vLLM give each expert its own activation
  tensor).

Both give an expert's rows the same bits as a dense GEMM of those rows would (per-row activation
scales; the kernels' grouped GEMM uses the dense aligned tile and K order). Expert outputs are
multiplied by the routing weights and summed over k in top-k order (`minite.nn.moe_combine`: one
kernel on the sorted rows where the fused kernels run), so a token's result never depends on the
batch through the combine. `moe_reference` is the same computation as a Python loop over experts.

Static calibration gives one input scale per projection shared by all experts (amax over all experts'
tokens / 2688), as vLLM's NVFP4 MoE does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
from torch import nn

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy
from minite.nn.linear import TE_AMAX_TO_SCALE
from minite.nn.moe_combine import combine
from minite.nn.nvfp4_matmul import grouped_nvfp4_matmul, nvfp4_matmul, use_grouped_kernels
from minite.nn.quantized_weight import QuantizedWeight, quantize_weight, weight_key
from minite.nn.router import Gate
from minite.nn.swiglu import swiglu, swiglu_quantized
from minite.recipe import Recipe, get_recipe
from minite.ref import moe_sort as ref_moe_sort

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


class Routing(NamedTuple):
    logits: torch.Tensor  # [T, E] in x.dtype (for an aux loss)
    weights: torch.Tensor  # [T, k] in x.dtype
    experts: torch.Tensor  # [T, k] int64, top-k order
    counts: torch.Tensor | None = None  # per-chunk expert counts for the counting sort (router kernel)


class SortedGrouping(NamedTuple):
    """The T*k token-expert assignments sorted by expert (stable), all on the device."""

    tokens: torch.Tensor  # [R] token of each sorted assignment, R = T * k
    experts: torch.Tensor  # [R] expert of each sorted assignment, non-decreasing
    offsets: torch.Tensor  # [E + 1] int64: expert e owns sorted rows offsets[e] .. offsets[e + 1]
    inverse: torch.Tensor  # [R] sorted position of assignment t * k + j


class Grouping(NamedTuple):
    """Where each token-expert assignment sits in the [A, C, H] grouped layout (sorted order)."""

    tokens: torch.Tensor  # [R] token of each sorted assignment, R = T * k
    slot: torch.Tensor  # [R] index into the active experts
    rank: torch.Tensor  # [R] row within its expert
    inverse: torch.Tensor  # [R] sorted position of assignment t * k + j
    experts: torch.Tensor  # [A] active expert ids, ascending
    capacity: int  # C


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, execution: Execution = DEFAULT,
                   counts: torch.Tensor | None = None) -> SortedGrouping:
    """topk_ids [T, k] -> SortedGrouping (`minite.ref.moe_sort`); no host synchronization. Where the
    execution runs the element-wise kernels, a decode step's assignments take the counting sort
    (`minite.kernels.moe_sort`: the same integers in two launches, one given the router's `counts`)."""
    if execution.elementwise_kernels(topk_ids) and lazy.moe_sort.serves(topk_ids.numel(), num_experts):
        return SortedGrouping(*lazy.moe_sort.sort_by_expert(topk_ids, num_experts, counts))
    return SortedGrouping(*ref_moe_sort.sort_by_expert(topk_ids, num_experts))


def group_by_expert(topk_ids: torch.Tensor, num_experts: int) -> Grouping:
    """topk_ids [T, k] -> the padded [A, C, H] layout (reads A and C on the host)."""
    s = sort_by_expert(topk_ids, num_experts)
    counts = s.offsets[1:] - s.offsets[:-1]  # [E]
    slot_of = torch.cumsum(counts > 0, 0) - 1
    rank = torch.arange(s.tokens.numel(), device=s.tokens.device) - s.offsets[s.experts]
    return Grouping(s.tokens, slot_of[s.experts], rank, s.inverse, torch.nonzero(counts).squeeze(1),
                    int(counts.max()) if s.tokens.numel() else 0)


class MoEExperts(nn.Module):
    """Router `gate` [E, H] plus experts `gate_up_proj` [E, 2I, H] (gate rows, then up) and
    `down_proj` [E, H, I]; `forward(x [..., H]) -> [..., H]`. The recipe's execution picks the paths:
    `fast` the faster grouped config instead of the aligned one; `grouped_mm` (None: on for CUDA
    weights, off on the CPU) bf16 experts through `torch._grouped_mm` where it applies
    (`grouped_mm_applies`), and the 'dequantized' backward of NVFP4 experts (bf16 models, Triton
    backend) too."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int,
                 recipe: str | Recipe = "aligned", norm_topk_prob: bool = True, dtype=None, device=None):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size, self.top_k, self.norm_topk_prob = intermediate_size, top_k, norm_topk_prob
        self.gate = Gate(hidden_size, num_experts, dtype=dtype, device=device)
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device))
        self.register_buffer("gate_up_input_scale", None, persistent=False)
        self.register_buffer("down_input_scale", None, persistent=False)
        self._qweights: dict[str, QuantizedWeight] = {}
        self._calib_amax: dict[str, torch.Tensor] | None = None
        self.last_topk_ids: torch.Tensor | None = None  # [T, k], detached, for diagnostics
        self.set_recipe(recipe)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for p in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(p.shape[-1])
            nn.init.uniform_(p, -bound, bound)

    def set_recipe(self, recipe: str | Recipe) -> None:
        """Set the experts' recipe; the router `gate` stays bf16."""
        self.recipe = get_recipe(recipe)
        self._qweights = {}

    def quantized_weight(self, name: str) -> QuantizedWeight:
        """The shared quantized `gate_up_proj` or `down_proj` (one global scale per expert)."""
        if name not in EXPERT_WEIGHTS:
            raise ValueError(f"unknown expert weight {name!r}; choose one of {EXPERT_WEIGHTS}")
        if not self.recipe.fp4:
            raise RuntimeError(f"recipe {self.recipe.name!r} does not quantize weights")
        w, qw = getattr(self, name), self._qweights.get(name)
        if qw is None or qw.key != weight_key(w, self.recipe.weight):
            qw = self._qweights[name] = quantize_weight(w, self.recipe.weight)
        return qw

    def refresh_quantized_weight(self) -> None:
        self._qweights = {}
        if self.recipe.fp4:
            for name in EXPERT_WEIGHTS:
                self.quantized_weight(name)

    def set_quantized_weight(self, name: str, qw: QuantizedWeight) -> None:
        """Install a quantized `name` weight made elsewhere (weight sync); used until it changes."""
        w = getattr(self, name) if name in EXPERT_WEIGHTS else None
        if w is None or qw.spec != self.recipe.weight or qw.shape != tuple(w.shape):
            raise ValueError(f"quantized {name!r} {qw.shape} / {qw.spec} does not fit here")
        self._qweights[name] = dataclasses.replace(qw, key=weight_key(w, self.recipe.weight))

    def route(self, x2: torch.Tensor) -> Routing:
        """x2 [T, H] -> Routing (HF Qwen3-MoE's softmax / top-k / renormalize)."""
        return Routing(*self.gate(x2, self.top_k, self.norm_topk_prob, self.recipe.execution))

    def forward(self, x: torch.Tensor, return_router: bool = False, quantized=None,
                residual: torch.Tensor | None = None):
        """`quantized`: x's quantization per token, handed over by the norm before (the grouped kernels
        read each token's quantized row where an expert takes it). `residual` (x's shape): added to the
        output (`residual + out`, in the combine's launch where it runs one)."""
        x2 = x.reshape(-1, self.hidden_size)  # [T, H]
        r = self.route(x2)
        res2 = None if residual is None else residual.reshape(x2.shape)
        if x2.shape[0] and self._calib_amax is None and self.graph_safe():
            self.last_topk_ids = r.experts.detach()
            s = sort_by_expert(r.experts, self.num_experts, self.recipe.execution, r.counts)
            ys = self.sorted_experts_forward(x2, s, quantized)  # [R, H]
            out = combine(ys, s.inverse, r.weights, self.recipe.execution, res2)  # [T, H]
        else:
            if x2.shape[0] == 0:
                out = torch.zeros_like(x2)
            else:
                self.last_topk_ids = r.experts.detach()
                g = group_by_expert(r.experts, self.num_experts)
                xg = x2.new_zeros(len(g.experts), g.capacity, self.hidden_size).index_put(
                    (g.slot, g.rank), x2[g.tokens])  # [A, C, H]
                yg = self.experts_forward(xg, g.experts)  # [A, C, H]
                rows = yg[g.slot, g.rank][g.inverse].reshape(*r.weights.shape, self.hidden_size)  # [T, k, H]
                out = (rows * r.weights.unsqueeze(-1)).sum(dim=1)
            if res2 is not None:
                out = res2 + out
        out = out.reshape(x.shape)
        return (out, r) if return_router else out

    def graph_safe(self) -> bool:
        """Whether forward never synchronizes with the host (a CUDA graph can capture it): NVFP4
        experts on the Triton kernels or bf16 experts on `torch._grouped_mm` (sorted rows + device
        offsets); the padded path reads A and C."""
        if not self.recipe.fp4:
            return self.grouped_mm_applies()
        return use_grouped_kernels(self.recipe, self.down_proj.device)

    def grouped_mm_on(self) -> bool:
        """`execution.grouped_mm`, with None resolved: on for CUDA weights."""
        return self.recipe.execution.grouped_mm_on(self.down_proj.device)

    def grouped_mm_applies(self) -> bool:
        """`grouped_mm` is on and torch can run it here: `torch._grouped_mm` exists; on CUDA bf16
        weights on sm90+; 16-byte aligned strides (hidden and intermediate sizes multiples of 8)."""
        w = self.down_proj
        if not (self.grouped_mm_on() and hasattr(torch, "_grouped_mm")) or self.hidden_size % 8 or \
                self.intermediate_size % 8:
            return False
        if w.device.type == "cuda":
            return w.dtype == torch.bfloat16 and torch.cuda.get_device_capability(w.device) >= (9, 0)
        return w.device.type == "cpu"

    def sorted_experts_forward(self, x2: torch.Tensor, s: SortedGrouping, quantized=None) -> torch.Tensor:
        """SwiGLU experts on the token rows x2 [T, H] taken in expert order, x2[s.tokens] (kernels or
        `torch._grouped_mm`) -> [R, H]. The NVFP4 kernels quantize each token once (or take `quantized`)
        and read its row for every expert it goes to."""
        if not self.recipe.fp4:
            offs = s.offsets[1:].to(torch.int32)  # group ends
            gate, up = torch._grouped_mm(x2[s.tokens], self.gate_up_proj.transpose(1, 2),
                                         offs=offs).chunk(2, dim=-1)
            h = swiglu(gate, up, self.recipe.execution)
            return torch._grouped_mm(h, self.down_proj.transpose(1, 2), offs=offs)
        gate_up = grouped_nvfp4_matmul(x2, self.gate_up_proj, self.quantized_weight("gate_up_proj"),
                                       self.recipe, s.offsets, s.experts, quantized, rows=s.tokens)
        gate, up = gate_up.chunk(2, dim=-1)  # [R, I] each
        h, hq = swiglu_quantized(gate, up, self.recipe)  # quantized for down in the same launch
        return grouped_nvfp4_matmul(h, self.down_proj, self.quantized_weight("down_proj"), self.recipe,
                                    s.offsets, s.experts, hq)

    def experts_forward(self, xg: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """SwiGLU experts on grouped tokens: xg [A, C, H], experts [A] -> [A, C, H]."""
        gate, up = self.expert_matmul(xg, "gate_up_proj", experts).chunk(2, dim=-1)  # [A, C, I] each
        return self.expert_matmul(swiglu(gate, up, self.recipe.execution), "down_proj", experts)

    def expert_matmul(self, xg: torch.Tensor, name: str, experts: torch.Tensor) -> torch.Tensor:
        """xg [A, C, K] times expert weight `name` [E, N, K] of `experts` [A] -> [A, C, N]."""
        w = getattr(self, name)
        if self._calib_amax is not None:
            self._calib_amax[name] = torch.maximum(self._calib_amax[name], xg.detach().abs().amax().float())
        if self._calib_amax is not None or not self.recipe.fp4:
            return torch.bmm(xg, w[experts].transpose(1, 2))
        return nvfp4_matmul(xg, w, self.quantized_weight(name), self.recipe,
                            self._static_scale(name, len(experts)), experts)

    def _static_scale(self, name: str, n: int) -> torch.Tensor | None:
        if self.recipe.activation.scaling != "static":
            return None
        s = getattr(self, f"{name.removesuffix('_proj')}_input_scale")
        if s is None:
            raise RuntimeError(
                f"MoEExperts uses static activation scaling (recipe {self.recipe.name!r}) but was never "
                "calibrated: run `with minite.nn.calibrate(model): model(batch)` first")
        return s.expand(n)

    def start_calibration(self) -> None:
        zero = torch.zeros((), dtype=torch.float32, device=self.down_proj.device)
        self._calib_amax = {name: zero for name in EXPERT_WEIGHTS}

    def finish_calibration(self, commit: bool = True) -> None:
        amax, self._calib_amax = self._calib_amax, None
        if not commit or amax is None:
            return
        for name, a in amax.items():
            if a > 0:
                setattr(self, f"{name.removesuffix('_proj')}_input_scale", a / TE_AMAX_TO_SCALE)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, top_k={self.top_k}, recipe={self.recipe.name}")


def moe_reference(moe: MoEExperts, x: torch.Tensor) -> torch.Tensor:
    """The same MoE forward with a Python loop over experts (HF-style); the spec of the grouped path."""
    x2 = x.reshape(-1, moe.hidden_size)  # [T, H]
    r = moe.route(x2)
    out = torch.zeros_like(x2)
    for e in range(moe.num_experts):
        token_idx, pos = torch.nonzero(r.experts == e, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        ids = torch.tensor([e], device=x.device)
        ye = moe.experts_forward(x2[token_idx].unsqueeze(0), ids)[0]  # [n_e, H]
        out = out.index_add(0, token_idx, ye * r.weights[token_idx, pos, None])
    return out.reshape(x.shape)
