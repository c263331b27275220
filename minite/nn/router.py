"""The MoE router's top-k routing as an autograd op: (weights, ids) from the router logits
(`minite.ref.router`, HF Qwen3-MoE's softmax / top-k / renormalize).

Where the execution runs the element-wise kernels (on CUDA by default) the forward is one launch
(`minite.kernels.router`), for learner and sampler alike, so both get its bits; equal logits go to the
lower expert. Elsewhere torch's softmax, top-k and renormalization (HF's ops; torch orders equal
probabilities its own way). The backward is autograd's of the torch form at the chosen experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minite.execution import DEFAULT, Execution
from minite.kernels import lazy


def _torch_weights(logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The weights of experts `ids` by torch's ops: softmax in fp32, picked, renormalized, cast."""
    w = F.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, normalize, chunk):
        weights, ids, *counts = lazy.router.route(logits, k, normalize, chunk)
        ctx.save_for_backward(logits, ids)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(ids, *counts)
        return weights, ids, *counts

    @staticmethod
    def backward(ctx, g, *_):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_()
            (d,) = torch.autograd.grad(_torch_weights(x, ids, ctx.normalize), x, g)
        return d, None, None, None


def route(logits: torch.Tensor, k: int, normalize: bool, execution: Execution = DEFAULT,
          chunk_counts: bool = False):
    """logits [T, E] -> (weights [T, k] in logits.dtype, ids [T, k] int64, largest first). With
    `chunk_counts`, a third output: the per-chunk expert counts the counting sort starts from where
    the kernel can count them in its launch (`minite.kernels.moe_sort.router_chunk`), else None."""
    if execution.elementwise_kernels(logits):
        chunk = lazy.moe_sort.router_chunk(k, logits.shape[0] * k, logits.shape[1]) if chunk_counts else None
        out = _Route.apply(logits.contiguous(), k, normalize, chunk)
        return (*out, None) if chunk_counts and chunk is None else out
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights.to(logits.dtype), ids, None) if chunk_counts else (weights.to(logits.dtype), ids)
