"""The MoE token-expert assignments sorted by expert, stably (the grouping the grouped GEMMs read).

    order     = the stable argsort of the flat expert ids [R] (R = T * k, assignment t * k + j)
    tokens    = order // k            the token of each sorted assignment
    experts   = ids[order]            non-decreasing
    offsets   = [0, cumsum(counts)]   expert e owns sorted rows offsets[e] .. offsets[e + 1]
    inverse   = the sorted position of each assignment (inverse[order] = arange(R))

Integers only: a stable sort is unique, so `minite.kernels.moe_sort` (a counting sort) gives exactly
these tensors. All int64 [R], offsets int64 [E + 1].
"""

import torch
import torch.nn.functional as F


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """topk_ids [T, k] -> (tokens, experts, offsets, inverse); device ops only, no host sync."""
    flat = topk_ids.reshape(-1)  # [R]
    # narrow keys, the same stable order: an int64 sort of a decode step's 4096 ids took ~34 us on the
    # H200 (radix passes over all 64 bits)
    keys = flat.to(torch.uint8 if num_experts <= 256 else torch.int32)
    order = torch.argsort(keys, stable=True)
    positions = torch.arange(flat.numel(), device=flat.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [E]
    inverse = torch.empty_like(order).scatter_(0, order, positions)
    return order // topk_ids.shape[-1], flat[order], F.pad(torch.cumsum(counts, 0), (1, 0)), inverse
