"""The paged KV manager: a pool of reference-counted blocks, shared through a radix prefix cache.

Block 0 is never handed out. Block tables are padded with 0 (inferx_core.batch) and padded decode
slots may write there, so it must belong to no sequence: `num_usable_blocks` is num_blocks - 1.

Every other block is in exactly one state:
- free: on the free list, reference count 0, not in the prefix tree;
- held: reference count > 0 (one per sequence whose block table has it), maybe also in the tree;
- cached: in the prefix tree with count 0; evictable, so counted by num_free_blocks().

A sequence that shares tree blocks locks the tree node where its shared prefix ends, and its
block table holds every tree block on that path (commit() swaps its own copy for the tree's when
both exist). So a tree block is evictable exactly when no sequence holds it.
"""

from __future__ import annotations

from collections import deque

from inferx_core.interfaces.kv import KVManager
from inferx_core.prefix_cache import Node, RadixCache
from inferx_core.sequence import Sequence


class PagedKVManager(KVManager):
    """num_blocks blocks of block_size tokens; prefix_cache=False turns sharing off."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), not {num_blocks}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tree = RadixCache(block_size) if prefix_cache else None
        self._ref = [0] * num_blocks
        self._cached = [False] * num_blocks  # in the prefix tree
        self._free: deque[int] = deque(range(1, num_blocks))
        # seq -> (the tree node its shared prefix ends at, whole blocks of it in the tree)
        self._shared: dict[Sequence, tuple[Node, int]] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return len(self._free) + (self.tree.evictable if self.tree else 0)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_usable_blocks

    def match_prefix(self, seq: Sequence) -> int:
        """Share the longest cached whole-block prefix; returns its length in tokens.

        Sets only seq.block_table; the scheduler records the count as computed. The last token
        is never matched, so a fully cached prompt still runs one token to produce logits.
        """
        if seq.block_table:
            raise ValueError(f"{seq.request_id}: match_prefix needs an empty block table")
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
        for b in m.blocks:
            ref[b] += 1
        seq.block_table.extend(m.blocks)
        self._shared[seq] = (m.node, len(m.blocks))
        return len(m.blocks) * bs

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        short = need - len(self._free)
        if short > 0:
            if self.tree is None or short > self.tree.evictable:
                return False
            for b in self.tree.evict(short):
                if self._ref[b] != 0:
                    raise RuntimeError(f"prefix cache evicted block {b}, which is in use")
                self._cached[b] = False
                self._free.append(b)
        table = seq.block_table
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
        table = seq.block_table
        res = self.tree.extend(node, seq.token_ids[done * bs : full * bs], table[done:full])
        ref = self._ref
        for i, b in enumerate(res.blocks, done):
            own = table[i]
            if b == own:
                self._cached[b] = True
                continue
            # Another sequence cached these tokens first: share its block and drop our copy, so
            # that every tree block on our locked path is one we hold.
            ref[b] += 1
            ref[own] -= 1
            if ref[own] == 0 and not self._cached[own]:
                self._free.append(own)
            table[i] = b
        self._shared[seq] = (res.node, full)

    def free(self, seq: Sequence) -> None:
        ref = self._ref
        for b in seq.block_table:
            left = ref[b] - 1
            if left < 0:
                raise RuntimeError(f"{seq.request_id}: block {b} freed more often than held")
            ref[b] = left
            if left == 0 and not self._cached[b]:
                self._free.append(b)
        seq.block_table.clear()
        shared = self._shared.pop(seq, None)
        if shared is not None:
            self.tree.unlock(shared[0])  # type: ignore[union-attr]
