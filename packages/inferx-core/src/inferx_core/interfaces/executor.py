"""The executor contract: runs a scheduled step on a device. Holds no policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from inferx_core.interfaces.attention import AttentionBatch
from inferx_core.interfaces.scheduler import ScheduledChunk, SchedulerOutput

# Writes the tokens a step in flight is still sampling (PENDING on the host) into a step's
# device input ids.
Fill = Callable[[torch.Tensor], None]


@dataclass
class StepResult:
    """Tokens sampled for the chunks whose `sample` is True, in chunk order.

    logprobs[i] is (sampled token's logprob, [(token, logprob), ...top-k]) when the request asked.
    """

    sampled: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)


class PendingStep(Protocol):
    """A submitted step; result() waits for it and returns what it sampled."""

    def result(self) -> StepResult: ...


@dataclass
class DoneStep:
    """A step that has already run."""

    value: StepResult

    def result(self) -> StepResult:
        return self.value


class DecodeGraphs(Protocol):
    """Decode steps replayed from captured graphs (a device runtime's; ModelRunner.graphs)."""

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether this step (one new token per sequence) can replay."""
        ...

    def run(self, chunks: Sequence[ScheduledChunk], fill: Fill | None = None) -> torch.Tensor:
        """Logits [len(chunks), vocab], row i for chunk i; valid until the next run."""
        ...


class MixedGraphs(Protocol):
    """Steps with prompt tokens replayed from graphs by padded token count (ModelRunner.mixed)."""

    def fits(self, query_lens: list[int], context_lens: list[int]) -> bool:
        """Whether a step of these chunks (new tokens, context with them) can replay."""
        ...

    def run(
        self, ids: list[int], positions: list[int], batch: AttentionBatch, fill: Fill | None = None
    ) -> torch.Tensor:
        """Hidden states [len(ids), hidden], row t for token t; valid until the next run."""
        ...


class Executor(ABC):
    """Owns the model, the KV cache tensors and the device. Knows nothing about queues.

    An executor with `supports_overlap` lets the engine submit step N+1 before it collects step
    N: a chunk's input may then be a PENDING token (sequence.PENDING), which is the token that
    the step submitted just before sampled for that sequence, still on the device.
    """

    num_kv_blocks: int
    block_size: int
    supports_overlap: bool = False

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one forward pass over the chunks and sample where asked."""

    def submit(self, out: SchedulerOutput) -> PendingStep:
        """Start a step and return without waiting for the device (here: run it whole)."""
        return DoneStep(self.execute(out))
