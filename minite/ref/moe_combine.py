"""The MoE combine: each token's top-k expert outputs weighted by its routing weights and summed.

    out[t] = sum_{j < k} ys[inverse[t * k + j]] * w[t, j]

ys [R, H] are the expert outputs in expert-sorted order (R = T * k), inverse [R] the sorted position of
assignment t * k + j, w [T, k] the routing weights in ys's dtype. Each product is rounded to the dtype
(as a 16-bit multiply rounds), the k products are summed in fp32 in top-k order, the sum rounded once.
With `residual` [T, H] the rounded sum is added to it and rounded again: torch's `residual + out`,
the decoder layer's residual add. `minite.kernels.moe_combine.combine` gives these bits (interpreter
and GPU tests); torch's own `(rows * w).sum(1)` on the GPU sums in another order.
"""

import torch


def combine(ys: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """ys [R, H], inverse [R] int, weights [T, k] (R = T * k), residual [T, H] or None -> out [T, H]
    in ys's dtype."""
    t, k = weights.shape
    rows = ys[inverse].reshape(t, k, -1)  # [T, k, H]
    prods = rows * weights.unsqueeze(-1)  # rounded to the dtype, as the kernel does
    acc = prods[:, 0].float()
    for j in range(1, k):
        acc = acc + prods[:, j].float()
    out = acc.to(ys.dtype)
    return out if residual is None else residual + out
