"""Structured output on the engine's side: picks the grammar backend, keeps compiled schemas in
an LRU cache, and gives each structured sequence its matcher (a GrammarState, which counts the
output tokens the matcher has seen). The backend (a plugin) is built on the first structured
request, so start-up pays nothing for it."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferx_core.config import EngineSection
from inferx_core.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher
from inferx_core.plugins import Plugins
from inferx_core.sequence import PENDING, Sequence, canonical_schema

log = logging.getLogger("inferx.grammar")

# What "auto" tries, in order.
PREFERRED = ("llguidance",)


@dataclass(eq=False)
class GrammarState:
    """A structured sequence's matcher and how far it has read the sequence's output.

    The matcher is fed lazily, by whoever needs it current: the sampler before it fills the
    mask of the token it samples now (with one step in flight, the previous step's token is
    still PENDING on the host and comes from that step's result), and the engine after each
    step's update, which finishes the sequence once its grammar is complete."""

    matcher: GrammarMatcher
    accepted: int = 0  # output tokens the matcher has consumed
    refused: int | None = None  # a token the matcher refused (the sequence is then done)

    def catch_up(
        self, seq: Sequence, end: int, pending: Callable[[Sequence], int] | None = None
    ) -> None:
        """Feed the matcher seq.token_ids[num_prompt + accepted : end]; a PENDING token there
        is asked of `pending` (the token a step in flight sampled)."""
        start = seq.num_prompt + self.accepted
        for token in seq.token_ids[start:end]:
            if self.refused is not None:
                return
            if token == PENDING:
                if pending is None:
                    raise RuntimeError(f"{seq.request_id}: a grammar met a PENDING token")
                token = pending(seq)
            self.accepted += 1
            if not self.matcher.accept(token):
                self.refused = token

    @property
    def done(self) -> bool:
        """Complete (nothing but EOS may follow) or broken: its rows are no longer masked."""
        return self.refused is not None or self.matcher.is_terminated()


class Grammars:
    """The engine's grammar backend and its cache of compiled schemas."""

    def __init__(
        self, config: EngineSection, reg: Plugins, tokenizer: Any, vocab_size: int | None
    ) -> None:
        self.config = config
        self.reg = reg
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        name = config.grammar_backend
        if name != "auto" and name not in reg.names("grammar_backend"):
            known = ", ".join(["auto", *reg.names("grammar_backend")])
            raise ValueError(f"engine.grammar_backend: unknown backend {name!r}; known: {known}")

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer; it has none")
            name = self._pick()
            cls = self.reg.get("grammar_backend", name)
            vocab = self.vocab_size or self.tokenizer.vocab_size
            self._backend = cls(self.tokenizer, vocab)  # type: ignore[operator]
            log.info("structured output: grammar backend %s", name)
        return self._backend

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
        return GrammarState(self.matcher(schema, kind))

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


__all__ = ["GrammarError", "GrammarState", "Grammars", "canonical_schema"]
