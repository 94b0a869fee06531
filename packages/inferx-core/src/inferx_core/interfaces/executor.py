"""The executor contract: runs a scheduled step on a device. Holds no policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from inferx_core.interfaces.scheduler import SchedulerOutput


@dataclass
class StepResult:
    """Tokens sampled for the chunks whose `sample` is True, in chunk order.

    logprobs[i] is (sampled token's logprob, [(token, logprob), ...top-k]) when the request asked.
    """

    sampled: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)


class Executor(ABC):
    """Owns the model, the KV cache tensors and the device. Knows nothing about queues."""

    num_kv_blocks: int
    block_size: int

    @abstractmethod
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one forward pass over the chunks and sample where asked."""
