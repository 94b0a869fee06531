"""ContinuousScheduler driven by a fake executor: batching invariants, fairness, chunked prefill,
preemption and the prefix cache, each checked against outputs computed without a scheduler."""

from __future__ import annotations

import random

import pytest
from fake_executor import FakeExecutor, expected_output, next_token
from hypothesis import given, settings
from hypothesis import strategies as st

from inferx_core.config import SchedulerSection
from inferx_core.interfaces import KVLayerSpec, QueueFullError, SchedulerOutput, kv_groups
from inferx_core.kv_manager import PagedKVManager
from inferx_core.scheduler import ContinuousScheduler
from inferx_core.sequence import PENDING, SamplingParams, Sequence, Status

MAX_LEN = 10_000
_made: list[ContinuousScheduler] = []
OVERLAP = {"on": False}  # run() schedules step N+1 before update() of step N when on


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap(request):
    """Every test runs twice: steps in series, and with one step in flight as the engine runs
    them on a device (schedule N+1, then update N)."""
    OVERLAP["on"] = request.param
    yield request.param
    OVERLAP["on"] = False


@pytest.fixture(autouse=True)
def _all_blocks_come_back():
    """After every test, aborting what is left must return every block (cached ones evictable)."""
    yield
    for sched in _made:
        for rid in list(sched._active):
            sched.abort(rid)
        assert not sched.has_work()
        assert_all_free(sched.kv)
    _made.clear()


def make(
    num_blocks=200, block_size=4, prefix_cache=True, max_model_len=MAX_LEN, groups=None, **cfg
):
    cfg.setdefault("max_batched_tokens", 64)
    cfg.setdefault("prefill_chunk", 16)
    cfg.setdefault("max_running", 8)
    config = SchedulerSection(prefix_cache=prefix_cache, **cfg)
    kv = PagedKVManager(
        num_blocks, block_size, prefix_cache, groups=groups, max_chunk=cfg["prefill_chunk"]
    )
    sched = ContinuousScheduler(config, kv, max_model_len)
    _made.append(sched)
    windows = {g.index: g.window or 0 for g in groups[1:]} if groups else None
    return sched, FakeExecutor(num_blocks, block_size, windows)


def seq(prompt, max_tokens=8, rid=None, eos=frozenset(), **params):
    s = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=eos)
    if rid is not None:
        s.request_id = rid
    return s


def check_step(sched: ContinuousScheduler, out: SchedulerOutput, before: list[Sequence]) -> None:
    """What must hold for every step's batch, before the executor runs it."""
    cfg, kv = sched.config, sched.kv
    bs = kv.block_size
    assert out.num_tokens <= cfg.max_batched_tokens
    assert len(out.chunks) <= cfg.max_running
    seqs = [c.seq for c in out.chunks]
    assert len(set(map(id, seqs))) == len(seqs), "a sequence scheduled twice"
    for c in out.chunks:
        s = c.seq
        end = c.start + c.num_tokens
        assert s.status is Status.RUNNING
        assert end == s.num_computed and c.num_tokens >= 1
        # A sampling chunk ends right before the PENDING token it will sample.
        assert c.sample == (end == s.num_tokens - 1 and s.token_ids[end] == PENDING)
        if not c.sample:
            assert end < s.num_tokens - s.num_pending, "a prompt chunk past the prompt"
        assert len(s.block_table) * bs >= end, "chunk without blocks"
        assert s.num_pending <= 2 and all(t != PENDING for t in s.known_ids)
    for p in out.preempted:
        assert p.status is Status.WAITING and p.num_computed == 0 and not any(p.block_tables)
        assert p not in seqs
    # Every running sequence that was not preempted gets its turn: decodes never stall. Only
    # a sequence whose pending token is its last (overlap) waits for update() to finish it.
    served = set(map(id, seqs))
    for s in before:
        last = s.num_pending and s.num_tokens >= min(s.max_length, sched.max_model_len)
        assert id(s) in served or s in out.preempted or last
    # A chunk writes only into blocks that no other running sequence can see.
    owners: dict[int, int] = {}
    for s in sched.running:
        for table in s.block_tables:
            for b in table:
                if b:  # 0: a sliding group's block behind its window, freed
                    owners[b] = owners.get(b, 0) + 1
    for c in out.chunks:
        for table in c.seq.block_tables:
            for b in {table[p // bs] for p in range(c.start, c.start + c.num_tokens)}:
                assert owners[b] == 1, f"{c.seq.request_id} writes into shared block {b}"
    assert len(owners) == kv.num_usable_blocks - kv.num_free_blocks()


def run(sched, ex, arrivals=(), max_steps=5000, log=None):
    """Drive schedule -> execute -> update until idle. arrivals: (step, seq) pairs. With
    OVERLAP on, each step is scheduled and executed before the previous one's update()."""
    pending = sorted(arrivals, key=lambda a: a[0])
    done: dict[str, Sequence] = {}
    step = 0
    in_flight = None

    def finish(out, result):
        for s in sched.update(out, result.sampled):
            assert s.finished and not s.block_table and not s.num_pending
            done[s.request_id] = s

    while pending or sched.has_work() or in_flight:
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[1])
        before = list(sched.running)
        out = sched.schedule()
        check_step(sched, out, before)
        if sched.has_work() and not in_flight:
            assert out.chunks, "work left but nothing scheduled"
        if log is not None:
            log.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        result = ex.execute(out)
        if OVERLAP["on"]:
            if in_flight:
                finish(*in_flight)
            in_flight = (out, result) if out.chunks else None
        else:
            finish(out, result)
        step += 1
        assert step < max_steps, "did not finish: starvation or livelock"
    assert_all_free(sched.kv)
    return done


def assert_all_free(kv: PagedKVManager) -> None:
    assert kv.num_free_blocks() == kv.num_usable_blocks
    assert all(r == 0 for r in kv._ref)


def check_outputs(done, seqs):
    for s in seqs:
        want = expected_output(s.prompt_ids, s.params, s.eos_token_ids, MAX_LEN)
        assert done[s.request_id].output_ids == want, s.request_id


def prompts(n, rng, lo=5, hi=40, vocab=50):
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# -- batching and fairness -----------------------------------------------------------------------


def test_batch_of_requests_matches_expected_outputs(overlap):
    sched, ex = make()
    rng = random.Random(0)
    seqs = [seq(p, max_tokens=rng.randint(1, 20)) for p in prompts(12, rng)]
    done = run(sched, ex, [(0, s) for s in seqs])
    check_outputs(done, seqs)
    assert sched.stats().preemptions == 0
    # With a step in flight, decodes read the token sampled just before from the "device".
    assert (ex.pending_inputs > 0) == overlap


def test_admission_is_first_come_first_served():
    sched, ex = make(max_running=2)
    seqs = [seq([i] * 6, max_tokens=5, rid=f"r{i}") for i in range(6)]
    log: list = []
    run(sched, ex, [(0, s) for s in seqs], log=log)
    first_seen = []
    for step in log:
        for rid, _, _ in step:
            if rid not in first_seen:
                first_seen.append(rid)
    assert first_seen == [f"r{i}" for i in range(6)]
    assert max(len(step) for step in log) == 2


def test_late_arrivals_join_the_running_batch():
    sched, ex = make()
    a, b = seq([1, 2, 3], max_tokens=20, rid="a"), seq([4, 5, 6], max_tokens=5, rid="b")
    log: list = []
    done = run(sched, ex, [(0, a), (4, b)], log=log)
    assert [rid for rid, _, _ in log[4]] == ["a", "b"]
    check_outputs(done, [a, b])


def test_chunked_prefill_runs_beside_decodes():
    sched, ex = make(max_batched_tokens=32, prefill_chunk=8)
    short = seq([1, 2, 3, 4], max_tokens=30, rid="short")
    long = seq(list(range(10, 50)), max_tokens=3, rid="long")
    log: list = []
    done = run(sched, ex, [(0, short), (2, long)], log=log)
    long_chunks = [
        (step, n) for step, batch in enumerate(log) for rid, _, n in batch if rid == "long"
    ]
    prefill = long_chunks[:5]
    assert [n for _, n in prefill] == [8, 8, 8, 8, 8], "40 prompt tokens in chunks of 8"
    for step, _ in prefill:
        assert ("short", 1) in [(rid, n) for rid, _, n in log[step]], "decode kept going"
    check_outputs(done, [short, long])


def test_prefill_chunks_never_take_the_last_decode_token():
    # FCFS admission from leftover budget rarely puts a decode behind two full prefill chunks;
    # force that order and check the decode still runs.
    sched, ex = make(max_batched_tokens=8, prefill_chunk=4, max_running=3)
    d = seq([1, 2], max_tokens=20, rid="d")
    p1, p2 = seq(list(range(10, 50)), rid="p1"), seq(list(range(60, 100)), rid="p2")
    for s in (d, p1, p2):
        sched.add(s)
    for _ in range(2):
        out = sched.schedule()
        sched.update(out, ex.execute(out).sampled)
    sched.running = [p1, p2, d]
    out = sched.schedule()
    check_step(sched, out, [p1, p2, d])
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [
        ("p1", 4),
        ("p2", 3),
        ("d", 1),
    ]
    sched.update(out, ex.execute(out).sampled)
    run(sched, ex)
    check_outputs({s.request_id: s for s in (d, p1, p2)}, [d, p1, p2])


# -- stop conditions -----------------------------------------------------------------------------


def test_eos_stops_unless_ignored():
    prompt = [7, 8, 9]
    free_run = expected_output(prompt, SamplingParams(max_tokens=10), frozenset(), MAX_LEN)
    eos = frozenset({free_run[2]})
    sched, ex = make()
    stopped = seq(prompt, max_tokens=10, eos=eos)
    ignoring = seq(prompt, max_tokens=10, eos=eos, ignore_eos=True)
    by_id = seq(prompt, max_tokens=10, stop_token_ids=(free_run[4],))
    done = run(sched, ex, [(0, stopped), (0, ignoring), (0, by_id)])
    assert done[stopped.request_id].output_ids == free_run[:3]
    assert done[stopped.request_id].finish_reason == "stop"
    assert done[ignoring.request_id].output_ids == free_run
    assert done[ignoring.request_id].finish_reason == "length"
    assert done[by_id.request_id].output_ids == free_run[:5]
    assert done[by_id.request_id].finish_reason == "stop"


def test_context_length_stops_generation():
    sched, ex = make(max_model_len=12)
    s = seq(list(range(10)), max_tokens=100)
    done = run(sched, ex, [(0, s)])
    assert done[s.request_id].num_tokens == 12
    assert done[s.request_id].finish_reason == "length"


def test_finish_from_outside_frees_blocks():
    sched, ex = make()
    s = seq(list(range(20)), max_tokens=50)
    sched.add(s)
    for _ in range(4):
        out = sched.schedule()
        sched.update(out, ex.execute(out).sampled)
    sched.finish(s, "stop")
    assert s.finish_reason == "stop" and s.finished and not sched.has_work()
    assert_all_free(sched.kv)


# -- preemption ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preemption_keeps_outputs_identical(prefix_cache):
    # 24 blocks of 4 tokens hold one request whole (20 blocks) but not six at once.
    sched, ex = make(num_blocks=25, block_size=4, prefix_cache=prefix_cache)
    rng = random.Random(1)
    seqs = [seq(p, max_tokens=40) for p in prompts(6, rng, lo=20, hi=40)]
    preempted = []
    orig_schedule = sched.schedule

    def spy():
        out = orig_schedule()
        preempted.extend(out.preempted)
        return out

    sched.schedule = spy  # type: ignore[method-assign]
    done = run(sched, ex, [(0, s) for s in seqs])
    check_outputs(done, seqs)
    assert sched.stats().preemptions > 0 and preempted
    assert sum(s.num_preemptions for s in seqs) == sched.stats().preemptions
    # Newest first: the first request admitted is never the one preempted.
    assert seqs[0].num_preemptions == 0


SLIDING_GROUPS = kv_groups(
    [KVLayerSpec(4, 2, 8), KVLayerSpec(4, 2, 8, kind="sliding", window=8), KVLayerSpec(4, 2, 8)]
)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_sliding_model_frees_its_window_and_never_preempts(prefix_cache):
    # Per request of 40 + 40 tokens (79 stored): 20 full blocks of 4, and at most 7 sliding ones
    # (the 7 keys behind a 16-token chunk and the chunk); 54 usable blocks hold two requests
    # whole, though their sliding tables alone would need 40 blocks without freeing.
    sched, ex = make(
        num_blocks=55,
        block_size=4,
        prefix_cache=prefix_cache,
        groups=SLIDING_GROUPS,
        max_running=2,
    )
    assert sched.kv.blocks_needed(79) == 27
    rng = random.Random(3)
    seqs = [seq(p, max_tokens=40) for p in prompts(2, rng, lo=40, hi=41)]
    done = run(sched, ex, [(0, s) for s in seqs])
    check_outputs(done, seqs)
    assert sched.stats().preemptions == 0
    # A request that could never be held alone is refused up front, not preempted forever.
    small, _ = make(num_blocks=27, block_size=4, prefix_cache=False, groups=SLIDING_GROUPS)
    with pytest.raises(ValueError, match="27 KV blocks"):
        small.add(seq(list(range(3, 43)), max_tokens=40))


def test_sliding_model_preempts_and_recomputes_correctly():
    # Six requests in 40 blocks: preemption frees both groups' tables and recompute refills them.
    sched, ex = make(num_blocks=40, block_size=4, prefix_cache=False, groups=SLIDING_GROUPS)
    seqs = [seq(p, max_tokens=30) for p in prompts(6, random.Random(4), lo=20, hi=40)]
    done = run(sched, ex, [(0, s) for s in seqs])
    check_outputs(done, seqs)
    assert sched.stats().preemptions > 0


@pytest.mark.parametrize("num_blocks", [200, 40], ids=["roomy", "preempting"])
def test_sliding_model_shares_prefixes_through_the_cache(num_blocks):
    # A 40-token head, five windows long: later requests match it, attaching only the sliding
    # blocks their first query reads. In 40 blocks they also preempt one another and evict.
    sched, ex = make(num_blocks=num_blocks, block_size=4, groups=SLIDING_GROUPS)
    rng = random.Random(5)
    head = [rng.randrange(50) for _ in range(40)]
    seqs = [seq(head + p, max_tokens=20) for p in prompts(8, rng, lo=1, hi=12)]
    done = run(sched, ex, [(3 * i, s) for i, s in enumerate(seqs)])
    check_outputs(done, seqs)
    stats = sched.stats()
    assert stats.prefix_hits >= 40 * 4, "most requests after the first reuse the whole head"
    assert (stats.preemptions > 0) == (num_blocks == 40)


def test_preempted_sequence_goes_to_the_front_of_the_queue():
    # 12 usable blocks: a and b fit while prefilling, not both at 25+ tokens.
    sched, ex = make(num_blocks=13, block_size=4, max_running=2, prefix_cache=False)
    a = seq(list(range(20)), max_tokens=20, rid="a")
    b = seq(list(range(30, 50)), max_tokens=20, rid="b")
    c = seq(list(range(60, 64)), max_tokens=2, rid="c")
    for s in (a, b, c):
        sched.add(s)
    for _ in range(20):
        out = sched.schedule()
        if out.preempted:
            break
        sched.update(out, ex.execute(out).sampled)
    assert out.preempted == [b] and b.num_preemptions == 1
    assert list(sched.waiting) == [b, c]
    sched.update(out, ex.execute(out).sampled)
    log: list = []
    done = run(sched, ex, log=log)
    order = [rid for step in log for rid, start, _ in step if start == 0]
    assert order.index("b") < order.index("c")
    check_outputs(done, [a, b, c])


# -- prefix cache --------------------------------------------------------------------------------


def test_prefix_cache_hit_skips_prefill_and_keeps_outputs():
    system = list(range(100, 148))  # 12 blocks of 4
    first = seq(system + [1, 2, 3], max_tokens=6)
    second = seq(system + [4, 5], max_tokens=6)
    sched, ex = make()
    run(sched, ex, [(0, first)])
    ex.tokens_run = 0
    done = run(sched, ex, [(0, second)])
    assert second.num_cached == 48
    assert ex.tokens_run == (50 - 48) + 5  # the two new prompt tokens, then 5 decode steps
    stats = sched.stats()
    assert stats.prefix_hits == 48 and stats.prefix_queries == 51 + 50
    check_outputs(done | {first.request_id: first}, [first, second])


def test_identical_prompts_in_flight_share_blocks():
    # Both compute the same prompt at once; the later commit swaps its copy for the cached one.
    prompt = list(range(200, 232))
    sched, ex = make()
    a, b = seq(prompt, max_tokens=12), seq(prompt, max_tokens=12)
    for s in (a, b):
        sched.add(s)
    for _ in range(4):
        out = sched.schedule()
        check_step(sched, out, list(sched.running))
        sched.update(out, ex.execute(out).sampled)
    shared = len(set(a.block_table) & set(b.block_table))
    assert shared >= 8, "the 8 full prompt blocks are stored once"
    done = run(sched, ex)
    check_outputs(done, [a, b])
    c = seq(prompt, max_tokens=12)
    run(sched, ex, [(0, c)])
    assert c.num_cached == 28  # whole blocks, leaving the last prompt token to run


def test_prefix_cache_off_never_hits():
    system = list(range(100, 148))
    sched, ex = make(prefix_cache=False)
    run(sched, ex, [(0, seq(system + [1]))])
    second = seq(system + [2])
    run(sched, ex, [(0, second)])
    assert second.num_cached == 0 and sched.stats().prefix_queries == 0


def test_cached_blocks_are_evicted_under_pressure():
    sched, ex = make(num_blocks=21, block_size=4)
    rng = random.Random(3)
    seqs = [seq(p, max_tokens=10) for p in prompts(10, rng, lo=30, hi=60)]
    done = run(sched, ex, [(i * 3, s) for i, s in enumerate(seqs)])
    check_outputs(done, seqs)
    assert 0 < sched.kv.tree.size <= 20  # 112 blocks' worth of tokens went through 20


# -- abort and admission checks ------------------------------------------------------------------


def test_abort_waiting_and_running_frees_everything():
    sched, ex = make(max_running=2)
    seqs = [seq(list(range(i, i + 12)), max_tokens=30, rid=f"r{i}") for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, ex.execute(out).sampled)
    assert seqs[0].status is Status.RUNNING and seqs[3].status is Status.WAITING
    for s in (seqs[0], seqs[3]):
        got = sched.abort(s.request_id)
        assert got is s and s.finish_reason == "abort" and s.finished and not s.block_table
    assert sched.abort("r0") is None and sched.abort("nobody") is None
    done = run(sched, ex)
    assert set(done) == {"r1", "r2"}
    for s in seqs:
        sched.abort(s.request_id)
    assert_all_free(sched.kv)


def test_abort_between_schedule_and_update():
    sched, ex = make()
    a, b = seq([1, 2, 3], max_tokens=5, rid="a"), seq([4, 5, 6], max_tokens=5, rid="b")
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sampled = ex.execute(out).sampled
    sched.abort("a")
    sched.update(out, sampled)
    assert a.output_ids == [] and b.num_output == 1
    run(sched, ex)


def test_add_refuses_what_cannot_run():
    sched, _ = make(num_blocks=11, block_size=4, max_model_len=64, max_waiting=2)
    with pytest.raises(ValueError, match="empty"):
        sched.add(seq([]))
    with pytest.raises(ValueError, match="more than the model's context of 64"):
        sched.add(seq(list(range(65))))
    # 30 + 20 tokens keep KV for 49: 13 blocks, and the cache has 10.
    with pytest.raises(ValueError, match="need 13 KV blocks but the cache has 10"):
        sched.add(seq(list(range(30)), max_tokens=20))
    sched.add(seq(list(range(30)), max_tokens=11))  # 40 tokens: exactly 10 blocks
    sched.add(seq([1], rid="x"))
    with pytest.raises(QueueFullError):
        sched.add(seq([1]))
    sched.abort("x")
    with pytest.raises(ValueError, match="already queued"):
        sched.add(seq([1], rid=sched.waiting[0].request_id))


def test_request_that_fills_the_whole_cache_completes():
    sched, ex = make(num_blocks=11, block_size=4, max_model_len=64)
    s = seq(list(range(30)), max_tokens=11)
    other = seq(list(range(40, 44)), max_tokens=30)
    done = run(sched, ex, [(0, other), (0, s)])
    check_outputs(done, [s, other])


def test_stats_report_queues_and_usage():
    sched, ex = make(max_running=1)
    sched.add(seq(list(range(10)), rid="a"))
    sched.add(seq(list(range(10)), rid="b"))
    out = sched.schedule()
    sched.update(out, ex.execute(out).sampled)
    st_ = sched.stats()
    assert (st_.running, st_.waiting) == (1, 1)
    assert st_.kv_usage == pytest.approx(3 / 199)


def test_update_checks_the_number_of_sampled_tokens():
    sched, _ = make()
    sched.add(seq([1, 2, 3]))
    out = sched.schedule()
    with pytest.raises(ValueError, match="1 sampling chunks"):
        sched.update(out, [5, 6])


# -- random workloads ----------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    block_size=st.sampled_from([1, 2, 4, 8]),
    extra_blocks=st.integers(0, 40),
    budget=st.integers(4, 48),
    chunk_frac=st.floats(0.1, 1.0),
    max_running=st.integers(1, 8),
    prefix_cache=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 12)),
)
def test_random_workloads(
    seed, block_size, extra_blocks, budget, chunk_frac, max_running, prefix_cache, window
):
    rng = random.Random(seed)
    max_running = min(max_running, budget)
    chunk = max(1, int(budget * chunk_frac))
    # Prompts from a tiny vocabulary with shared heads, so prefixes repeat.
    heads = prompts(3, rng, lo=0, hi=24, vocab=3)
    seqs = []
    for _ in range(rng.randint(1, 10)):
        p = rng.choice(heads) + [rng.randrange(3) for _ in range(rng.randint(1, 16))]
        seqs.append(seq(p, max_tokens=rng.randint(1, 24)))
    longest = max(len(s.prompt_ids) + s.params.max_tokens - 1 for s in seqs)
    # window: a full, a sliding and a full layer (two KV groups), else one full group.
    groups = None
    if window is not None:
        full = KVLayerSpec(4, 2, 8)
        groups = kv_groups([full, KVLayerSpec(4, 2, 8, kind="sliding", window=window), full])
    need = PagedKVManager(2, block_size, groups=groups, max_chunk=chunk).blocks_needed(longest)
    num_blocks = need + 1 + extra_blocks
    sched, ex = make(
        num_blocks,
        block_size,
        prefix_cache,
        groups=groups,
        max_batched_tokens=budget,
        prefill_chunk=chunk,
        max_running=max_running,
    )
    done = run(sched, ex, [(rng.randint(0, 30), s) for s in seqs])
    check_outputs(done, seqs)


def test_next_token_is_deterministic():
    assert next_token([1, 2, 3, 4, 5]) == next_token([9, 2, 3, 4, 5])
    assert 3 <= next_token([1]) <= 1002
