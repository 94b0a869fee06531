"""engine.gc_freeze: a started engine moves the start-up heap out of the collector's walks, so a
full collection in a step does not stall it; a step's own garbage is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from fake_executor import FakeExecutor

from inferx_core.config import load_config
from inferx_core.engine import Engine
from inferx_core.sequence import SamplingParams

pytestmark = pytest.mark.real_gc_freeze


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_started_engine_freezes_the_heap() -> None:
    # Long-lived start-up state the engine does not own: it is frozen with the rest.
    startup = [[i] for i in range(10_000)]
    engine = Engine(load_config(None, {}), executor=FakeExecutor(64, 16))
    assert gc.get_freeze_count() >= len(startup)
    # A full collection now walks only what was made since, not the start-up heap.
    assert len(gc.get_objects(generation=2)) < len(startup)
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    assert len(tokens) == 4
    # Garbage made after the freeze is collected as usual.
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_gc_freeze_off_freezes_nothing() -> None:
    Engine(load_config(None, {"engine.gc_freeze": False}), executor=FakeExecutor(64, 16))
    assert gc.get_freeze_count() == 0


class _Weights:
    """Stands for a model's weights: something a dropped engine must not keep alive."""


def test_a_new_engine_frees_what_a_dropped_frozen_one_held() -> None:
    """An engine dropped while frozen, held only by a reference cycle (as CUDA-graph runners
    holding bound methods make), is freed when the next engine starts, before it allocates."""
    first = Engine(load_config(None, {}), executor=FakeExecutor(64, 16))
    weights = _Weights()
    first.weights = weights  # type: ignore[attr-defined]
    first.cycle = first  # type: ignore[attr-defined]
    gc.collect()
    gc.freeze()  # as if the engine had frozen after taking its weights
    alive = weakref.ref(weights)
    del first, weights
    gc.collect()
    assert alive() is not None  # frozen: the collector does not see the dead cycle
    Engine(load_config(None, {}), executor=FakeExecutor(64, 16))
    assert alive() is None
