"""inferx_core.batch: the host side of a step's layout (slots, packed metadata), checked against
the per-token definitions on fresh random layouts."""

from __future__ import annotations

import random

import pytest
import torch

from inferx_core.batch import host_tensor, make_attention_batch, pack_aligned


def random_layout(rng: random.Random, block_size: int) -> tuple[list, list, list]:
    query_lens, context_lens, tables = [], [], []
    for _ in range(rng.randint(1, 6)):
        context = rng.randint(1, 5 * block_size)
        query_lens.append(rng.choice([1, context, rng.randint(1, context)]))
        context_lens.append(context)
        blocks = -(-context // block_size) + rng.randint(0, 2)  # spare blocks are never read
        tables.append(rng.sample(range(1000), blocks))
    return query_lens, context_lens, tables


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_slots_follow_each_block_table(block_size: int) -> None:
    """The new tokens' slots: token p of a sequence lives at table[p // bs] * bs + p % bs."""
    rng = random.Random(block_size)
    for _ in range(200):
        query_lens, context_lens, tables = random_layout(rng, block_size)
        batch = make_attention_batch(query_lens, context_lens, tables, block_size)
        want = [
            table[p // block_size] * block_size + p % block_size
            for q, c, table in zip(query_lens, context_lens, tables, strict=True)
            for p in range(c - q, c)
        ]
        assert batch.slot_mapping.dtype == torch.int64
        assert batch.slot_mapping.tolist() == want
        width = max(len(t) for t in tables)
        for row, table in zip(batch.block_table.tolist(), tables, strict=True):
            assert row == table + [0] * (width - len(table))
        assert batch.context_len.tolist() == context_lens
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        assert batch.query_start.tolist() == starts


def test_a_table_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 17 tokens"):
        make_attention_batch([1], [17], [[3]], 16)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_tensor_and_packed_parts(dtype: torch.dtype) -> None:
    rng = random.Random(7)
    values = [rng.randrange(-(2**31), 2**31) for _ in range(100)]
    assert torch.equal(host_tensor(values, dtype), torch.tensor(values, dtype=dtype))
    assert host_tensor([], dtype).shape == (0,)
    parts = [[rng.randrange(1000) for _ in range(rng.randint(0, 9))] for _ in range(5)]
    packed, offsets = pack_aligned(parts, dtype)
    assert packed.dtype == dtype
    for part, at in zip(parts, offsets, strict=True):
        assert at * packed.element_size() % 16 == 0
        assert packed[at : at + len(part)].tolist() == part
