"""PagedKVManager: block accounting, prefix sharing, eviction; random operation sequences never
leak a block, free one twice or hand out a block that holds someone else's tokens."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inferx_core.interfaces.kv import KVLayerSpec, kv_groups
from inferx_core.kv_manager import PagedKVManager
from inferx_core.sequence import SamplingParams, Sequence

PARAMS = SamplingParams()


def seq(tokens: list[int]) -> Sequence:
    return Sequence(list(tokens), PARAMS)


def computed(kv: PagedKVManager, s: Sequence, n: int) -> None:
    """Pretend a step ran n more tokens of s (blocks must be allocated)."""
    assert kv.allocate(s, s.num_computed + n)
    s.num_computed += n


def components(entry) -> list[int | None]:
    """A tree entry's block ids: an int with one group, a list of one per group (None: a hole
    a sliding group's eviction left) with several."""
    return entry if isinstance(entry, list) else [entry]


def tree_blocks(kv: PagedKVManager) -> list[int]:
    """Every block id in the prefix tree."""
    out, stack = [], list(kv.tree.root.children.values()) if kv.tree else []
    while stack:
        n = stack.pop()
        for entry in n.blocks:
            out.extend(b for b in components(entry) if b is not None)
        stack.extend(n.children.values())
    return out


def sliding_tree_blocks(kv: PagedKVManager) -> dict[int, tuple[list, int]]:
    """Every sliding group's block in the tree -> (its entry, its group)."""
    out, stack = {}, list(kv.tree.root.children.values()) if kv.tree else []
    while stack:
        n = stack.pop()
        for entry in n.blocks:
            for g, b in enumerate(components(entry)):
                if b is not None and kv.groups[g].kind == "sliding":
                    out[b] = (entry, g)
        stack.extend(n.children.values())
    return out


def path_nodes(kv: PagedKVManager, tokens) -> list:
    """The tree nodes along tokens' path from the root."""
    tokens, node, out, i = list(tokens), kv.tree.root, [], 0
    while i < len(tokens) and (child := node.children.get(tuple(tokens[i : i + kv.block_size]))):
        out.append(child)
        node, i = child, i + len(child.key)
    return out


def sliding_ids(kv: PagedKVManager, tokens) -> list[int | None]:
    """Group 1's block (None: a hole) in each tree entry along tokens' path."""
    return [e[1] for n in path_nodes(kv, tokens) for e in n.blocks]


def check_accounting(kv: PagedKVManager, live: list[Sequence]) -> None:
    """Every usable block is exactly one of free, held by sequences, or cached only."""
    ref = [0] * kv.num_blocks
    for s in live:
        for table in s.block_tables:
            for b in table:
                if b:  # 0: a sliding group's block behind its window, given back
                    ref[b] += 1
    assert ref == kv._ref, "reference counts disagree with the block tables"
    free = list(kv._free)
    assert len(set(free)) == len(free), "a block is on the free list twice"
    cached = tree_blocks(kv)
    assert len(set(cached)) == len(cached), "a block is in the tree twice"
    assert set(cached) == {b for b in range(kv.num_blocks) if kv._cached[b]}
    held = {b for b in range(kv.num_blocks) if ref[b] > 0}
    cached_only = set(cached) - held
    assert not set(free) & (held | set(cached)), "a block in use is on the free list"
    assert set(free) | held | set(cached) == set(range(1, kv.num_blocks)), "a block leaked"
    assert 0 not in held | set(cached) | set(free)
    whole = sum(g.kind != "sliding" for g in kv.groups)
    evictable = kv.tree.evictable * whole + len(kv._idle) if kv.tree else 0
    assert evictable == len(cached_only), "a cached block is held but evictable, or stuck"
    assert kv.num_free_blocks() == len(free) + len(cached_only)
    # Idle: exactly the sliding blocks in the tree that no sequence holds, each knowing its entry.
    sliding = sliding_tree_blocks(kv)
    assert set(kv._idle) == {b for b in sliding if not ref[b]}
    for b, (entry, g) in sliding.items():
        assert kv._home[b][0] is entry and kv._home[b][1] == g
    stamps = list(kv._idle.values())
    assert stamps == sorted(stamps), "idle blocks out of age order"


# -- unit tests ----------------------------------------------------------------------------------


def test_block_zero_is_reserved():
    kv = PagedKVManager(5, 4)
    assert kv.num_usable_blocks == 4 and kv.num_free_blocks() == 4
    s = seq(range(16))
    assert kv.allocate(s, 16)
    assert sorted(s.block_table) == [1, 2, 3, 4]
    assert kv.usage() == 1.0
    with pytest.raises(ValueError, match="at least 2"):
        PagedKVManager(1, 4)


def test_allocate_is_all_or_nothing():
    kv = PagedKVManager(4, 4, prefix_cache=False)
    s = seq(range(20))
    assert not kv.allocate(s, 13)
    assert s.block_table == [] and kv.num_free_blocks() == 3
    assert kv.allocate(s, 5) and len(s.block_table) == 2
    assert kv.allocate(s, 8) and len(s.block_table) == 2, "already big enough"


def test_free_returns_every_block_once():
    kv = PagedKVManager(9, 4, prefix_cache=False)
    s = seq(range(10))
    kv.allocate(s, 10)
    kv.free(s)
    kv.free(s)
    assert s.block_table == [] and kv.num_free_blocks() == 8
    check_accounting(kv, [])


def test_committed_blocks_are_shared_by_the_next_match():
    kv = PagedKVManager(20, 4)
    a = seq(range(14))
    computed(kv, a, 14)
    kv.commit(a)
    b = seq(list(range(12)) + [99, 98])
    assert kv.match_prefix(b) == 12
    assert b.block_table == a.block_table[:3]
    assert all(kv._ref[x] == 2 for x in b.block_table)
    check_accounting(kv, [a, b])
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks() == 19 and kv.usage() == 0.0
    check_accounting(kv, [])


def test_match_leaves_the_last_token_to_run():
    kv = PagedKVManager(20, 4)
    a = seq(range(8))
    computed(kv, a, 8)
    kv.commit(a)
    kv.free(a)
    assert kv.match_prefix(seq(range(8))) == 4, "8 cached tokens, but the 8th must run"
    assert kv.match_prefix(seq(range(9))) == 8
    assert kv.match_prefix(seq([0, 1, 2])) == 0, "no whole block before the last token"


def test_match_needs_an_empty_table_and_is_off_without_cache():
    kv = PagedKVManager(20, 4, prefix_cache=False)
    a = seq(range(8))
    computed(kv, a, 8)
    kv.commit(a)
    assert kv.match_prefix(seq(range(9))) == 0
    with pytest.raises(ValueError, match="empty block table"):
        kv.match_prefix(a)


def test_commit_swaps_a_duplicate_for_the_cached_block():
    kv = PagedKVManager(20, 4)
    a, b = seq(range(9)), seq(range(9))
    computed(kv, a, 8)
    computed(kv, b, 8)
    own = list(b.block_table)
    kv.commit(a)
    kv.commit(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert all(kv._ref[x] == 0 for x in own[:2]) and kv.num_free_blocks() == 19 - 2
    check_accounting(kv, [a, b])


def test_commit_only_takes_whole_computed_blocks():
    kv = PagedKVManager(20, 4)
    a = seq(range(11))
    computed(kv, a, 7)
    kv.commit(a)
    assert kv.tree.size == 1
    computed(kv, a, 1)
    kv.commit(a)
    assert kv.tree.size == 2


def test_allocate_evicts_cached_blocks_when_the_free_list_runs_out():
    kv = PagedKVManager(6, 2)
    a = seq(range(8))
    computed(kv, a, 8)
    kv.commit(a)
    kv.free(a)
    assert len(kv._free) == 1 and kv.num_free_blocks() == 5
    b = seq(range(100, 106))
    assert kv.allocate(b, 6)
    assert kv.tree.size == 2, "only as many blocks as needed were evicted"
    c = seq(range(8))
    assert kv.match_prefix(c) == 4, "the oldest prefix blocks stay"
    check_accounting(kv, [b, c])


def test_blocks_in_use_are_not_evictable():
    kv = PagedKVManager(5, 2)
    a = seq(range(8))
    computed(kv, a, 8)
    kv.commit(a)
    assert kv.num_free_blocks() == 0
    assert not kv.allocate(seq(range(50, 52)), 2)
    check_accounting(kv, [a])


# -- KV groups -----------------------------------------------------------------------------------

FULL = KVLayerSpec(4, 2, 8)
SLIDING = KVLayerSpec(4, 2, 8, kind="sliding", window=6)


def test_groups_get_a_table_each_and_sliding_blocks_go_back():
    kv = PagedKVManager(40, 4, groups=kv_groups([FULL, SLIDING, FULL]), max_chunk=4)
    s = seq(range(30))
    computed(kv, s, 8)
    assert [len(t) for t in s.block_tables] == [2, 2]
    assert not set(s.block_tables[0]) & set(s.block_tables[1])
    computed(kv, s, 4)  # queries from 8 see keys from 3: block 0 stays
    assert s.block_tables[1][0] != 0
    computed(kv, s, 1)  # from 12: keys from 7, so block 0 (positions 0-3) goes back
    assert s.block_tables[1][0] == 0 and s.block_tables[1][1] != 0
    assert len(s.block_tables[0]) == len(s.block_tables[1]) == 4
    check_accounting(kv, [s])
    # full: cdiv(n, 4); sliding: at most the 5 keys behind a 4-token chunk and the chunk
    assert kv.blocks_needed(40) == 10 + min(10, -(-(6 - 1 + 4) // 4) + 1)
    assert kv.blocks_needed(5) == 2 + 2
    kv.free(s)
    check_accounting(kv, [])
    assert kv.num_free_blocks() == 39


def test_prefix_cache_shares_every_groups_blocks():
    kv = PagedKVManager(40, 4, groups=kv_groups([FULL, KVLayerSpec(4, 1, 8, kind="mla")]))
    a = seq(range(14))
    computed(kv, a, 14)
    kv.commit(a)
    b = seq(list(range(12)) + [99, 98])
    assert kv.match_prefix(b) == 12
    for g in range(2):
        assert b.block_tables[g] == a.block_tables[g][:3]
    check_accounting(kv, [a, b])
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks() == 39 and kv.usage() == 0.0
    # Evicting frees whole entries: a's 3 cached entries are 6 blocks.
    c = seq(range(200, 200 + 4 * 19))
    assert kv.allocate(c, 4 * 19) and kv.tree.size == 0
    check_accounting(kv, [c])


def run_chunks(kv: PagedKVManager, s: Sequence, chunks: list[int], commit: bool = True) -> None:
    for n in chunks:
        computed(kv, s, n)
        if commit:
            kv.commit(s)


def test_sliding_blocks_behind_the_window_stay_cached_but_idle():
    kv = PagedKVManager(40, 4, groups=kv_groups([FULL, SLIDING]), max_chunk=4)
    a = seq(range(30))
    run_chunks(kv, a, [4] * 7)
    # The allocate at 24 gave back sliding blocks 0-3 (keys before 19): committed, so idle.
    assert a.block_tables[1][:4] == [0] * 4 and all(a.block_tables[1][4:])
    assert len(kv._idle) == 4 and kv.tree.size == 7
    assert kv.num_free_blocks() == 39 - 7 - 3, "idle blocks count as free"
    check_accounting(kv, [a])
    # The query at 24 reads keys 19-23: blocks 4 and 5, which a still holds.
    b = seq(list(range(24)) + [99, 98])
    assert kv.match_prefix(b) == 24
    assert b.block_tables[0] == a.block_tables[0][:6]
    assert b.block_tables[1] == [0] * 4 + a.block_tables[1][4:6]
    # The query at 12 reads keys 7-11: blocks 1 and 2, idle, now held again.
    c = seq(list(range(12)) + [7])
    assert kv.match_prefix(c) == 12
    assert c.block_tables[1][0] == 0 and all(c.block_tables[1][1:])
    assert len(kv._idle) == 2
    check_accounting(kv, [a, b, c])
    for s in (a, b, c):
        kv.free(s)
    check_accounting(kv, [])
    assert kv.num_free_blocks() == 39 and kv.usage() == 0.0
    # 25 blocks are on the free list. Reclaiming 3 more takes the idle blocks that went idle
    # before the last leaf was unlocked (0 and 3 at the window, 6 as a was freed), not entries.
    big = seq(range(500, 500 + 4 * 14))
    assert len(kv._free) == 25 and kv.allocate(big, 4 * 14)
    assert kv.tree.size == 7
    holes = [b is None for b in sliding_ids(kv, range(28))]
    assert holes == [True, False, False, True, False, False, True]
    check_accounting(kv, [big])


def test_sliding_match_backs_off_to_a_cached_window_and_commit_fills_holes():
    kv = PagedKVManager(60, 4, groups=kv_groups([FULL, SLIDING]), max_chunk=4)
    a = seq(range(30))
    run_chunks(kv, a, [12])
    run_chunks(kv, a, [4, 4, 4, 4], commit=False)  # sliding block 3 is freed before its commit
    kv.commit(a)
    ids = sliding_ids(kv, range(28))
    assert [b is not None for b in ids] == [True, True, True, False, True, True, True]
    check_accounting(kv, [a])
    # At 20 the query reads blocks 3-4; at 16, 2-3: block 3 is a hole. At 12 (1-2) all is there.
    b = seq(list(range(20)) + [99])
    assert kv.match_prefix(b) == 12
    assert b.block_tables[1] == [0] + ids[1:3]
    c = seq(range(29))
    assert kv.match_prefix(c) == 28, "at 28 the query reads blocks 5-6, both cached"
    check_accounting(kv, [a, b, c])
    # A sequence that computes block 3 itself fills the hole when it commits.
    d = seq(list(range(16)) + [5])
    run_chunks(kv, d, [16])
    assert sliding_ids(kv, range(28))[3] == d.block_tables[1][3]
    assert d.block_tables[0] == a.block_tables[0][:4], "the full group's copies were swapped"
    check_accounting(kv, [a, b, c, d])
    e = seq(list(range(20)) + [99])
    assert kv.match_prefix(e) == 20
    check_accounting(kv, [a, b, c, d, e])


# -- random operation sequences ------------------------------------------------------------------

BS = 2
NUM_BLOCKS = 16


class KVMachine(RuleBasedStateMachine):
    """Sequences from a two-letter alphabet (so prefixes collide) grow, commit and free at random.

    `content` plays the KV cache: the token each block slot was last written with. A sequence
    must always read its own tokens back through its block table, and every tree block must hold
    the tokens of its edge.
    """

    prefix_cache = True
    layers: list[KVLayerSpec] | None = None  # None: one full group

    def __init__(self) -> None:
        super().__init__()
        groups = kv_groups(self.layers) if self.layers else None
        self.kv = PagedKVManager(NUM_BLOCKS, BS, self.prefix_cache, groups=groups, max_chunk=6)
        # group -> its window, or None (full): what the sequence's queries may still read
        self.windows = [g.window for g in self.kv.groups]
        self.live: list[Sequence] = []
        self.content: dict[int, list[int | None]] = {}

    @rule(tokens=st.lists(st.integers(1, 2), min_size=1, max_size=12))
    def admit(self, tokens: list[int]) -> None:
        s = seq(tokens)
        got = self.kv.match_prefix(s)
        assert got % BS == 0 and got < len(tokens)
        assert all(len(t) * BS == got for t in s.block_tables)
        for table, window in zip(s.block_tables, self.windows, strict=False):
            # Attached: exactly the blocks the next query reads (all, for a full group).
            first = max(0, got - window + 1) // BS if window else 0
            assert not any(table[:first]) and all(table[first:])
        s.num_computed = got
        self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), n=st.integers(1, 6))
    def compute(self, data: st.DataObject, n: int) -> None:
        s = data.draw(st.sampled_from(self.live))
        while s.num_computed + n > s.num_tokens:
            s.token_ids.append(data.draw(st.integers(1, 2)))  # a generated token
        if not self.kv.allocate(s, s.num_computed + n):
            return  # (a sliding group may have given back blocks behind its window)
        for p in range(s.num_computed, s.num_computed + n):
            for table in s.block_tables:
                b = table[p // BS]
                assert b and self.kv._ref[b] == 1 and not self.kv._cached[b], "shared write"
                self.content.setdefault(b, [None] * BS)[p % BS] = s.token_ids[p]
        s.num_computed += n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        self.kv.commit(data.draw(st.sampled_from(self.live)))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(self.live))
        if data.draw(st.booleans()):
            self.kv.commit(s)
        self.kv.free(s)
        self.kv.free(s)  # a second free is a no-op
        self.live.remove(s)

    @invariant()
    def accounting(self) -> None:
        check_accounting(self.kv, self.live)

    @invariant()
    def kv_contents(self) -> None:
        for s in self.live:
            for table, window in zip(s.block_tables, self.windows, strict=False):
                # A sliding group keeps at least the keys the next token's query reads.
                first = max(0, s.num_computed - window + 1) if window else 0
                for p in range(first, s.num_computed):
                    b = table[p // BS]
                    assert b and self.kv._ref[b] > 0, "a block the next query reads is gone"
                    assert self.content[b][p % BS] == s.token_ids[p]
        if self.kv.tree is None:
            return
        stack = list(self.kv.tree.root.children.values())
        while stack:
            node = stack.pop()
            for i, entry in enumerate(node.blocks):
                for b in components(entry):
                    if b is not None:
                        assert self.content[b] == node.key[i * BS : (i + 1) * BS]
            stack.extend(node.children.values())

    def teardown(self) -> None:
        for s in self.live:
            self.kv.free(s)
        check_accounting(self.kv, [])
        assert self.kv.num_free_blocks() == NUM_BLOCKS - 1


class KVMachineNoCache(KVMachine):
    prefix_cache = False


class KVMachineSliding(KVMachine):
    """A full and a sliding group (window 3 tokens, blocks of 2) with the prefix cache."""

    layers = [FULL, KVLayerSpec(4, 2, 8, kind="sliding", window=3)]


class KVMachineSlidingNoCache(KVMachineSliding):
    prefix_cache = False


class KVMachineTwoWindows(KVMachine):
    """Two sliding groups, one window aligned to blocks and one not, and a full one."""

    layers = [
        KVLayerSpec(4, 2, 8, kind="sliding", window=4),
        FULL,
        KVLayerSpec(4, 2, 8, kind="sliding", window=5),
    ]


class KVMachineOnlySliding(KVMachine):
    """Every layer slides: a tree entry may end up with no block at all."""

    layers = [KVLayerSpec(4, 2, 8, kind="sliding", window=2)]


class KVMachineTwoFull(KVMachine):
    """A full and an MLA group: tree entries hold one block of each."""

    layers = [FULL, KVLayerSpec(4, 1, 8, kind="mla")]


TestKVManagerRandom = KVMachine.TestCase
TestKVManagerRandomSliding = KVMachineSliding.TestCase
TestKVManagerRandomSlidingNoCache = KVMachineSlidingNoCache.TestCase
TestKVManagerRandomTwoWindows = KVMachineTwoWindows.TestCase
TestKVManagerRandomOnlySliding = KVMachineOnlySliding.TestCase
for case in (
    TestKVManagerRandomSlidingNoCache,
    TestKVManagerRandomTwoWindows,
    TestKVManagerRandomOnlySliding,
):
    case.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestKVManagerRandomSliding.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestKVManagerRandomTwoFull = KVMachineTwoFull.TestCase
TestKVManagerRandomTwoFull.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
TestKVManagerRandom.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVManagerRandomNoCache = KVMachineNoCache.TestCase
TestKVManagerRandomNoCache.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None
)
