"""The parallel context: this process's rank among the tensor-parallel ranks, and their
collectives. World size 1 (the default) has no process group and every collective is a no-op."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class RankFailure(RuntimeError):
    """Another tensor-parallel rank died or failed; the engine cannot go on."""


@dataclass(frozen=True)
class ParallelContext:
    """rank / world_size of this process in its tensor-parallel group; `group` is the
    torch.distributed process group (None at world size 1), `cpu_group` a gloo group over the
    same ranks for host-side agreement (`group` itself where None)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    cpu_group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a world size above 1 needs a process group")

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `size`; a size the world size does not
        divide is an error naming `what` ("parallel.tensor = 2 does not divide ...")."""
        n = self.world_size
        if size % n:
            raise ValueError(f"parallel.tensor = {n} does not divide {what} ({size})")
        per = size // n
        return self.rank * per, per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place (x itself at world size 1)."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (value itself at world size 1)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(
            t,
            op=dist.ReduceOp.MIN,
            group=self.cpu_group if self.cpu_group is not None else self.group,
        )
        return int(t.item())

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' x concatenated along `dim`, in rank order (x itself at world size 1)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = ParallelContext()
