"""Structured output on the engine's side: picks the grammar backend, keeps compiled schemas in
an LRU cache, and makes each structured sequence its matcher. The backend (a plugin) is built on
the first structured request, so start-up pays nothing for it."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from inferx_core.config import EngineSection
from inferx_core.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher
from inferx_core.plugins import Plugins
from inferx_core.sequence import canonical_schema

log = logging.getLogger("inferx.grammar")

# What "auto" tries, in order.
PREFERRED = ("llguidance",)


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

    def matcher(self, schema: str) -> GrammarMatcher:
        """A matcher for `schema` (canonical JSON text); raises GrammarError when the backend
        cannot compile it."""
        backend = self.backend
        compiled = self._cache.get(schema)
        if compiled is None:
            compiled = backend.compile(schema)
            if self.config.grammar_cache_size:
                self._cache[schema] = compiled
                if len(self._cache) > self.config.grammar_cache_size:
                    self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(schema)
        return backend.matcher(compiled)


__all__ = ["GrammarError", "Grammars", "canonical_schema"]
