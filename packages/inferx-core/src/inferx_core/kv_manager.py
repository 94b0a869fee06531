"""The paged KV manager: a pool of reference-counted blocks, shared through a radix prefix cache.

Block 0 is never handed out. Block tables are padded with 0 (inferx_core.batch) and padded decode
slots may write there, so it must belong to no sequence: `num_usable_blocks` is num_blocks - 1.

Every other block is in exactly one state:
- free: on the free list, reference count 0, not in the prefix tree;
- held: reference count > 0 (one per sequence block table that has it), maybe also in the tree;
- cached: in the prefix tree with count 0; evictable, so counted by num_free_blocks().

A sequence that shares tree blocks locks the tree node where its shared prefix ends, and its
block table holds every tree block on that path (commit() swaps its own copy for the tree's when
both exist). So a tree block is evictable exactly when no sequence holds it.

KV groups (interfaces.kv.KVGroup): every group draws from the one pool and a sequence has one
table per group, all as long as its tokens need. A sliding group with window W frees, on each
allocate(), the blocks wholly before position num_computed - W + 1: the queries of the chunk
being allocated start at num_computed and see keys back to that position, never before. Their
table entries become 0, the padding block, which no kernel reads since it lies behind the window.
With several groups a tree entry is a tuple of one block id per group. A sliding group's blocks
would stay locked in the tree behind its window as long as the sequence lives, so a model with a
sliding group runs without the prefix cache (logged at start-up).
"""

from __future__ import annotations

import logging
from collections import deque

from inferx_core.interfaces.kv import KVGroup, KVManager
from inferx_core.prefix_cache import Node, RadixCache
from inferx_core.sequence import Sequence

log = logging.getLogger("inferx.kv")


class PagedKVManager(KVManager):
    """num_blocks blocks of block_size tokens; prefix_cache=False turns sharing off.

    groups: the model's KV groups (None: one full-attention group). max_chunk: the most tokens
    one allocate() adds to a sequence (the scheduler's prefill chunk), which bounds what a
    sliding group holds at once; None counts a sliding group like a full one in blocks_needed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: bool = True,
        groups: list[KVGroup] | None = None,
        max_chunk: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), not {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.groups = list(groups) if groups else [KVGroup(0, "full", None, ())]
        self.max_chunk = max_chunk
        self._single = len(self.groups) == 1 and self.groups[0].kind != "sliding"
        # (group index, window) of each sliding group
        self._windows = [(g.index, g.window) for g in self.groups if g.kind == "sliding"]
        if prefix_cache and self._windows:
            log.info(
                "prefix cache off: the model has sliding-window KV groups, whose blocks the "
                "cache would keep past their window"
            )
            prefix_cache = False
        self.tree = RadixCache(block_size) if prefix_cache else None
        self._ref = [0] * num_blocks
        self._cached = [False] * num_blocks  # in the prefix tree
        self._free: deque[int] = deque(range(1, num_blocks))
        # seq -> (the tree node its shared prefix ends at, whole blocks of it in the tree)
        self._shared: dict[Sequence, tuple[Node, int]] = {}
        # seq -> per group, the table index below which a sliding group's entries are freed
        self._low: dict[Sequence, list[int]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        bs = self.block_size
        full = -(-num_tokens // bs)
        if self._single:
            return full
        total = 0
        for g in self.groups:
            if g.kind == "sliding" and self.max_chunk:
                # Held at once: blocks touched by the W - 1 keys behind a chunk and the chunk.
                total += min(full, -(-(g.window - 1 + self.max_chunk) // bs) + 1)  # type: ignore[operator]
            else:
                total += full
        return total

    def num_free_blocks(self) -> int:
        if self.tree is None:
            return len(self._free)
        # Every tree entry holds one block of each group (no sliding groups with a tree).
        return len(self._free) + self.tree.evictable * len(self.groups)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_usable_blocks

    def match_prefix(self, seq: Sequence) -> int:
        """Share the longest cached whole-block prefix; returns its length in tokens.

        Sets only seq.block_tables; the scheduler records the count as computed. The last token
        is never matched, so a fully cached prompt still runs one token to produce logits.
        """
        if any(seq.block_tables):
            raise ValueError(f"{seq.request_id}: match_prefix needs empty block tables")
        if self.tree is None:
            return 0
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        if limit <= 0:
            return 0
        m = self.tree.match(seq.token_ids[: limit * bs])
        if not m.blocks:
            return 0
        self.tree.lock(m.node)
        ref = self._ref
        if self._single:
            for b in m.blocks:
                ref[b] += 1
            seq.block_tables[0].extend(m.blocks)
        else:
            tables = self._tables(seq)
            for entry in m.blocks:
                for table, b in zip(tables, entry, strict=True):
                    ref[b] += 1
                    table.append(b)
        self._shared[seq] = (m.node, len(m.blocks))
        return len(m.blocks) * bs

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        if not self._single:
            return self._allocate_groups(seq, num_tokens)
        table = seq.block_tables[0]
        need = -(-num_tokens // self.block_size) - len(table)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        for _ in range(need):
            b = self._free.popleft()
            self._ref[b] = 1
            table.append(b)
        return True

    def commit(self, seq: Sequence) -> None:
        if self.tree is None:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        node, done = self._shared.get(seq, (self.tree.root, 0))
        if full <= done:
            return
        tables = seq.block_tables
        ref = self._ref
        if self._single:
            table = tables[0]
            res = self.tree.extend(node, seq.token_ids[done * bs : full * bs], table[done:full])
            for i, b in enumerate(res.blocks, done):
                own = table[i]
                if b == own:
                    self._cached[b] = True
                    continue
                # Another sequence cached these tokens first: share its block and drop our
                # copy, so that every tree block on our locked path is one we hold.
                ref[b] += 1
                self._release(own)
                table[i] = b
        else:
            entries = [tuple(t[i] for t in tables) for i in range(done, full)]
            res = self.tree.extend(node, seq.token_ids[done * bs : full * bs], entries)
            for i, entry in enumerate(res.blocks, done):
                if entry == entries[i - done]:
                    for b in entry:
                        self._cached[b] = True
                    continue
                for table, b in zip(tables, entry, strict=True):  # as above, group by group
                    ref[b] += 1
                    self._release(table[i])
                    table[i] = b
        self._shared[seq] = (res.node, full)

    def free(self, seq: Sequence) -> None:
        ref = self._ref
        for table in seq.block_tables:
            for b in table:
                if not b:
                    continue  # a sliding group's entry behind its window, freed already
                left = ref[b] - 1
                if left < 0:
                    raise RuntimeError(f"{seq.request_id}: block {b} freed more often than held")
                ref[b] = left
                if left == 0 and not self._cached[b]:
                    self._free.append(b)
            table.clear()
        if self._low:
            self._low.pop(seq, None)
        shared = self._shared.pop(seq, None)
        if shared is not None:
            self.tree.unlock(shared[0])  # type: ignore[union-attr]

    # -- helpers -------------------------------------------------------------------------------

    def _reserve(self, need: int) -> bool:
        """Make `need` blocks free, evicting from the prefix tree; False (and no change) if it
        cannot."""
        short = need - len(self._free)
        if short <= 0:
            return True
        if self.tree is None:
            return False
        per_entry = len(self.groups)
        entries = -(-short // per_entry)
        if entries > self.tree.evictable:
            return False
        evicted = self.tree.evict(entries)
        ids = evicted if per_entry == 1 else [b for entry in evicted for b in entry]
        for b in ids:
            if self._ref[b] != 0:
                raise RuntimeError(f"prefix cache evicted block {b}, which is in use")
            self._cached[b] = False
            self._free.append(b)
        return True

    def _release(self, b: int) -> None:
        """Drop one reference to block b; it goes back to the pool when unreferenced and not
        cached."""
        left = self._ref[b] - 1
        self._ref[b] = left
        if left == 0 and not self._cached[b]:
            self._free.append(b)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """seq's block tables, one per group (a new sequence comes with group 0's only)."""
        tables = seq.block_tables
        while len(tables) < len(self.groups):
            tables.append([])
        return tables

    def _allocate_groups(self, seq: Sequence, num_tokens: int) -> bool:
        tables = self._tables(seq)
        bs = self.block_size
        if self._windows:
            # Blocks behind every query of the coming chunk go back first: they are never read
            # again (the device runs steps in order, so one in flight has read them already).
            low = self._low.setdefault(seq, [0] * len(tables))
            for g, window in self._windows:
                table = tables[g]
                stop = min(len(table), max(0, seq.num_computed - window + 1) // bs)
                for j in range(low[g], stop):
                    if table[j]:
                        self._release(table[j])
                        table[j] = 0
                low[g] = max(low[g], stop)
        want = -(-num_tokens // bs)
        need = sum(max(0, want - len(t)) for t in tables)
        if need <= 0:
            return True
        if not self._reserve(need):
            return False
        free, ref = self._free, self._ref
        for table in tables:
            for _ in range(want - len(table)):
                b = free.popleft()
                ref[b] = 1
                table.append(b)
        return True
