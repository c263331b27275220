"""The counting sort of MoE assignments by expert (`kernels.moe_sort`): exactly the reference's stable
sort (`ref.moe_sort`), for skewed and uniform routings, partial chunks, many chunks and wide expert counts."""

import pytest
import torch

from minite.kernels import available
from minite.kernels import moe_sort as km
from minite.ref import moe_sort as ref
from tests.kernels.helpers import device

pytestmark = pytest.mark.skipif(not available(), reason="Triton kernels unavailable")


def _ids(t, k, e, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most assignments on two experts, long equal runs (the stable order shows)
        ids = torch.where(torch.rand(t, k, generator=g) < 0.8, torch.randint(0, 2, (t, k), generator=g),
                          torch.randint(0, e, (t, k), generator=g))
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids.to(device())


@pytest.mark.parametrize("t, k, e, skew", [(1, 8, 128, False), (5, 2, 6, True), (32, 8, 128, False),
                                           (100, 8, 128, True), (1024, 8, 128, False), (40, 4, 200, True),
                                           (17, 3, 3, True)])
def test_counting_sort_is_the_stable_sort(t, k, e, skew):
    ids = _ids(t, k, e, seed=t + e, skew=skew)
    got = km.sort_by_expert(ids, e)
    want = ref.sort_by_expert(ids, e)
    for g, w, name in zip(got, want, ("tokens", "experts", "offsets", "inverse")):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_int32_ids_and_unused_experts():
    ids = torch.tensor([[3, 1], [1, 3], [0, 3]], dtype=torch.int32, device=device())
    tokens, experts, offsets, inverse = km.sort_by_expert(ids, 8)
    assert tokens.tolist() == [2, 0, 1, 0, 1, 2] and experts.tolist() == [0, 1, 1, 3, 3, 3]
    assert offsets.tolist() == [0, 1, 3, 3, 6, 6, 6, 6, 6] and inverse.tolist() == [3, 1, 2, 4, 0, 5]


def test_what_it_does_not_serve_raises():
    assert km.serves(km.MAX_CHUNKS * km.CHUNK, km.MAX_EXPERTS)
    assert not km.serves(km.MAX_CHUNKS * km.CHUNK + 1, 8) and not km.serves(8, km.MAX_EXPERTS + 1)
    with pytest.raises(ValueError, match="assignments"):
        km.sort_by_expert(torch.zeros(km.MAX_CHUNKS * km.CHUNK + 1, 1, dtype=torch.int64, device=device()), 4)
    with pytest.raises(ValueError, match="int"):
        km.sort_by_expert(torch.zeros(4, 2, device=device()), 4)
