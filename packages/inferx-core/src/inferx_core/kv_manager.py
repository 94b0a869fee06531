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

With several groups a tree entry is a list of one block id per group. Full (and MLA) groups
follow the rules above. A sliding group's component is looser, so that the window still frees:
- a sequence holds only the sliding blocks of its path that lie in its window, so a tree sliding
  block may have count 0 under a locked node. Such a block is "idle": cached, evictable on its
  own (its component becomes None, a hole; the entry keeps the full groups' ids), and counted by
  num_free_blocks(). Idle blocks and unlocked leaves are evicted together, oldest first.
- match_prefix() takes the longest prefix whose sliding components hold every key the next
  query reads (positions from p - W + 1 up to p, the first uncomputed token), and attaches only
  those; the entries before them become 0 as if freed by the window.
- a commit that meets a hole fills it with the committing sequence's own block.
So every block is still free, held, or cached with count 0 (then evictable), and nothing a
sequence holds is ever evicted.
"""

from __future__ import annotations

from collections import deque

from inferx_core.interfaces.kv import KVGroup, KVManager
from inferx_core.prefix_cache import Node, RadixCache
from inferx_core.sequence import Sequence


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
        self._sliding = [g.kind == "sliding" for g in self.groups]
        self._num_whole = self._sliding.count(False)  # groups whose tree blocks come and go whole
        self.tree = RadixCache(block_size) if prefix_cache else None
        self._ref = [0] * num_blocks
        self._cached = [False] * num_blocks  # in the prefix tree
        self._free: deque[int] = deque(range(1, num_blocks))
        # seq -> (the tree node its shared prefix ends at, whole blocks of it in the tree)
        self._shared: dict[Sequence, tuple[Node, int]] = {}
        # seq -> per group, the table index below which a sliding group's entries are freed
        self._low: dict[Sequence, list[int]] = {}
        # Idle sliding blocks (in the tree, count 0), oldest first: block -> tree clock time.
        self._idle: dict[int, int] = {}
        # A sliding block in the tree: (its entry, its group), to punch a hole when evicted.
        self._home: list[tuple[list[int | None], int] | None] = (
            [None] * num_blocks if self.tree is not None and self._windows else []
        )

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
        # An unlocked entry's whole-group blocks, plus the idle sliding blocks (locked or not).
        return len(self._free) + self.tree.evictable * self._num_whole + len(self._idle)

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
        ref = self._ref
        if self._single:
            self.tree.lock(m.node)
            for b in m.blocks:
                ref[b] += 1
            seq.block_tables[0].extend(m.blocks)
            self._shared[seq] = (m.node, len(m.blocks))
            return len(m.blocks) * bs
        entries, node = m.blocks, m.node
        k = len(entries)
        if self._windows:
            k = self._usable(entries)
            if not k:
                return 0
            if k < len(entries):
                node = self.tree.match(seq.token_ids[: k * bs]).node  # ends exactly at block k
        self.tree.lock(node)
        tables = self._tables(seq)
        low = [0] * len(tables)
        for g, window in self._windows:
            low[g] = max(0, k * bs - window + 1) // bs
        idle = self._idle
        for g, table in enumerate(tables):
            first = low[g]
            table.extend([0] * first)  # behind the window: not attached, as if freed
            for entry in entries[first:k]:
                b = entry[g]
                if not ref[b] and self._sliding[g]:
                    del idle[b]
                ref[b] += 1
                table.append(b)
        if self._windows:
            self._low[seq] = low
        self._shared[seq] = (node, k)
        return k * bs

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
            # A sliding entry already freed behind the window (0) goes in as a hole (None).
            ours = [[t[i] or None for t in tables] for i in range(done, full)]
            res = self.tree.extend(node, seq.token_ids[done * bs : full * bs], ours)
            sliding, home, idle = self._sliding, self._home, self._idle
            for i, entry in enumerate(res.blocks, done):
                if entry is ours[i - done]:
                    for g, b in enumerate(entry):
                        if b is not None:
                            self._cached[b] = True
                            if sliding[g]:
                                home[b] = (entry, g)
                    continue
                for g, table in enumerate(tables):  # as above, group by group
                    b, own = entry[g], table[i]
                    if b is None:  # a sliding hole: ours fills it
                        if own:
                            entry[g] = own
                            self._cached[own] = True
                            home[own] = (entry, g)
                        continue
                    if not own:
                        continue  # behind our window: we need not hold the tree's block
                    if not ref[b] and sliding[g]:
                        del idle[b]
                    ref[b] += 1
                    self._release(own)
                    table[i] = b
        self._shared[seq] = (res.node, full)

    def free(self, seq: Sequence) -> None:
        ref = self._ref
        for g, table in enumerate(seq.block_tables):
            for b in table:
                if not b:
                    continue  # a sliding group's entry behind its window, freed already
                left = ref[b] - 1
                if left < 0:
                    raise RuntimeError(f"{seq.request_id}: block {b} freed more often than held")
                ref[b] = left
                if left == 0:
                    if not self._cached[b]:
                        self._free.append(b)
                    elif self._sliding[g]:
                        self._idle[b] = self.tree.tick()  # type: ignore[union-attr]
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
        if self._windows:
            if short > self.tree.evictable * self._num_whole + len(self._idle):
                return False
            self._reclaim(short)
            return True
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

    def _reclaim(self, short: int) -> None:
        """Free `short` blocks or more (there are enough) with sliding groups: idle sliding
        blocks and unlocked tree leaves, whichever was used longest ago first."""
        tree = self.tree
        assert tree is not None
        idle, home, ref, sliding = self._idle, self._home, self._ref, self._sliding
        got = 0
        while got < short:
            leaf = tree.oldest()
            if idle and (leaf is None or next(iter(idle.values())) < leaf):
                b = next(iter(idle))
                del idle[b]
                entry, g = home[b]  # type: ignore[misc]
                entry[g] = None  # a hole: the entry keeps its other groups' blocks
                home[b] = None
                self._cached[b] = False
                self._free.append(b)
                got += 1
                continue
            evicted = tree.evict(1)
            if not evicted:
                raise RuntimeError("prefix cache has fewer evictable blocks than it counts")
            for g, b in enumerate(evicted[0]):
                if b is None:
                    continue
                if ref[b] != 0:
                    raise RuntimeError(f"prefix cache evicted block {b}, which is in use")
                if sliding[g]:
                    del idle[b]
                    home[b] = None
                self._cached[b] = False
                self._free.append(b)
                got += 1

    def _release(self, b: int, sliding: bool = False) -> None:
        """Drop one reference to block b; it goes back to the pool when unreferenced and not
        cached, and a sliding group's cached block turns idle."""
        left = self._ref[b] - 1
        self._ref[b] = left
        if left == 0:
            if not self._cached[b]:
                self._free.append(b)
            elif sliding:
                self._idle[b] = self.tree.tick()  # type: ignore[union-attr]

    def _usable(self, entries: list) -> int:
        """The most matched entries k whose sliding components hold what the query at block k
        reads: blocks from (k * bs - W + 1) // bs on, as allocate() keeps. 0 if none."""
        bs = self.block_size
        n = len(entries)
        ok = [True] * (n + 1)
        for g, window in self._windows:
            run = 0  # entries with this group's block, ending at entry k - 1
            for k in range(1, n + 1):
                run = run + 1 if entries[k - 1][g] is not None else 0
                if run < k - max(0, k * bs - window + 1) // bs:
                    ok[k] = False
        for k in range(n, 0, -1):
            if ok[k]:
                return k
        return 0

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
                        self._release(table[j], True)
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
