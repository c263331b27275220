"""Learner log-probs: packed + chunked == unpacked full-logits reference; chunk size, micro-batching
and packing do not change the numbers; gradients flow through the chunked head."""

import pytest
import torch

from minite.learner import Learner, SequenceBatch, pack, sequence_logprobs
from minite.sampling import SamplingParams
from tests.learner.helpers import random_batch, reference_logprobs, sampled_batch, tiny_model

# Within 1e-6 + 2e-6 relative in fp32 (a few ulps of the log-prob), not bitwise: CPU fp32 matmuls may
# round differently at different row counts M (more so on some CPUs: 1.4e-6 at -2.7 on an AMD EPYC),
# and packing / chunking changes M for every GEMM and the LM head.
TOL, RTOL = 1e-6, 2e-6
PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=20, top_p=0.9)]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("recipe", ["bf16", "aligned"])
@pytest.mark.parametrize("params", PARAMS, ids=["plain", "truncated"])
def test_equals_unpacked_full_logits_reference(moe, recipe, params):
    model = tiny_model(moe, recipe)
    # Truncated distributions need tokens from their support: sample them; else random tokens do.
    batch = sampled_batch(model, params) if params.top_p < 1 else random_batch(params=params)
    with torch.no_grad():
        got = sequence_logprobs(model, batch, chunk_rows=3)
        ref = reference_logprobs(model, batch)
    mask = batch.mask()
    assert torch.isfinite(got).all() and (got[~mask] == 0).all()
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=TOL)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_chunking_and_micro_batching_do_not_change_results(moe):
    model = tiny_model(moe, "aligned")
    batch = random_batch()
    with torch.no_grad():
        base = sequence_logprobs(model, batch, chunk_rows=1024)
        for chunk in (1, 2, 5):
            got = sequence_logprobs(model, batch, chunk_rows=chunk)
            torch.testing.assert_close(got, base, rtol=0, atol=TOL)
    for tokens in (1, 9, 10_000):
        got = Learner(model, micro_batch_tokens=tokens).logprobs(batch)
        torch.testing.assert_close(got, base, rtol=0, atol=TOL)


def test_packing_layout():
    batch = SequenceBatch.from_samples([[5, 6], [7], [8, 9, 10]], [[11, 12], [], [13]])
    p = pack(batch)
    assert p.input_ids.tolist() == [[5, 6, 11, 8, 9, 10]]
    assert p.cu_seqlens.tolist() == [0, 3, 6]
    assert p.rows.tolist() == [1, 2, 5] and p.targets.tolist() == [11, 12, 13]
    assert p.seq_index.tolist() == [0, 0, 2] and p.position.tolist() == [0, 1, 0]


def test_gradient_matches_reference():
    model = tiny_model(False, "aligned")
    batch = random_batch()
    grads = []
    chunked = lambda: sequence_logprobs(model, batch, chunk_rows=2)
    for fn in (chunked, lambda: reference_logprobs(model, batch)):
        model.zero_grad()
        (fn() * batch.mask()).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_batches_are_errors():
    with pytest.raises(ValueError, match="prompt length"):
        SequenceBatch.from_samples([[]], [[1, 2]])
    with pytest.raises(ValueError, match="sampler log-probs"):
        SequenceBatch.from_samples([[1]], [[2, 3]], [[-1.0]])
    with pytest.raises(ValueError, match="no response tokens"):
        sequence_logprobs(tiny_model(), SequenceBatch.from_samples([[1, 2]], [[]]))
