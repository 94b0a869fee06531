"""Requests as the scheduler sees them: token ids, sampling parameters, progress. No torch."""

from __future__ import annotations

import enum
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def canonical_schema(schema: str | dict | bool) -> str:
    """A JSON schema as compact JSON text (the cache's key; key order is kept, since it orders
    the output's properties); raises ValueError when it is not JSON or not a schema's shape (an
    object or a boolean)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"a JSON schema is an object (or a boolean), not {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"))


class SamplingParams(BaseModel):
    """How to pick tokens and when to stop. Validated once, when the request arrives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # 0 (or -1, normalised to 0): no top-k
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # the sampler's int64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias); a dict
    # {id: bias} is taken too. A tuple keeps the params hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: a JSON schema (JSON text, or a dict) the output must be a JSON value of;
    # '{"type": "object"}' is any JSON object (OpenAI's json_object). Kept as compact JSON
    # text, the key under which the engine caches the compiled grammar.
    json_schema: str | None = None
    # Or a grammar in llguidance's Lark dialect (which may embed JSON schemas with %json): tool
    # calls held to the tools' schemas between a model family's markers. One of the two at most.
    lark_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalise(cls, data: object) -> object:
        if isinstance(data, dict):
            data = dict(data)
            if data.get("top_k") == -1:
                data["top_k"] = 0
            if isinstance(data.get("stop"), str):
                data["stop"] = (data["stop"],)
            if isinstance(data.get("logit_bias"), dict):
                data["logit_bias"] = tuple(sorted(data["logit_bias"].items()))
            if isinstance(data.get("json_schema"), dict | bool):
                data["json_schema"] = canonical_schema(data["json_schema"])
        return data

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, v: str | None) -> str | None:
        return None if v is None else canonical_schema(v)

    @model_validator(mode="after")
    def _one_grammar(self) -> SamplingParams:
        if self.json_schema is not None and self.lark_grammar is not None:
            raise ValueError("json_schema and lark_grammar exclude each other; give one")
        return self

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar the output is held to, or None."""
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.lark_grammar is not None:
            return ("lark", self.lark_grammar)
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        for token, bias in v:
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {token} is {bias}, outside [-100, 100]")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """Sampling reads the tokens generated so far on the host (the penalties)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


PENDING = -1  # in token_ids: a token that a step in flight is sampling, not known yet


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's state. The scheduler and KV manager own the mutable fields.

    token_ids: the prompt followed by the generated tokens; `num_prompt` marks the boundary. The
        last `num_pending` entries are PENDING: tokens that scheduled steps will sample (one per
        step in flight); update() fills them in.
    num_computed: tokens at the front of `token_ids` whose KV is in the cache or is being written
        by a step already scheduled (the device runs steps in order).
    block_tables: one table of KV block ids per KV group (group 0 first), in order, covering at
        least `num_computed` tokens; a sliding group's entries behind its window are 0 (freed).
        `block_table` is group 0's.
    num_cached: prompt tokens that the prefix cache supplied at the last admission.
    """

    token_ids: list[int]  # the prompt, then every generated token
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    num_prompt: int = -1  # set from token_ids at construction
    status: Status = Status.WAITING
    block_tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed: int = 0
    num_cached: int = 0
    num_preemptions: int = 0
    num_pending: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival: float = field(default_factory=time.monotonic)
    eos_token_ids: frozenset[int] = frozenset()
    # Structured output: the GrammarState (inferx_core.grammar: a matcher and how much of the
    # output it has read) that masks this sequence's logits; None when unconstrained.
    grammar: Any = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt < 0:
            self.num_prompt = len(self.token_ids)

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table (the only one of a single-group model)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens known so far (no PENDING)."""
        return self.outputs_from(0)

    def outputs_from(self, start: int) -> list[int]:
        """The known generated tokens from output index `start` on (one slice, no PENDING)."""
        return self.token_ids[self.num_prompt + start : len(self.token_ids) - self.num_pending]

    @property
    def known_ids(self) -> list[int]:
        """The prompt and the generated tokens known so far (no PENDING)."""
        return self.token_ids[: len(self.token_ids) - self.num_pending]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        """Generated tokens known so far."""
        return len(self.token_ids) - self.num_prompt - self.num_pending

    @property
    def max_length(self) -> int:
        """Tokens the sequence ends at when nothing stops it sooner (prompt + max_tokens)."""
        return self.num_prompt + self.params.max_tokens

    def drop_pending(self) -> None:
        """Forget the tokens that steps still in flight will sample (the sequence is done)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending :]
            self.num_pending = 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
