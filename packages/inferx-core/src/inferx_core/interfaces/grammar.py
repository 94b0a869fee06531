"""The grammar contract for structured output: a backend compiles a JSON schema once and makes a
matcher per sequence; matchers say which tokens may come next as a bitmask and advance with each
sampled token. Matchers live on the host beside their Sequence; the sampler applies their masks
to the logits on the device. A matcher is made on the engine's thread and then used (accept,
is_terminated, fill_bitmask, accept_tokens) by one thread at a time, the engine's grammar worker
by default: a backend must allow that thread to be another than the one that made it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class GrammarError(ValueError):
    """A schema the backend cannot compile (invalid, unsatisfiable or unsupported); the message
    names the problem. A ValueError, so a server turns it into a 400."""


class GrammarMatcher(ABC):
    """One sequence's position in its grammar."""

    backend: GrammarBackend

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete and the grammar allows nothing more (EOS at most)."""


class GrammarBackend(ABC):
    """Built as `Cls(tokenizer, vocab_size)`: the engine's Tokenizer and the width of the
    logits (which may exceed the tokenizer's vocabulary; the extra ids are never allowed)."""

    @abstractmethod
    def compile(self, schema: str, kind: str = "json_schema") -> Any:
        """A grammar compiled for this vocabulary; raises GrammarError. `kind` "json_schema":
        `schema` is a JSON schema (JSON text); "lark": a grammar in llguidance's Lark dialect
        (with %json rules), which tool calls use. A backend refuses a kind it lacks with a
        GrammarError naming it."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""

    @abstractmethod
    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor
    ) -> None:
        """Row i of `bitmask` (int32 [len(matchers), ceil(vocab / 32)], on the CPU) gets the
        tokens matchers[i] allows next: token t is bit t % 32 of word t // 32. Rows whose
        matcher is None are left as they are."""

    def accept_tokens(self, pairs: Sequence[tuple[GrammarMatcher, int]]) -> list[bool]:
        """Advance each matcher by its token (one pair a matcher), as accept() does; a backend
        may do them in parallel."""
        return [m.accept(t) for m, t in pairs]
