"""The grammar worker (engine.grammar_worker): structured output's matchers advanced and masks
filled on a thread of their own. On a tiny random Qwen2 with Qwen's vocabulary and llguidance:
the tokens equal those of the masks filled on the engine's thread, in series and with a step in
flight, over random schemas; streaming equals generate; an abort mid-stream hangs nothing. With
a test backend: one thread touches the matchers, never two at once; a refused token and a
backend's failure surface as before. Over two ranks (gloo) the structured tokens equal one
rank's."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Sequence as Seq
from typing import Any

import pytest
import torch
from conftest import FIXTURES

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.hookspecs import hookimpl
from inferx_core.interfaces import GrammarBackend, GrammarError, GrammarMatcher
from inferx_core.plugins import Plugins
from inferx_core.sequence import SamplingParams

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

QWEN = FIXTURES / "tokenizers" / "qwen"
PROMPTS = [[9707, 11, 1879, 0], [785, 6722, 315, 9625, 374], [40, 1079], [151644, 872, 198]]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON schema of bounded output: objects, arrays with bounds, enums, anyOf,
    bounded integers, patterned and bounded strings, booleans."""
    kinds = ["integer", "string", "enum", "boolean", "pattern"]
    if depth < 2:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randrange(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randrange(1, 500)}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randrange(1, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-c]{2,4}$", "^[0-9]{3}$", "^x?y$"])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randrange(1, 4))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        lo = rng.randrange(0, 2)
        item = random_schema(rng, depth + 1)
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randrange(3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(2)]}
    names = rng.sample(["a", "bb", "id", "name", "tags", "x"], rng.randrange(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    return {
        "type": "object",
        "properties": props,
        "required": names,
        "additionalProperties": False,
    }


def make_llm(worker: bool, overlap: bool, reg: Plugins | None = None, **more: Any) -> LLM:
    config = {
        "model.preset": "tiny-qwen2",
        "model.tokenizer": str(QWEN),
        "model.dtype": "float32",
        "engine.device": "cpu",
        "kv_cache.num_blocks": 256,
        "engine.overlap": overlap,
        "engine.grammar_worker": worker,
        **more,
    }
    return LLM(load_config(None, config), reg=reg)


@pytest.fixture(scope="module")
def llms() -> dict[tuple[bool, bool], LLM]:
    return {(w, o): make_llm(w, o) for w in (True, False) for o in (True, False)}


def rows(seed: int) -> tuple[list[list[int]], list[SamplingParams], list[dict | None]]:
    """Prompts and params: random schemas (greedy and seeded sampling), json_object, a plain
    row beside them, and one schema twice (as n = 2 asks)."""
    rng = random.Random(seed)
    schemas: list[dict | None] = [random_schema(rng) for _ in range(4)]
    schemas += [schemas[0], {"type": "object"}, None]
    prompts, params = [], []
    for i, schema in enumerate(schemas):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        sampled = i % 2 == 1
        params.append(
            SamplingParams(
                max_tokens=40,
                temperature=0.9 if sampled else 0.0,
                seed=seed * 10 + i if sampled else None,
                json_schema=None if schema is None else json.dumps(schema),
            )
        )
    return prompts, params, schemas


def run(llm: LLM, prompts: list, params: list) -> list[tuple[list[int], str | None]]:
    done = llm.generate(prompts, params)
    assert llm.engine.kv.usage() == 0.0
    return [(c.token_ids, c.finish_reason) for c in done]


def within(seconds: float, fn: Any, *args: Any) -> Any:
    """fn(*args) on a daemon thread: its result, or TimeoutError after `seconds` (a hang fails
    the test instead of stopping the run)."""
    out: list[Any] = []

    def call() -> None:
        try:
            out.append((True, fn(*args)))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            out.append((False, exc))

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    if not out:
        raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not end in {seconds} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


@pytest.mark.parametrize("seed", range(4))
def test_the_worker_gives_the_tokens_of_the_engine_thread(llms, seed: int) -> None:
    """Same tokens and finish reasons with the masks filled on the worker's thread as on the
    engine's, in series and with a step in flight; every finished reply validates."""
    prompts, params, schemas = rows(seed)
    want = run(llms[False, False], prompts, params)
    for worker, overlap in [(True, False), (True, True), (False, True)]:
        llm = llms[worker, overlap]
        before = llm.engine.grammars.worker.masks_filled
        assert run(llm, prompts, params) == want, (worker, overlap)
        assert llm.engine.grammars.worker.threaded == worker
        assert llm.engine.grammars.worker.masks_filled > before
    tok = llms[False, False].tokenizer
    for (ids, reason), schema in zip(want, schemas, strict=True):
        if schema is not None and reason == "stop":
            text = tok.decode(ids, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), schema)


def test_streaming_equals_generate_and_an_abort_hangs_nothing(llms) -> None:
    """With the worker and a step in flight: a streamed structured reply equals the generated
    one; a stream left mid-way aborts its request, and the engine serves on (no step waits on
    work the worker never does, no blocks kept)."""
    llm = llms[True, True]
    prompts, params, _ = rows(7)
    want = run(llm, prompts[:1], params[:1])[0][0]

    def stream_then_abort() -> list[int]:
        got = [t for out in llm.stream(prompts[0], params[0]) for t in out.token_ids]
        stream = llm.stream(prompts[1], params[1])
        for _, _ in zip(stream, range(3), strict=False):
            pass
        stream.close()  # its finally aborts the request, a step of it still in flight
        while llm.engine.has_work():
            llm.engine.step()
        return got

    got = within(120, stream_then_abort)
    assert got == want
    assert llm.engine.kv.usage() == 0.0 and not llm.engine.requests
    assert run(llm, prompts[:2], params[:2]) == run(llms[False, False], prompts[:2], params[:2])


def test_a_bad_schema_is_still_a_grammar_error(llms) -> None:
    for worker in (True, False):
        llm = llms[worker, True]
        bad = SamplingParams(max_tokens=4, json_schema='{"type": "foo"}')
        with pytest.raises(GrammarError, match="Invalid type"):
            llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=4), bad])
        assert not llm.engine.requests  # all or none: the good one is not left running


# -- a test backend: who touches the matchers, refusals, failures --------------------------------


class Guard:
    """Records the threads that touch matchers; two at once is a violation."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads: set[int] = set()
        self.overlaps = 0

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            self.overlaps += 1
            self.lock.acquire()
        self.threads.add(threading.get_ident())

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


GUARD = Guard()


class EvenMatcher(GrammarMatcher):
    """Allows even token ids below 400; refuses its `refuse_at`-th token, raises at its
    `fail_at`-th; terminated after `length` tokens."""

    def __init__(self, backend: EvenBackend, spec: dict) -> None:
        self.backend = backend
        self.length = spec.get("length", 6)
        self.refuse_at = spec.get("refuse_at")
        self.fail_at = spec.get("fail_at")
        self.seen: list[int] = []

    def accept(self, token: int) -> bool:
        with GUARD:
            self.seen.append(token)
            if len(self.seen) == self.fail_at:
                raise RuntimeError(f"the matcher broke at token {self.fail_at}")
            return len(self.seen) != self.refuse_at

    def is_terminated(self) -> bool:
        if not self.seen:  # a fresh matcher, asked as its state is made: not shared yet
            return False
        with GUARD:
            return len(self.seen) >= self.length


class EvenBackend(GrammarBackend):
    def __init__(self, tokenizer: object = None, vocab_size: int = 0) -> None:
        self.vocab_size = vocab_size

    def compile(self, schema: str, kind: str = "json_schema") -> dict:
        return json.loads(schema)

    def matcher(self, compiled: dict) -> EvenMatcher:
        return EvenMatcher(self, compiled)

    def fill_bitmask(self, matchers: Seq[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        with GUARD:
            word = 0x55555555 - (1 << 32) if 0x55555555 >> 31 else 0x55555555  # even bits
            for i, m in enumerate(matchers):
                if m is not None:
                    bitmask[i].zero_()
                    bitmask[i, : 400 // 32] = word


class EvenPlugin:
    @hookimpl
    def inferx_grammar_backends(self, register: object) -> None:
        register("even", EvenBackend)  # type: ignore[operator]


def even_llm(worker: bool, overlap: bool) -> LLM:
    reg = Plugins()  # the entry points' plugins, and this one
    reg.register(EvenPlugin(), package="test")
    config = {"engine.grammar_backend": "even", "model.max_model_len": 128}
    return make_llm(worker, overlap, reg=reg, **config)


def even(length: int = 6, **spec: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=20, temperature=0, json_schema=json.dumps({"length": length, **spec})
    )


def test_one_thread_touches_the_matchers_and_refusals_end_a_reply(caplog) -> None:
    """Under the worker with a step in flight, only the worker's thread touches the matchers,
    never two threads at once; a reply ends when its grammar is complete; a refused token
    ends it with a warning, as on the engine's thread."""
    got = {}
    for worker in (False, True):
        llm = even_llm(worker, overlap=True)
        GUARD.threads.clear()
        with caplog.at_level(logging.WARNING, logger="inferx.engine"):
            caplog.clear()
            got[worker] = run(llm, PROMPTS[:3], [even(5, refuse_at=3), even(9), even(4)])
            refused = got[worker][0][0][2]
            assert f"the grammar refused token {refused}" in caplog.text
        if worker:
            assert GUARD.threads and threading.get_ident() not in GUARD.threads
            assert len(GUARD.threads) == 1
        for (ids, reason), n in zip(got[worker], (3, 9, 4), strict=True):
            assert len(ids) == n and reason == "stop" and all(t % 2 == 0 for t in ids)
    assert got[True] == got[False]
    assert GUARD.overlaps == 0


class SlowBackend(EvenBackend):
    """Fills like EvenBackend in 30 ms outside the GIL, as llguidance's batched fill is."""

    def fill_bitmask(self, matchers: Seq[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        time.sleep(0.03)
        super().fill_bitmask(matchers, bitmask)


class SlowPlugin:
    @hookimpl
    def inferx_grammar_backends(self, register: object) -> None:
        register("slow", SlowBackend)  # type: ignore[operator]


def test_the_masks_fill_while_the_engine_applies_the_step_before() -> None:
    """With a step in flight, the worker fills step N+1's masks while the engine's thread
    applies step N (here 30 ms of it): the engine waits for little of the fill's time, where
    inline it waits for all of it; the tokens are the same."""
    got, waits = [], []
    for worker in (False, True):
        reg = Plugins()
        reg.register(SlowPlugin(), package="test")
        config = {"engine.grammar_backend": "slow", "model.max_model_len": 128}
        llm = make_llm(worker, True, reg=reg, **config)
        engine = llm.engine
        apply = engine._apply

        def slow_apply(*args: Any, _apply: Any = apply) -> Any:
            time.sleep(0.03)  # the host's own work on a step (detokenizing, a server's)
            return _apply(*args)

        engine._apply = slow_apply  # type: ignore[method-assign]
        got.append(run(llm, PROMPTS[:2], [even(12), even(12)]))
        grammar = engine.grammars.worker
        waits.append(grammar.wait_s / grammar.work_s)
    assert got[0] == got[1]
    assert waits[0] > 0.95 and waits[1] < 0.5, waits


def test_a_failing_matcher_is_an_error_not_a_hang() -> None:
    for worker in (False, True):
        llm = even_llm(worker, overlap=True)
        with pytest.raises(RuntimeError, match="the matcher broke at token 2"):
            within(60, llm.generate, PROMPTS[:2], [even(8, fail_at=2), even(8)])


# -- tensor parallel -----------------------------------------------------------------------------


@pytest.mark.slow
def test_structured_rows_over_two_ranks_give_the_tokens_of_one(llms) -> None:
    """Rank 0 samples a structured step once its masks are filled, when the next step is
    submitted: before that step's plan goes to the ranks, which wait in the step's broadcast
    of the sampled ids (gloo blocks the host there). Tokens equal one rank's."""
    prompts, params, _ = rows(11)
    want = run(llms[False, False], prompts, params)
    llm = make_llm(True, True, **{"parallel.tensor": 2})
    try:
        assert llm.engine.overlap
        got = within(300, run, llm, prompts, params)
    finally:
        llm.engine.executor.close()
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_worker_on_the_gpu_with_graphs_gives_the_tokens_of_the_engine_thread() -> None:
    """On the GPU (CUDA graphs, a step in flight, pinned masks): the worker's tokens equal the
    engine thread's over random schemas, and the masks were filled on the worker's thread."""
    results = []
    for worker in (False, True):
        llm = LLM(
            load_config(
                None,
                {
                    "model.preset": "tiny-qwen2",
                    "model.tokenizer": str(QWEN),
                    "engine.device": "cuda",
                    "kv_cache.num_blocks": 512,
                    "engine.grammar_worker": worker,
                },
            )
        )
        assert llm.engine.overlap and llm.engine.executor.graphs is not None
        out = []
        for seed in range(3):
            prompts, params, _ = rows(seed)
            out.append(run(llm, prompts * 8, params * 8))
        results.append(out)
        grammar = llm.engine.grammars.worker
        assert grammar.masks_filled > 0 and (grammar._pool is not None) == worker
        del llm
    assert results[0] == results[1]
