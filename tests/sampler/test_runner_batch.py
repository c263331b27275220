"""The batch builders: the general one gives the tensors its definition spells out token by token (a
prefill's new tokens from any start, padding rows, padded block tables), and the decode builder
exactly the general one's."""

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


def _spec(tokens, starts, tables, block_size, scratch, width, rows):
    """The general batch, token by token (runner.CachedBatch's fields)."""
    lens = [len(t) - s for t, s in zip(tokens, starts)]
    tq, width = max(lens), width or max(map(len, tables))
    ids, pos, slots, qrows, qpos, unpad, last = [], [], [], [], [], [], []
    for b, (t, s, table) in enumerate(zip(tokens, starts, tables)):
        n0 = len(ids)
        ids += t[s:]
        pos += range(s, len(t))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s, len(t))]
        qrows.append(list(range(n0, len(ids))) + [0] * (tq - lens[b]))
        qpos.append(list(range(s, len(t))) + [-1] * (tq - lens[b]))
        unpad += range(b * tq, b * tq + lens[b])
        last.append(len(ids) - 1)
    for b in range(len(tokens), rows):
        ids.append(0)
        pos.append(0)
        slots.append(scratch * block_size)
        qrows.append([len(ids) - 1] + [0] * (tq - 1))
        qpos.append([-1] * tq)
        unpad.append(b * tq)
        last.append(len(ids) - 1)
    pad = rows - len(tokens)
    tabs = [t + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width] * pad
    ctx = [len(t) for t in tokens] + [0] * pad
    values = (ids, pos, slots, tabs, ctx, qrows, qpos, unpad, last)
    return dict(zip(FIELDS, map(torch.tensor, values)))


@pytest.mark.parametrize("pad", [False, True])
def test_general_batch_is_its_token_by_token_definition(pad):
    rng = random.Random(1)
    block_size, scratch = 4, 99
    tokens, starts, tables = [], [], []
    for _ in range(9):
        n = rng.randint(1, 40)
        tokens.append([rng.randint(0, 50) for _ in range(n)])
        starts.append(rng.choice([0, rng.randint(0, n - 1)]))  # a prompt, or what follows a cached prefix
        tables.append(rng.sample(range(90), (n + block_size - 1) // block_size))
    width, rows = (16, 12) if pad else (None, len(tokens))
    got = build_batch(tokens, starts, tables, block_size, scratch, "cpu", width, rows if pad else None)
    for name, want in _spec(tokens, starts, tables, block_size, scratch, width, rows).items():
        assert getattr(got, name).dtype == torch.int64 and torch.equal(getattr(got, name), want), name
