"""Paged causal GQA attention: the kernel against `minite.ref.attention` and `minite.nn.attention`,
and the kernel against itself across batches (bitwise, on the GPU)."""

import pytest
import torch

from minite.kernels.attention import contiguous_attention, kv_block, paged_attention, plan_tiles
from minite.nn.attention import attention
from minite.ref import attention as ref
from tests.kernels.helpers import device

# Kernel vs reference (same chunks, different summation order inside MMAs and reductions)
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Reference vs the einsum attention in fp32 (online softmax vs one softmax)
REF_ATOL = 2e-6


def paged_case(lens, starts, Hq, Hkv, D, block_size, dtype, dev, seed=0):
    """Sequences of `lens` keys in a shuffled paged cache; queries at positions starts[s]..lens[s]-1
    of each sequence, rows consecutive. -> q, k_cache, v_cache, query_seq, query_pos, tables, lens."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * width + 3
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width)
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    qseq = torch.cat([torch.full((n - a,), s) for s, (n, a) in enumerate(zip(lens, starts))])
    qpos = torch.cat([torch.arange(a, n) for n, a in zip(lens, starts)])
    q = torch.randn(qseq.numel(), Hq, D, generator=g)
    to = lambda t: t.to(dev)  # noqa: E731
    return (to(q.to(dtype)), to(k_cache.to(dtype)), to(v_cache.to(dtype)), to(qseq), to(qpos),
            to(tables.to(torch.int32)), to(torch.tensor(lens)))


def gathered(k_cache, tables, block_size):
    """[S, W * block_size, Hkv, D]: each sequence's keys in position order."""
    S, W = tables.shape
    return k_cache[tables.long()].view(S, W * block_size, *k_cache.shape[2:])


def einsum_reference(q, k_cache, v_cache, qseq, qpos, tables, lens):
    """`minite.nn.attention.attention` on the gathered cache, one query row at a time."""
    bs = k_cache.shape[1]
    keys, values = gathered(k_cache, tables, bs), gathered(v_cache, tables, bs)
    kpos = torch.arange(keys.shape[1], device=q.device)
    outs = []
    for n in range(q.shape[0]):
        s = qseq[n]
        kp = torch.where(kpos < lens[s], kpos, -1)[None]
        out = attention(q[None, n: n + 1], keys[s: s + 1], values[s: s + 1], qpos[None, n: n + 1], kp)
        outs.append(out[0, 0])
    return torch.stack(outs)


def test_reference_matches_einsum_attention():
    # ragged lengths across several chunks, GQA 3, a query at position 0, chunk-boundary positions
    args = paged_case([1, 9, 40, 33], [0, 3, 0, 31], Hq=6, Hkv=2, D=16, block_size=4, dtype=torch.float32,
                      dev="cpu")
    for kv in (16, 8):
        got = ref.paged_attention(*args, kv_block=kv)
        torch.testing.assert_close(got, einsum_reference(*args), rtol=0, atol=REF_ATOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(dtype):
    dev = device()
    args = paged_case([1, 9, 40, 33], [0, 3, 0, 31], Hq=4, Hkv=2, D=16, block_size=4, dtype=dtype, dev=dev)
    got = paged_attention(*args)
    want = ref.paged_attention(*args, kv_block=kv_block(dtype))
    assert got.dtype == dtype and got.shape == args[0].shape
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ATOL[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(got, einsum_reference(*args), rtol=0, atol=ATOL[dtype])


def test_kernel_odd_group_and_decode_padding():
    """GQA 5 (Qwen3-14B's ratio) and decode padding rows (context 0: zero output, nothing NaN)."""
    dev = device()
    q, kc, vc, qseq, qpos, tables, lens = paged_case([20, 5, 1], [19, 4, 0], Hq=5, Hkv=1, D=16, block_size=8,
                                                     dtype=torch.float32, dev=dev)
    lens = lens.clone()
    lens[2] = 0
    got = paged_attention(q, kc, vc, qseq, qpos, tables, lens)
    want = ref.paged_attention(q, kc, vc, qseq, qpos, tables, lens, kv_block=kv_block(torch.float32))
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL[torch.float32])
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_contiguous_equals_paged():
    """Packed k/v (learner) and the paged cache (sampler) give the same bits from the kernel."""
    dev = device()
    lens = [13, 30, 2]
    q, kc, vc, qseq, qpos, tables, lens_t = paged_case(lens, [0, 0, 0], Hq=4, Hkv=2, D=16, block_size=4,
                                                      dtype=torch.float16, dev=dev, seed=3)
    keys = torch.cat([gathered(kc, tables, 4)[s, :n] for s, n in enumerate(lens)])  # [N, Hkv, D]
    values = torch.cat([gathered(vc, tables, 4)[s, :n] for s, n in enumerate(lens)])
    starts = torch.tensor([0, 13, 43], device=dev)
    packed = contiguous_attention(q, keys, values, qseq, qpos, starts, lens_t)
    assert torch.equal(packed, paged_attention(q, kc, vc, qseq, qpos, tables, lens_t))
    want = ref.contiguous_attention(q, keys, values, qseq, qpos, starts, lens_t,
                                    kv_block=kv_block(torch.float16))
    torch.testing.assert_close(packed.float(), want.float(), rtol=0, atol=ATOL[torch.float16])


def test_plan_tiles():
    qseq = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2, 2])
    tiles = plan_tiles(qseq, 4, group=2, block_m=4)  # 2 queries per tile; sequence 3 has none
    assert tiles.tolist()[:6] == [[0, 0, 2], [0, 2, 2], [0, 4, 1], [1, 5, 1], [2, 6, 2], [2, 8, 1]]
    assert all(t[2] == 0 for t in tiles.tolist()[6:])


def test_bad_inputs_are_rejected():
    dev = device()
    q, kc, vc, qseq, qpos, tables, lens = paged_case([4], [0], Hq=4, Hkv=2, D=16, block_size=4,
                                                     dtype=torch.float32, dev=dev)
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(q.half(), kc, vc, qseq, qpos, tables, lens)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], kc, vc, qseq, qpos, tables, lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention(q, kc, vc, qseq, qpos, tables[0], lens)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(q[..., :12], kc[..., :12], vc[..., :12], qseq, qpos, tables, lens)


# GPU: bf16 against the reference, and bitwise invariance across batches


def bitwise_setup(Hq, Hkv, lens, seed=0):
    D, bs = 128, 16
    args = paged_case(lens, [0] * len(lens), Hq, Hkv, D, bs, torch.bfloat16, "cuda", seed)
    return args, bs


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (40, 8)], ids=["g2", "g8", "g5"])
def test_gpu_bf16_matches_reference(heads):
    args, _ = bitwise_setup(*heads, lens=[1, 63, 64, 65, 300, 17])
    got = paged_attention(*args)
    want = ref.paged_attention(*args)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=ATOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (40, 8)], ids=["g2", "g8", "g5"])
def test_gpu_bitwise_decode_prefill_packed(heads):
    """A query's output is the same bits in a decode step of a big batch, in a prefill of its sequence
    alone, and in a packed batch of all sequences (learner)."""
    lens = [1, 63, 64, 65, 300, 17, 129, 700]
    (q, kc, vc, qseq, qpos, tables, lens_t), bs = bitwise_setup(*heads, lens=lens)
    S = len(lens)
    ends = torch.cumsum(lens_t, 0)
    # Prefill of each sequence alone (all its queries, keys from the cache).
    alone = [paged_attention(q[e - n: e], kc, vc, qseq[e - n: e] * 0, qpos[e - n: e], tables[s: s + 1],
                             lens_t[s: s + 1]) for s, (n, e) in enumerate(zip(lens, ends.tolist()))]
    alone = torch.cat(alone)
    # Packed (learner): contiguous keys of all sequences, one call.
    keys = torch.cat([gathered(kc, tables, bs)[s, :n] for s, n in enumerate(lens)])
    values = torch.cat([gathered(vc, tables, bs)[s, :n] for s, n in enumerate(lens)])
    packed = contiguous_attention(q, keys, values, qseq, qpos, ends - lens_t, lens_t)
    assert torch.equal(packed, alone)
    # Decode steps: every sequence at some position t (context t + 1), 64 rows in the batch with
    # other sequences (repeated at other positions) around it.
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        seqs = torch.randint(0, S, (64,), generator=g)
        pos = (torch.rand(64, generator=g) * lens_t[seqs].cpu()).long()
        rows = (ends.cpu() - lens_t.cpu())[seqs] + pos
        dq = q[rows.cuda()]
        out = paged_attention(dq, kc, vc, torch.arange(64, device="cuda"), pos.cuda(), tables[seqs.cuda()],
                              (pos + 1).cuda())
        assert torch.equal(out, alone[rows.cuda()])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real wiring (end-to-end test)")
def test_wiring_under_the_interpreter(monkeypatch):
    """The sampler (paged, prefill + decode) and the model's packed and padded forwards with the kernel
    forced on (interpreter, fp32): same tokens as the reference paths, log-probs and gradients close."""
    import sys

    from minite.sampler import Sampler
    from minite.sampling import SamplingParams
    from tests.sampler.common import full_forward_logprobs, prompts_of, tiny_model, tokens_of

    nn_attention = sys.modules["minite.nn.attention"]
    model = tiny_model("bf16")
    prompts = prompts_of([7, 19, 3])
    params = SamplingParams(n=2, max_tokens=5, temperature=0.8, seed=1)
    want = Sampler(model, max_num_seqs=4, kv_cache_tokens=48, block_size=4).generate(prompts, params)
    ids, cu = torch.tensor([prompts[0] + prompts[1]]), torch.tensor([0, 7, 26])
    hidden_ref = model.hidden_states(ids, cu_seqlens=cu)
    model.set_recipe(model.recipe.with_execution(attention="triton"))  # the kernel under the interpreter
    got = Sampler(model, max_num_seqs=4, kv_cache_tokens=48, block_size=4).generate(prompts, params)
    assert tokens_of(got) == tokens_of(want)
    for prompt, r in zip(prompts, got):
        for s in r.samples:
            lp = full_forward_logprobs(model, prompt, s.token_ids, params)  # padded path, kernel
            torch.testing.assert_close(s.logprobs, lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(model.hidden_states(ids, cu_seqlens=cu), hidden_ref, rtol=0, atol=1e-5)
    q, k, v = (torch.randn(26, h, 16, requires_grad=True) for h in (4, 2, 2))
    pos = torch.cat([torch.arange(7), torch.arange(19)])
    nn_attention.packed_kernel_attention(q, k, v, pos, cu).square().sum().backward()
    grads = [t.grad for t in (q, k, v)]
    loss = nn_attention.varlen_attention(q, k, v, pos, cu).square().sum()
    want_grads = torch.autograd.grad(loss, (q, k, v))
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert nn_attention.packed_kernel_attention(q, k, v, pos + 1, cu) is None  # not 0, 1, ...: reference


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real wiring (end-to-end test)")
@pytest.mark.parametrize("kernel_backward", [True, False])
def test_model_forward_builds_one_packed_layout_for_all_layers(monkeypatch, kernel_backward):
    """A packed model forward with the kernel (interpreter, fp32) lays the sequences out once for every
    layer (one host sync, not one per layer and per backward) and keeps the reference's gradients,
    with the Triton backward or the reference one (which plans its padded groups once)."""
    import sys

    from tests.sampler.common import tiny_model

    nn_attention = sys.modules["minite.nn.attention"]
    model = tiny_model("bf16")
    ids = torch.randint(0, model.config.vocab_size, (1, 26), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 7, 26])
    probe = torch.randn(1, 26, model.config.hidden_size, generator=torch.Generator().manual_seed(4))

    def loss_and_grads():  # (a normed output's square sum would be constant: gradients of pure noise)
        model.zero_grad()
        loss = (model.hidden_states(ids, cu_seqlens=cu) * probe).sum()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = loss_and_grads()
    built, plans = [], []
    real_init, real_plan = nn_attention.PackedLayout.__init__, nn_attention.varlen_plan
    monkeypatch.setattr(nn_attention.PackedLayout, "__init__", lambda *a: built.append(1) or real_init(*a))
    monkeypatch.setattr(nn_attention, "varlen_plan", lambda *a: plans.append(1) or real_plan(*a))
    model.set_recipe(model.recipe.with_execution(
        attention="triton", attention_backward="kernel" if kernel_backward else "reference"))
    got = loss_and_grads()
    assert model.config.num_hidden_layers > 1 and len(built) == 1 and len(plans) == (not kernel_backward)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=0)
    for a, b in zip(got[1], want[1]):  # the kernel's forward sums in another order than the reference
        assert ((a - b).norm() / b.norm()).item() < 1e-4


def sampler_vs_learner(model, prompts, params, **sampler_kwargs):
    """Generate with the sampler, recompute with the learner (packed) -> (sampler, learner) fp32 log-probs
    of every sampled token, concatenated."""
    from minite.learner import SequenceBatch, sequence_logprobs
    from minite.sampler import Sampler

    out = Sampler(model, **sampler_kwargs).generate(prompts, params)
    seqs = [(r.prompt_token_ids, s) for r in out for s in r.samples]
    batch = SequenceBatch(tuple(torch.tensor(p + s.token_ids) for p, s in seqs),
                          tuple(len(p) for p, _ in seqs), params=params)
    with torch.no_grad():
        learner = sequence_logprobs(model, batch).cpu()  # [S, T]
    sampler = torch.cat([s.logprobs for _, s in seqs])
    learner = torch.cat([learner[i, : len(s.token_ids)] for i, (_, s) in enumerate(seqs)])
    return sampler, learner


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [16, 128])
def test_gpu_sampler_logprobs_equal_learner_bitwise(head_dim):
    """bf16 recipe, bf16 model: the sampler's log-probs (paged decode, CUDA graphs, batches that change
    every step) are the learner's packed recomputation bit for bit."""
    from minite.sampling import SamplingParams
    from tests.sampler.common import prompts_of, tiny_model

    model = tiny_model("bf16", head_dim=head_dim).to("cuda", torch.bfloat16)
    prompts = prompts_of([5, 30, 70, 130, 12])
    params = SamplingParams(n=3, max_tokens=48, temperature=0.9, seed=5)
    sampler, learner = sampler_vs_learner(model, prompts, params, max_num_seqs=16, kv_cache_tokens=8192)
    equal = (sampler == learner).float().mean().item()
    worst = (sampler - learner).abs().max().item()
    assert equal == 1.0, f"bitwise equal: {equal:.4f} of {sampler.numel()} tokens, max |diff| {worst:.3g}"
