"""RadixCache: matching whole blocks, inserting, splitting edges, LRU eviction and locking."""

from __future__ import annotations

import pytest

from inferx_core.prefix_cache import Node, RadixCache

BS = 2


def toks(*blocks: int) -> list[int]:
    """Token ids for whole blocks: block value v is the tokens [v, v]."""
    return [v for v in blocks for _ in range(BS)]


def nodes(tree: RadixCache) -> list[Node]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def check_counts(tree: RadixCache) -> None:
    all_nodes = nodes(tree)
    assert tree.num_nodes == len(all_nodes)
    assert tree.size == sum(len(n.blocks) for n in all_nodes)
    assert tree.evictable == sum(len(n.blocks) for n in all_nodes if n.lock == 0)
    for n in all_nodes:
        assert len(n.key) == len(n.blocks) * BS and n.blocks
        assert n.parent.children[tuple(n.key[:BS])] is n
        assert n.lock >= sum(c.lock for c in n.children.values())


def test_empty_tree_matches_nothing():
    tree = RadixCache(BS)
    m = tree.match(toks(1, 2, 3))
    assert m.blocks == [] and m.node is tree.root


def test_match_returns_longest_whole_block_prefix():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    assert tree.match(toks(1, 2, 3, 4)).blocks == [10, 11, 12]
    assert tree.match(toks(1, 2, 9)).blocks == [10, 11]
    assert tree.match(toks(1, 2) + [3]).blocks == [10, 11], "a partial block never matches"
    assert tree.match([1, 2, 2]).blocks == [], "first block differs in its second token"
    check_counts(tree)


def test_partial_match_splits_the_edge():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    m = tree.match(toks(1, 9))
    assert m.blocks == [10] and m.node.blocks == [10]
    assert [n.blocks for n in m.node.children.values()] == [[11, 12]]
    assert tree.num_nodes == 2
    check_counts(tree)


def test_insert_keeps_blocks_the_tree_already_has():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2), [10, 11])
    res = tree.insert(toks(1, 2, 3, 4), [20, 21, 22, 23])
    assert res.blocks == [10, 11, 22, 23]
    assert res.node.blocks == [22, 23]
    assert tree.size == 4
    assert tree.match(toks(1, 2, 3, 4)).blocks == [10, 11, 22, 23]
    check_counts(tree)


def test_insert_branches_where_tokens_differ():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2, 3), [10, 11, 12])
    b = tree.insert(toks(1, 2, 4), [20, 21, 13])
    assert b.blocks == [10, 11, 13] and tree.num_nodes == 3
    assert tree.match(toks(1, 2, 4)).blocks == [10, 11, 13]
    check_counts(tree)


def test_extend_moves_the_callers_lock_down_the_path():
    tree = RadixCache(BS)
    first = tree.extend(tree.root, toks(1, 2), [10, 11])
    assert first.node.lock == 1 and tree.evictable == 0
    tree.insert(toks(1, 2, 3), [10, 11, 12])  # someone else's child: extend must branch off
    res = tree.extend(first.node, toks(4, 5), [13, 14])
    assert res.node.parent is first.node and (first.node.lock, res.node.lock) == (1, 1)
    assert tree.match(toks(1, 2, 4, 5)).blocks == [10, 11, 13, 14]
    tree.unlock(res.node)
    assert tree.evictable == tree.size == 5
    check_counts(tree)


def test_extend_grows_a_leaf_only_its_caller_holds():
    tree = RadixCache(BS)
    leaf = tree.extend(tree.root, toks(1), [10]).node
    res = tree.extend(leaf, toks(2, 3), [11, 12])
    assert res.node is leaf and leaf.blocks == [10, 11, 12] and tree.num_nodes == 1
    tree.lock(leaf)  # a second holder: the leaf must keep ending where that holder's path does
    res = tree.extend(leaf, toks(4), [13])
    assert res.node is not leaf and leaf.blocks == [10, 11, 12] and tree.num_nodes == 2
    assert (leaf.lock, res.node.lock) == (2, 1)
    check_counts(tree)


def test_insert_checks_whole_blocks():
    tree = RadixCache(BS)
    with pytest.raises(ValueError, match="whole blocks"):
        tree.insert([1, 2, 3], [10, 11])
    leaf = tree.extend(tree.root, toks(1), [10]).node
    with pytest.raises(ValueError, match="whole blocks"):
        tree.extend(leaf, [1, 2, 3], [10, 11])


def test_evict_takes_least_recently_used_leaf_first():
    tree = RadixCache(BS)
    tree.insert(toks(1), [10])
    tree.insert(toks(2), [20])
    tree.insert(toks(3), [30])
    tree.match(toks(1))  # 1 is now the most recently used
    assert tree.evict(1) == [20]
    assert tree.evict(1) == [30]
    assert tree.evict(5) == [10]
    assert tree.size == 0 and tree.num_nodes == 0 and tree.evictable == 0


def test_evict_trims_a_leaf_from_its_end():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2, 3, 4), [10, 11, 12, 13])
    assert tree.evict(2) == [12, 13]
    assert tree.match(toks(1, 2, 3, 4)).blocks == [10, 11]
    check_counts(tree)


def test_evicting_a_leaf_exposes_its_parent():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2), [10, 11])
    tree.insert(toks(1, 3), [10, 12])
    assert sorted(tree.evict(3)) == [10, 11, 12]
    assert tree.num_nodes == 0


def test_locked_node_and_its_ancestors_are_never_evicted():
    tree = RadixCache(BS)
    tree.insert(toks(1, 2), [10, 11])
    held = tree.insert(toks(1, 2, 3), [10, 11, 12]).node
    tree.insert(toks(4), [40])
    tree.lock(held)
    assert tree.evictable == 1
    assert tree.evict(10) == [40]
    assert tree.size == 3
    tree.unlock(held)
    assert tree.evictable == 3
    assert sorted(tree.evict(10)) == [10, 11, 12]
    check_counts(tree)


def test_split_of_a_locked_node_keeps_the_lock():
    tree = RadixCache(BS)
    node = tree.insert(toks(1, 2, 3), [10, 11, 12]).node
    tree.lock(node)
    m = tree.match(toks(1, 5))
    assert m.node.lock == 1 and node.lock == 1 and node.blocks == [11, 12]
    assert tree.evict(5) == []
    tree.unlock(node)
    assert tree.evictable == 3
    check_counts(tree)


def test_unlock_refreshes_lru():
    tree = RadixCache(BS)
    a = tree.insert(toks(1), [10]).node
    tree.insert(toks(2), [20])
    tree.lock(a)
    tree.unlock(a)  # a was used after 2
    assert tree.evict(1) == [20]


def test_move_lock_walks_down_only():
    tree = RadixCache(BS)
    upper = tree.insert(toks(1), [10]).node
    tree.lock(upper)
    lower = tree.insert(toks(1, 2, 3), [10, 11, 12]).node
    tree.move_lock(upper, lower)
    assert (upper.lock, lower.lock) == (1, 1)
    assert tree.evictable == 0
    tree.unlock(lower)
    assert tree.evictable == 3
    with pytest.raises(ValueError, match="not below"):
        tree.move_lock(lower, upper)
    check_counts(tree)


def test_unlock_without_lock_is_an_error():
    tree = RadixCache(BS)
    node = tree.insert(toks(1), [10]).node
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(node)


def test_stale_heap_entries_do_not_grow_without_bound():
    tree = RadixCache(BS)
    node = tree.insert(toks(1), [10]).node
    for _ in range(1000):
        tree.lock(node)
        tree.unlock(node)
    assert len(tree._heap) <= 2 * tree.num_nodes + 65
    assert tree.evict(1) == [10]
