"""The numpy decode-batch builder gives exactly the tensors of the general builder."""

import random

import pytest
import torch

from minite.sampler.runner import build_batch, build_decode_batch

FIELDS = ("input_ids", "positions", "slots", "block_tables", "context_lens", "query_rows", "query_pos",
          "unpad", "last")


@pytest.mark.parametrize("pad", [False, True])
def test_decode_batch_equals_general_builder(pad):
    rng = random.Random(0)
    block_size, scratch = 4, 99
    tokens, tables = [], []
    for _ in range(7):
        n = rng.randint(1, 30)
        tokens.append([rng.randint(0, 50) for _ in range(n)])
        tables.append(rng.sample(range(90), (n + block_size - 1) // block_size))
    width, rows = (12, 16) if pad else (None, None)
    a = build_batch(tokens, [len(t) - 1 for t in tokens], tables, block_size, scratch, "cpu", width, rows)
    b = build_decode_batch(tokens, tables, block_size, scratch, "cpu", width, rows)
    for name in FIELDS:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
