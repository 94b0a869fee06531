"""Structured output's grammar backend on llguidance: JSON schemas compiled for the engine's
vocabulary, one LLMatcher per sequence; a step's tokens accepted and every structured row's token
mask filled in one call each, on llguidance's own threads (outside the GIL)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from inferx_core.interfaces.grammar import GrammarBackend, GrammarError, GrammarMatcher

# Compact JSON with no free whitespace: a small model left free to emit whitespace may write it
# until max_tokens; compact output is also the fewest tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, backend: LLGuidanceBackend, matcher: llguidance.LLMatcher) -> None:
        self.backend = backend
        self.ll = matcher

    def accept(self, token: int) -> bool:
        return self.ll.consume_token(token)

    def is_terminated(self) -> bool:
        return self.ll.is_stopped()


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # tokenizer.json as the tokenizers library writes it: llguidance reads the same
        # vocabulary and byte-level decoding the engine uses, ids past it never allowed.
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(),
            n_vocab=vocab_size,
            eos_token=sorted(tokenizer.eos_token_ids) or None,
        )
        # Mask filling on a few threads: the rows of a step are independent.
        self.executor = llguidance.LLExecutor(min(8, os.cpu_count() or 1))

    def compile(self, schema: str, kind: str = "json_schema") -> str:
        what = {"json_schema": "the JSON schema", "lark": "the grammar"}.get(kind)
        if what is None:
            raise GrammarError(f"llguidance has no grammar kind {kind!r}")
        try:
            if kind == "lark":
                grammar = llguidance.LLMatcher.grammar_from_lark(schema)
            else:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    schema, defaults=JSON_OPTIONS
                )
        except ValueError as exc:
            raise GrammarError(f"{what} cannot be used: {exc}") from None
        # Constructing a matcher compiles the grammar against the vocabulary; llguidance's
        # resource limits bound the work, so a hostile schema is an error here, not a hang.
        probe = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if probe.is_error():
            raise GrammarError(f"{what} cannot be used: {probe.get_error()}")
        return grammar

    def matcher(self, compiled: str) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self, llguidance.LLMatcher(self.tokenizer, compiled, log_level=0))

    def accept_tokens(self, pairs: Sequence[tuple[GrammarMatcher, int]]) -> list[bool]:
        if len(pairs) < 2:
            return super().accept_tokens(pairs)
        return self.executor.consume_token_par([(m.ll, t) for m, t in pairs])  # type: ignore[attr-defined]

    def fill_bitmask(
        self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor
    ) -> None:
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu":
            raise ValueError("the bitmask must be an int32 CPU tensor")
        if not bitmask.is_contiguous() or bitmask.shape[0] < len(matchers):
            raise ValueError(f"the bitmask {tuple(bitmask.shape)} is not contiguous rows enough")
        if bitmask.shape[1] * 32 < self.vocab_size:
            raise ValueError(f"the bitmask's {bitmask.shape[1]} words < vocab {self.vocab_size}")
        rows = [(m.ll, i) for i, m in enumerate(matchers) if isinstance(m, LLGuidanceMatcher)]
        if rows:
            self.executor.unsafe_compute_mask_ptr(
                rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
            )
