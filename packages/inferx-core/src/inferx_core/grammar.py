"""Structured output on the engine's side: picks the grammar backend, keeps compiled schemas in
an LRU cache, gives each structured sequence its matcher (a GrammarState), and advances the
matchers and fills their token masks (a GrammarWorker), on a thread of their own by default so
that this work overlaps the engine's. The backend (a plugin) is built on the first structured
request, so an offline engine's start-up pays nothing for it; a server preloads it on a thread
once its engine is up (Grammars.preload), since building it reads the whole vocabulary (about a
second for a 150k vocabulary) and every structured request arriving meanwhile waits for it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from inferx_core.config import EngineSection
from inferx_core.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher
from inferx_core.plugins import Plugins
from inferx_core.sequence import PENDING, Sequence, canonical_schema

log = logging.getLogger("inferx.grammar")

# What "auto" tries, in order.
PREFERRED = ("llguidance",)

# The token a step in flight sampled for a sequence (it waits for that step's copy).
Previous = Callable[[Sequence], int]


@dataclass(eq=False)
class GrammarState:
    """A structured sequence's matcher and how far it has read the sequence's output.

    Exactly one thread touches the matcher at a time: its worker's (GrammarWorker), which
    also writes `accepted`, `refused` and `terminated`. The engine's thread writes `queued`
    (output tokens handed to the worker) and `advanced` (the worker's task that reads the
    last of them), and reads the worker's fields only once that task is done."""

    matcher: GrammarMatcher
    worker: GrammarWorker = field(default_factory=lambda: INLINE)
    accepted: int = 0  # output tokens the matcher has consumed
    refused: int | None = None  # a token the matcher refused (the sequence is then done)
    terminated: bool = False  # the matcher is complete: nothing but EOS may follow
    queued: int = 0
    advanced: Future | None = None

    def __post_init__(self) -> None:
        self.terminated = self.matcher.is_terminated()

    @property
    def done(self) -> bool:
        """Complete (nothing but EOS may follow) or broken: its rows are no longer masked."""
        return self.refused is not None or self.terminated

    def feed(self, tokens: list[int]) -> None:
        """The worker's: advance the matcher by `tokens`, in order (none after a refusal)."""
        for token in tokens:
            if self.refused is not None:
                return
            self.record(token, self.matcher.accept(token))
        self.terminated = self.matcher.is_terminated()

    def record(self, token: int, accepted: bool) -> None:
        """The worker's: the matcher took `token` (or refused it, when not `accepted`)."""
        self.accepted += 1
        if not accepted:
            self.refused = token


class GrammarMasks:
    """A step's token masks on their way: wait() gives the host bitmask once it is filled."""

    def __init__(self, worker: GrammarWorker, filled: Future) -> None:
        self.worker = worker
        self.filled = filled

    def wait(self) -> torch.Tensor | None:
        """int32 [rows, ceil(vocab / 32)] on the host (pinned where the logits are on CUDA),
        all ones for unconstrained rows; None when no row is masked."""
        return self.worker.wait(self.filled)


class GrammarWorker:
    """Advances structured sequences' matchers and fills their next-token bitmasks, in the
    order asked: on one thread of its own (`threaded`, engine.grammar_worker) or at once on
    the caller's. The caller hands over what a task reads (the tokens, copied out of the
    sequences) when it asks, so the worker never reads a sequence the engine is changing.

    wait_s: seconds the caller's thread spent waiting for this work (all of it, inline);
    work_s: seconds of the work itself; masks_filled: steps whose masks it filled."""

    def __init__(self, threaded: bool = True) -> None:
        self.threaded = threaded
        self._pool: ThreadPoolExecutor | None = None  # started on the first task
        self.wait_s = 0.0
        self.work_s = 0.0
        self.masks_filled = 0

    def _run(self, fn: Callable[..., Any], *args: Any) -> Future:
        if not self.threaded:
            done: Future = Future()
            t0 = time.perf_counter()
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)
            self.wait_s += time.perf_counter() - t0
            return done
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inferx-grammar")
        return self._pool.submit(fn, *args)

    def wait(self, task: Future) -> Any:
        """The task's result (its exception raised here), counting the wait."""
        if task.done():
            return task.result()
        t0 = time.perf_counter()
        try:
            return task.result()
        finally:
            self.wait_s += time.perf_counter() - t0

    def masks(
        self, seqs: Seq[Sequence], previous: Previous | None, vocab: int, pin: bool = False
    ) -> GrammarMasks:
        """Queue the masks of a step that samples one token for each of `seqs`: each
        structured row's matcher first reads the output before that token (a PENDING one is
        `previous(seq)`, which a step in flight sampled), then the rows' bitmask is filled.
        One task does both, so the worker takes the GIL back as seldom as it can."""
        feeds, advanced = self._hand_over(seqs, lambda seq: len(seq.token_ids) - 1)
        rows = [(i, seq.grammar) for i, seq in enumerate(seqs) if seq.grammar is not None]
        words = (vocab + 31) // 32
        # A fresh pinned buffer each step: torch's host allocator reuses one only after the
        # copies queued from it are done.
        host = torch.empty((len(seqs), words), dtype=torch.int32, pin_memory=pin)
        return GrammarMasks(self, self._run(self._masks, feeds, previous, advanced, rows, host))

    def catch_up(self, seqs: Seq[Sequence]) -> None:
        """Bring each structured sequence's matcher up to its known output (no PENDING token
        left) and wait until it has read it; then its done/refused fields are current."""
        feeds, advanced = self._hand_over(seqs, lambda seq: len(seq.token_ids) - seq.num_pending)
        if feeds:
            self._run(self._advance, feeds, None, advanced)
        tasks = {id(s.grammar.advanced): s.grammar.advanced for s in seqs if s.grammar is not None}
        for task in tasks.values():
            if task is not None:
                self.wait(task)

    def _hand_over(
        self, seqs: Seq[Sequence], end_of: Callable[[Sequence], int]
    ) -> tuple[list[tuple[Sequence, GrammarState, list[int]]], Future | None]:
        """The structured rows' output tokens up to end_of(seq) not yet handed over, and the
        future their states wait on until the worker has read them."""
        feeds = []
        for seq in seqs:
            state = seq.grammar
            if state is None:
                continue
            start, end = seq.num_prompt + state.queued, end_of(seq)
            if end > start:
                feeds.append((seq, state, seq.token_ids[start:end]))
                state.queued = end - seq.num_prompt
        if not feeds:
            return feeds, None
        advanced: Future = Future()
        for _, state, _ in feeds:
            state.advanced = advanced
        return feeds, advanced

    def _masks(
        self,
        feeds: list[tuple[Sequence, GrammarState, list[int]]],
        previous: Previous | None,
        advanced: Future | None,
        rows: list[tuple[int, GrammarState]],
        host: torch.Tensor,
    ) -> torch.Tensor | None:
        if advanced is not None:
            self._advance(feeds, previous, advanced)
        return self._fill(rows, host)

    def _advance(
        self,
        feeds: list[tuple[Sequence, GrammarState, list[int]]],
        previous: Previous | None,
        advanced: Future,
    ) -> None:
        """Feed each state its tokens, then settle `advanced` (with the failure, if any)."""
        t0 = time.perf_counter()
        try:
            single = []
            for seq, state, tokens in feeds:
                if PENDING in tokens:
                    if previous is None:
                        raise RuntimeError(f"{seq.request_id}: a grammar met a PENDING token")
                    tokens = [previous(seq) if t == PENDING else t for t in tokens]
                if len(tokens) == 1 and state.refused is None:
                    single.append((state, tokens[0]))
                else:
                    state.feed(tokens)
            if single:  # the common case, a decode step's token: one batched call
                backend = single[0][0].matcher.backend
                ok = backend.accept_tokens([(s.matcher, t) for s, t in single])
                for (state, token), good in zip(single, ok, strict=True):
                    state.record(token, good)
                    state.terminated = state.matcher.is_terminated()
        except BaseException as exc:
            advanced.set_exception(exc)
            raise
        else:
            advanced.set_result(None)
        finally:
            self.work_s += time.perf_counter() - t0

    def _fill(
        self, rows: list[tuple[int, GrammarState]], host: torch.Tensor
    ) -> torch.Tensor | None:
        t0 = time.perf_counter()
        try:
            matchers: list[GrammarMatcher | None] = [None] * host.shape[0]
            live = [(i, s.matcher) for i, s in rows if not s.done]
            if not live:
                return None
            for i, m in live:
                matchers[i] = m
            # the buffer may be an inference tensor, and the mode is a thread's own
            with torch.inference_mode():
                if len(live) < len(matchers):
                    host.fill_(-1)
                live[0][1].backend.fill_bitmask(matchers, host)
            self.masks_filled += 1
            return host
        finally:
            self.work_s += time.perf_counter() - t0


def catch_up(seqs: Seq[Sequence]) -> None:
    """GrammarWorker.catch_up for structured sequences, on each one's worker."""
    workers: dict[int, tuple[GrammarWorker, list[Sequence]]] = {}
    for seq in seqs:
        if seq.grammar is not None:
            workers.setdefault(id(seq.grammar.worker), (seq.grammar.worker, []))[1].append(seq)
    for worker, group in workers.values():
        worker.catch_up(group)


# States made outside an engine (tests, tools) advance on the caller's thread.
INLINE = GrammarWorker(threaded=False)


def grammar_masks(
    seqs: Seq[Sequence], previous: Previous | None, vocab: int, pin: bool = False
) -> GrammarMasks | None:
    """The step's masks, queued on the structured rows' worker; None when no row has a grammar."""
    state = next((s.grammar for s in seqs if s.grammar is not None), None)
    if state is None:
        return None
    return state.worker.masks(seqs, previous, vocab, pin)


class Grammars:
    """The engine's grammar backend, its cache of compiled schemas, and its GrammarWorker."""

    def __init__(
        self, config: EngineSection, reg: Plugins, tokenizer: Any, vocab_size: int | None
    ) -> None:
        self.config = config
        self.reg = reg
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._loader: threading.Thread | None = None
        self._load_error: BaseException | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.worker = GrammarWorker(threaded=config.grammar_worker)
        name = config.grammar_backend
        if name != "auto" and name not in reg.names("grammar_backend"):
            known = ", ".join(["auto", *reg.names("grammar_backend")])
            raise ValueError(f"engine.grammar_backend: unknown backend {name!r}; known: {known}")

    def preload(self) -> None:
        """Build the backend now, on a thread of its own; the first structured request waits
        for it (and gets its error, if building it failed). Nothing without a tokenizer."""
        if self.tokenizer is None or self._backend is not None or self._loader is not None:
            return
        self._loader = threading.Thread(target=self._preload, name="inferx-grammar-load")
        self._loader.daemon = True
        self._loader.start()

    def _preload(self) -> None:
        try:
            self._backend = self._build()
        except BaseException as exc:  # noqa: BLE001 - raised to the first structured request
            self._load_error = exc

    @property
    def backend(self) -> GrammarBackend:
        if self._loader is not None:
            self._loader.join()
            self._loader = None
            if self._load_error is not None:
                exc, self._load_error = self._load_error, None
                raise exc
        if self._backend is None:
            self._backend = self._build()
        return self._backend

    def _build(self) -> GrammarBackend:
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer; it has none")
        name = self._pick()
        cls = self.reg.get("grammar_backend", name)
        vocab = self.vocab_size or self.tokenizer.vocab_size
        backend = cls(self.tokenizer, vocab)  # type: ignore[operator]
        log.info("structured output: grammar backend %s", name)
        return backend

    def _pick(self) -> str:
        name = self.config.grammar_backend
        if name != "auto":
            return name
        names = self.reg.names("grammar_backend")
        for preferred in PREFERRED:
            if preferred in names:
                return preferred
        if names:
            return names[0]
        raise ValueError(
            "structured output needs a grammar backend (engine.grammar_backend) and none is "
            "installed: pip install inferx-server, which brings llguidance"
        )

    def state(self, schema: str, kind: str = "json_schema") -> GrammarState:
        """A fresh GrammarState for a sequence constrained by `schema` (a grammar of `kind`)."""
        return GrammarState(self.matcher(schema, kind), self.worker)

    def matcher(self, schema: str, kind: str = "json_schema") -> GrammarMatcher:
        """A matcher for `schema` (canonical JSON text, or a grammar of another `kind`: see
        GrammarBackend.compile); raises GrammarError when the backend cannot compile it."""
        backend = self.backend
        key = schema if kind == "json_schema" else f"{kind}:{schema}"
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = backend.compile(schema, kind)
            if self.config.grammar_cache_size:
                self._cache[key] = compiled
                if len(self._cache) > self.config.grammar_cache_size:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return backend.matcher(compiled)


__all__ = [
    "GrammarError",
    "GrammarMasks",
    "GrammarState",
    "GrammarWorker",
    "Grammars",
    "canonical_schema",
    "catch_up",
    "grammar_masks",
]
