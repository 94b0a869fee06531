"""Radix tree over whole blocks of token ids: which KV blocks already hold a prompt's prefix.

The idea is SGLang's RadixAttention, kept at block granularity: every edge carries one or more
whole blocks of tokens and the KV block ids that hold them. A node's `lock` counts the sequences
using it or any node below it, so a locked node is never evicted and neither is any ancestor of
one; unlocked leaves are evicted least recently used first, from the end of their edge.

Pure bookkeeping: the tree never frees a block itself, it hands evicted ids back. It never looks
inside a block entry either, so the KV manager may store one id per KV group there (a list it
edits in place; see kv_manager).
"""

from __future__ import annotations

import heapq
from typing import NamedTuple


class Node:
    """An edge of the tree: `key` holds whole blocks of token ids, `blocks` their block ids."""

    __slots__ = ("key", "blocks", "parent", "children", "lock", "last_access", "id")

    def __init__(self, key: list[int], blocks: list[int], parent: Node | None, id: int) -> None:
        self.key = key
        self.blocks = blocks
        self.parent = parent  # None for the root and for evicted nodes
        self.children: dict[tuple[int, ...], Node] = {}  # keyed by the child's first block
        self.lock = 0  # sequences holding this node or a node below it
        self.last_access = 0
        self.id = id  # breaks ties in the eviction heap


class Match(NamedTuple):
    blocks: list[int]  # block ids of the longest cached whole-block prefix
    node: Node  # the node that ends exactly at the last matched block (the root if none)


class Insert(NamedTuple):
    node: Node  # the node that ends exactly at the last inserted block
    blocks: list[int]  # the block ids the tree holds for the inserted tokens


class RadixCache:
    """Prefix cache of KV blocks.

    Counts, in blocks: `size` (all blocks in the tree) and `evictable` (blocks of unlocked nodes,
    which evict() can hand back).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.root = Node([], [], None, 0)
        self.size = 0
        self.evictable = 0
        self.num_nodes = 0  # not counting the root
        self._clock = 0  # logical time: deterministic, unlike a wall clock
        self._next_id = 1
        # Lazy min-heap of (last_access, id, node) for unlocked leaves; stale entries are skipped.
        self._heap: list[tuple[int, int, Node]] = []

    def match(self, token_ids: list[int]) -> Match:
        """Longest cached prefix of token_ids in whole blocks. Splits an edge to end there."""
        bs = self.block_size
        n = len(token_ids) // bs
        now = self._tick()
        node = self.root
        blocks: list[int] = []
        i = 0  # blocks matched so far
        while i < n:
            child = node.children.get(tuple(token_ids[i * bs : (i + 1) * bs]))
            if child is None:
                break
            j = self._common_blocks(child, token_ids, i, n)
            if j < len(child.blocks):
                child = self._split(child, j)
            blocks.extend(child.blocks)
            self._touch(child, now)
            node = child
            i += j
        return Match(blocks, node)

    def insert(self, token_ids: list[int], block_ids: list[int]) -> Insert:
        """Cache full computed blocks: token_ids (whole blocks from the start) in block_ids.

        Where the tree already holds some of these tokens it keeps its own blocks: the returned
        `blocks` say which ids now stand for the tokens (the given ones where new to the tree).
        """
        return self._insert(self.root, token_ids, block_ids)

    def extend(self, held: Node, token_ids: list[int], block_ids: list[int]) -> Insert:
        """insert() for tokens that continue the path ending at `held`, by a caller that holds
        one lock on `held` (or none, passing the root): the lock moves to the returned node.

        A leaf that only the caller holds grows in place, so that a decoding sequence does not
        add a node per block.
        """
        whole = len(token_ids) == len(block_ids) * self.block_size  # else _insert raises
        if whole and held is not self.root and held.lock == 1 and not held.children:
            held.key.extend(token_ids)
            held.blocks.extend(block_ids)
            held.last_access = self._tick()
            self.size += len(block_ids)
            return Insert(held, list(block_ids))
        res = self._insert(held, token_ids, block_ids)
        self.move_lock(held, res.node)
        return res

    def _insert(self, node: Node, token_ids: list[int], block_ids: list[int]) -> Insert:
        bs = self.block_size
        n = len(block_ids)
        if len(token_ids) != n * bs:
            raise ValueError(f"{len(token_ids)} tokens are not {n} whole blocks of {bs}")
        now = self._tick()
        held: list[int] = []
        i = 0
        while i < n:
            first = tuple(token_ids[i * bs : (i + 1) * bs])
            child = node.children.get(first)
            if child is None:
                child = Node(token_ids[i * bs :], block_ids[i:], node, self._new_id())
                node.children[first] = child
                self.num_nodes += 1
                self.size += n - i
                self.evictable += n - i
                held.extend(child.blocks)
                self._touch(child, now)
                return Insert(child, held)
            j = self._common_blocks(child, token_ids, i, n)
            if j < len(child.blocks):
                child = self._split(child, j)
            held.extend(child.blocks)
            self._touch(child, now)
            node = child
            i += j
        return Insert(node, held)

    def lock(self, node: Node) -> None:
        """Protect node and its ancestors from eviction until unlock(node)."""
        self.move_lock(self.root, node)

    def move_lock(self, old: Node, new: Node) -> None:
        """Same as lock(new) then unlock(old), for `new` at or below `old`; walks only between."""
        node = new
        while node is not old:
            if node.parent is None:
                raise ValueError("move_lock: the new node is not below the old one")
            if node.lock == 0:
                self.evictable -= len(node.blocks)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one lock(node). The path counts as used now, for LRU."""
        now = self._tick()
        leaf = node
        while node is not self.root:
            if node.lock <= 0:
                raise RuntimeError("unlock of a node that is not locked")
            node.lock -= 1
            if node.lock == 0:
                self.evictable += len(node.blocks)
            node.last_access = now
            node = node.parent  # type: ignore[assignment]
        self._offer(leaf)

    def evict(self, num_blocks: int) -> list[int]:
        """Take up to num_blocks blocks out of the tree, least recently used unlocked leaves first.

        Returns their ids for the caller to reuse. A leaf is trimmed from its end, so the earlier
        blocks of a prefix, which more requests share, stay longest.
        """
        bs = self.block_size
        freed: list[int] = []
        while len(freed) < num_blocks and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._evictable_leaf(node) or stamp != node.last_access:
                continue
            k = min(len(node.blocks), num_blocks - len(freed))
            self.size -= k
            self.evictable -= k
            if k < len(node.blocks):
                freed.extend(node.blocks[-k:])
                del node.blocks[-k:]
                del node.key[-k * bs :]
                self._push(node)
                continue
            freed.extend(node.blocks)
            parent = node.parent
            del parent.children[tuple(node.key[:bs])]  # type: ignore[union-attr]
            node.parent = None
            self.num_nodes -= 1
            self._offer(parent)  # type: ignore[arg-type]
        return freed

    def oldest(self) -> int | None:
        """The last_access of the leaf evict() takes next; None when nothing is evictable."""
        heap = self._heap
        while heap:
            stamp, _, node = heap[0]
            if self._evictable_leaf(node) and stamp == node.last_access:
                return stamp
            heapq.heappop(heap)
        return None

    def tick(self) -> int:
        """A new time on the tree's logical clock, for callers that age their own entries
        alongside the tree's (comparable with oldest())."""
        return self._tick()

    # -- helpers -------------------------------------------------------------------------------

    def _common_blocks(self, child: Node, token_ids: list[int], i: int, n: int) -> int:
        """Blocks of child's edge that equal token_ids' blocks from i (the first one does)."""
        bs = self.block_size
        j = 1
        limit = min(len(child.blocks), n - i)
        while (
            j < limit
            and child.key[j * bs : (j + 1) * bs] == token_ids[(i + j) * bs : (i + j + 1) * bs]
        ):
            j += 1
        return j

    def _split(self, node: Node, j: int) -> Node:
        """Cut node's edge after j blocks; returns the new upper node.

        The lower part keeps the original object, so locks held on it and heap entries for it
        stay valid; the new upper node carries the same lock count since every holder passes it.
        """
        bs = self.block_size
        parent = node.parent
        head = Node(node.key[: j * bs], node.blocks[:j], parent, self._new_id())
        head.lock = node.lock
        head.last_access = node.last_access
        parent.children[tuple(head.key[:bs])] = head  # type: ignore[union-attr]
        node.key = node.key[j * bs :]
        node.blocks = node.blocks[j:]
        node.parent = head
        head.children[tuple(node.key[:bs])] = node
        self.num_nodes += 1
        return head

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _touch(self, node: Node, now: int) -> None:
        node.last_access = now
        self._offer(node)

    def _evictable_leaf(self, node: Node) -> bool:
        return node.parent is not None and not node.children and node.lock == 0

    def _offer(self, node: Node) -> None:
        if self._evictable_leaf(node):
            self._push(node)

    def _push(self, node: Node) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        # Stale entries pile up when nothing is evicted for a long time; drop them now and then.
        if len(self._heap) > 2 * self.num_nodes + 64:
            self._heap = [
                e for e in self._heap if self._evictable_leaf(e[2]) and e[0] == e[2].last_access
            ]
            heapq.heapify(self._heap)
