"""Counter-based uniforms, the block allocator and the cache's position-ordered gather."""

import pytest
import torch

from minite.ref.rng import MUL1, MUL2, mix32
from minite.sampler.kv_cache import BlockManager, KVCache
from minite.sampler.rng import key_tensor, sample_key, uniforms
from minite.sampler.runner import build_batch
from minite.sampler.sample import draw


def _mix32_python(x: int) -> int:
    x ^= x >> 16
    x = (x * MUL1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * MUL2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_matches_exact_integer_arithmetic():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF, 123456789]
    got = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_mix32_python(v) for v in values]


def test_uniforms_depend_only_on_key_and_step():
    keys = [sample_key(0, r, s) for r in range(4) for s in range(3)]
    steps = torch.arange(12)
    u = uniforms(key_tensor(keys), steps)
    perm = torch.randperm(12)
    assert torch.equal(uniforms(key_tensor([keys[i] for i in perm]), steps[perm]), u[perm])
    assert torch.equal(uniforms(key_tensor(keys[3:4]), steps[3:4]), u[3:4])
    assert ((u >= 0) & (u < 1)).all() and len(set(u.tolist())) == 12


def test_uniforms_are_roughly_uniform():
    u = uniforms(key_tensor([sample_key(5, 0, 0)] * 20000), torch.arange(20000))
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert (hist - 2000).abs().max() < 200 and abs(u.mean().item() - 0.5) < 0.01


def test_draw_never_picks_a_dropped_token_and_follows_the_cdf():
    logp = torch.log(torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]))
    for u, want in [(0.0, 1), (0.2499, 1), (0.25, 3), (0.9999999, 3)]:
        assert draw(logp, torch.tensor([u])).item() == want


def test_block_manager_refcounts():
    bm = BlockManager(4)
    a = bm.allocate(3)
    bm.share(a[:2])
    bm.free(a)
    assert bm.num_free == 2 and bm.ref[a[0]] == 1
    bm.free(a[:2])
    assert bm.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free(a[:1])
    with pytest.raises(RuntimeError, match="asked for 5"):
        bm.allocate(5)


def test_gather_returns_keys_in_position_order():
    cache = KVCache(1, num_blocks=6, block_size=2, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                    device="cpu")
    table = [4, 0, 3]  # out of order on purpose
    batch = build_batch([list(range(5))], [0], [table], 2, cache.scratch_block, "cpu")
    pos = batch.positions.float()[:, None, None]  # [N, 1, 1]
    cache.write(0, batch.slots, pos, -pos)
    k, v = cache.gather(0, batch.block_tables)
    assert k[0, :5, 0, 0].tolist() == [0, 1, 2, 3, 4] and v[0, :5, 0, 0].tolist() == [0, -1, -2, -3, -4]


def test_decode_graph_buffers_replay_correctly_on_cpu(monkeypatch):
    """The graphs' static-buffer bookkeeping (padding rows and widths, copies before replay), with
    "replay" running the captured function eagerly, gives the eager decode's tokens."""
    from minite.sampler import Sampler
    from minite.sampler import graphs as graphs_mod
    from minite.sampling import SamplingParams
    from tests.sampler.common import prompts_of, tiny_model, tokens_of

    class FakeGraph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            self.fn()

    def capture(self, rows, width):
        self._reset_static()
        batch = self._view(rows, width)
        logits = graphs_mod.cached_forward(self.model, self.cache, batch).clone()
        self.graphs[(rows, width)] = (FakeGraph(lambda: logits.copy_(
            graphs_mod.cached_forward(self.model, self.cache, batch))), batch, logits)

    monkeypatch.setattr(graphs_mod.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_capture", capture)
    model = tiny_model()
    prompts = prompts_of([3, 18, 7])
    params = SamplingParams(n=3, max_tokens=12, top_p=0.9, seed=5)
    eager = Sampler(model, max_num_seqs=6, block_size=4).generate(prompts, params)
    sampler = Sampler(model, max_num_seqs=6, block_size=4)
    sampler.graphs = graphs_mod.DecodeGraphs(model, sampler.cache, 6, 8)
    assert tokens_of(sampler.generate(prompts, params)) == tokens_of(eager)
    assert sampler.stats["graph_steps"] > 0 and len(sampler.graphs.graphs) > 1
