"""Builds an AttentionBatch (device tensors) from per-sequence host lists, and moves small
tensors between host and device without making the host wait for the device."""

from __future__ import annotations

import numpy as np
import torch

from inferx_core.interfaces.attention import AttentionBatch


def host_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of Python ints: numpy converts a list several times faster than
    torch.tensor."""
    return torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]))


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64}


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CPU tensor on `device` without the host waiting: a pinned, non-blocking copy on CUDA
    (a plain `tensor(..., device=cuda)` waits for all queued work), a plain `.to` elsewhere."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t`: a non-blocking copy into pinned memory from CUDA (valid once the
    stream reaches it), a plain copy from elsewhere."""
    if t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to("cpu", copy=True)


def pack_aligned(parts: list[list[int]], dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """One CPU tensor holding each list at an offset of whole 16 bytes (so one copy moves them
    all, and every slice of it is as aligned as a tensor of its own: Triton compiles a kernel
    variant per pointer alignment). Returns the tensor and each part's offset."""
    step = max(1, 16 // torch.tensor([], dtype=dtype).element_size())
    flat: list[int] = []
    offsets = []
    for part in parts:
        offsets.append(len(flat))
        flat += part
        flat += [0] * (-len(flat) % step)
    return host_tensor(flat, dtype), offsets


def _slots(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> list[int]:
    """The cache slots of every sequence's new tokens, in order."""
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
        if len(table) * block_size < c:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {c} tokens")
        pos = c - q
        while pos < c:  # a run of consecutive slots per block, not a Python step per token
            block, offset = divmod(pos, block_size)
            n = min(block_size - offset, c - pos)
            first = table[block] * block_size + offset
            slots.extend(range(first, first + n))
            pos += n
    return slots


def _padded(block_tables: list[list[int]]) -> tuple[list[int], int]:
    """The tables flattened row by row, each padded with 0 to the longest; and that width."""
    width = max((len(t) for t in block_tables), default=0)
    return [b for t in block_tables for b in t + [0] * (width - len(t))], width


def make_attention_batch(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    group_tables: list[list[list[int]]] | None = None,
) -> AttentionBatch:
    """Layout for sequences whose last query_lens[i] tokens (of context_lens[i]) are new.

    The new tokens' cache slots follow from each block table; tables are padded with 0 into one
    [num_seqs, max_blocks] tensor. group_tables: for a model of several KV groups, each group's
    tables (group_tables[0] is block_tables), which fill the batch's per-group fields.
    """
    slots = _slots(query_lens, context_lens, block_tables, block_size)
    flat, width = _padded(block_tables)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    n = len(query_lens)
    packed, (_, at_ctx, at_table) = pack_aligned([starts, list(context_lens), flat], torch.int32)
    ints = to_device(packed, device)
    batch = AttentionBatch(
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        block_tables=[list(t) for t in block_tables],
        slot_mapping=to_device(host_tensor(slots, torch.int64), device),
        query_start=ints[: n + 1],
        block_table=ints[at_table : at_table + n * width].view(n, width),
        context_len=ints[at_ctx : at_ctx + n],
    )
    if group_tables is not None and len(group_tables) > 1:
        batch.group_block_tables.append(batch.block_table)
        batch.group_slot_mappings.append(batch.slot_mapping)
        for tables in group_tables[1:]:
            g_slots = _slots(query_lens, context_lens, tables, block_size)
            g_flat, g_width = _padded(tables)
            g_table = to_device(host_tensor(g_flat, torch.int32), device).view(n, g_width)
            batch.group_block_tables.append(g_table)
            batch.group_slot_mappings.append(to_device(host_tensor(g_slots, torch.int64), device))
    return batch
