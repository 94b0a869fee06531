"""The scheduler contract: all policy about who runs, how much, and who waits. No torch here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from inferx_core.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """seq runs tokens [start, start + num_tokens) of its token_ids this step.

    `sample` is True when the chunk ends at the sequence's last token, so the step yields a new
    token for it; a prompt chunk that stops short of the end samples nothing.
    """

    seq: Sequence
    start: int
    num_tokens: int
    sample: bool


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of those, tokens found
    preemptions: int = 0


class Scheduler(ABC):
    """Decides each step's batch. Owns the waiting and running queues and the KVManager calls.

    Life of a step: schedule() -> the executor runs the chunks -> update() with the tokens
    sampled for the chunks whose `sample` is True (in chunk order). The engine may call
    schedule() for the next step before update() of this one (one step in flight); tokens
    still to be sampled then stand in token_ids as PENDING (see sequence.Sequence).
    """

    @abstractmethod
    def add(self, seq: Sequence) -> None:
        """Queue a new request."""

    @abstractmethod
    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request now ("abort") and free its blocks; None if unknown or finished."""

    @abstractmethod
    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a running sequence for a reason found outside (a stop string) and free it."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks under the token budget; may preempt to find blocks."""

    @abstractmethod
    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Record a step's results; returns the sequences that finished in it."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    @abstractmethod
    def stats(self) -> SchedulerStats:
        """Counts for metrics."""


class QueueFullError(RuntimeError):
    """add() refused a request: the waiting queue is at scheduler.max_waiting (HTTP 429)."""
