"""Builds an AttentionBatch (device tensors) from per-sequence host lists."""

from __future__ import annotations

import torch

from inferx_core.interfaces.attention import AttentionBatch


def make_attention_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionBatch:
    """Layout for sequences whose last query_lens[i] tokens (of context_lens[i]) are new.

    The new tokens' cache slots follow from each block table; tables are padded with 0 into one
    [num_seqs, max_blocks] tensor.
    """
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
        if len(table) * block_size < c:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {c} tokens")
        for pos in range(c - q, c):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    width = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionBatch(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=[list(t) for t in block_tables],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start=torch.tensor(starts, dtype=torch.int32, device=device),
        block_table=torch.tensor(padded, dtype=torch.int32, device=device).reshape(
            len(block_tables), width
        ),
        context_len=torch.tensor(context_lens, dtype=torch.int32, device=device),
    )
