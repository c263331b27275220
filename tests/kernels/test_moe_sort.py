"""The counting sort of MoE assignments by expert (`kernels.moe_sort`): exactly the reference's stable
sort (`ref.moe_sort`), for skewed and uniform routings, partial chunks, many chunks (a prefill's, the counts
read in several blocks) and wide expert counts;
started from the router kernel's per-chunk counts, the same, and a MoE layer then runs no counting launch."""

import pytest
import torch

from minite.kernels import available
from minite.kernels import moe_sort as km
from minite.kernels import router as kr
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
                                           (17, 3, 3, True), (2051, 8, 128, True), (4096, 8, 128, False)])
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


@pytest.mark.parametrize("t, k, e", [(37, 8, 128), (1, 8, 128), (300, 8, 128), (45, 4, 200), (9, 8, 16),
                                     (2048, 8, 128)])
def test_router_counts_start_the_same_sort(t, k, e):
    """The router's per-chunk counts are the one-hot counts of its ids; its ids and weights are those
    of the launch without them; the sort from them is the reference's. A NaN row picks one expert k
    times and counts k."""
    chunk = km.router_chunk(k, t * k, e)
    assert chunk == km.CHUNK
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(t))
    logits[t // 2] = float("nan")
    logits = logits.to(device())
    w, ids, counts = kr.route(logits, k, True, chunk)
    w0, ids0 = kr.route(logits, k, True)
    torch.testing.assert_close(w, w0, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ids, ids0)
    flat = ids.reshape(-1).cpu()
    chunks = -(-flat.numel() // chunk)
    hot = torch.zeros(chunks, counts.shape[1], dtype=torch.int32)
    hot.index_put_((torch.arange(flat.numel()) // chunk, flat), torch.ones_like(flat, dtype=torch.int32),
                   accumulate=True)
    assert counts.dtype == torch.int32 and torch.equal(counts.cpu(), hot)
    for g, want, name in zip(km.sort_by_expert(ids, e, counts), ref.sort_by_expert(ids, e),
                             ("tokens", "experts", "offsets", "inverse")):
        assert torch.equal(g, want), name


def test_router_counts_only_where_chunks_line_up():
    assert km.router_chunk(8, 8 * 512, 128) == km.CHUNK
    assert km.router_chunk(3, 30, 128) is None  # k does not divide the chunk
    assert km.router_chunk(1, 10, 128) is None  # 128 tokens a router program: too many registers
    assert km.router_chunk(2, 10, 8) is None  # fewer expert columns than the sort's 16
    assert km.router_chunk(8, km.MAX_CHUNKS * km.CHUNK + 8, 128) is None  # beyond the sort
    ids = torch.zeros(20, 8, dtype=torch.int64, device=device())
    with pytest.raises(ValueError, match="counts must be"):
        km.sort_by_expert(ids, 128, torch.zeros(1, 128, dtype=torch.int32, device=device()))
    with pytest.raises(ValueError, match="chunk must be"):
        kr.route(torch.zeros(4, 16, device=device()), 3, True, 128)


def test_moe_layer_sorts_from_the_router_counts(monkeypatch):
    """A MoE layer on the kernels counts in the router's launch: no counting launch, and the same
    output and gradients as with the sort's own count."""
    from minite.nn import MoEExperts
    from minite.recipe import get_recipe

    launched = []
    real_launch = km.launch_kernel
    monkeypatch.setattr(km, "launch_kernel",
                        lambda fn, *a, **kw: launched.append(fn) or real_launch(fn, *a, **kw))
    dev = device()  # on CUDA the bf16 experts of torch._grouped_mm; on the CPU the interpreter
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    moe = MoEExperts(16, 32, 16, 4, recipe=get_recipe("bf16").with_execution(elementwise="triton",
                                                                               grouped_mm=True),
                     dtype=dtype, device=dev)
    x, g = (torch.randn(3, 11, 32, dtype=dtype, device=dev) for _ in range(2))
    runs = []
    for count_in_router in (True, False):
        if not count_in_router:
            monkeypatch.setattr(km, "router_chunk", lambda *a: None)
        xi = x.clone().requires_grad_()
        y = moe(xi)
        y.backward(g)
        runs.append((y.detach(), xi.grad, [p.grad.clone() for p in moe.parameters()]))
        moe.zero_grad()
        assert (km._count_kernel in launched) != count_in_router and km._place_kernel in launched
        launched.clear()
    (y1, dx1, dp1), (y2, dx2, dp2) = runs
    assert torch.equal(y1, y2)
    # the same sort, so the same gradients: bitwise on the CPU; on CUDA torch's backward of the row
    # gathers may sum in any order
    tol = dict(rtol=0, atol=0) if dev == "cpu" else {}
    for a, b in zip([dx1, *dp1], [dx2, *dp2]):
        torch.testing.assert_close(a, b, **tol)
