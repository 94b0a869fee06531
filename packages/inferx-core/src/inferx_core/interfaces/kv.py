"""KV cache contracts: what one layer stores per token, and who hands out blocks of it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from inferx_core.sequence import Sequence


@dataclass(frozen=True)
class KVLayerSpec:
    """What one attention layer keeps per token, and how many query heads read it.

    The model declares one per layer (ModelArch.kv_layout).

    kind: "full" (every past token), "sliding" (the last `window` tokens; blocks that fall out of
    the window can be freed), "mla" (one compressed latent of `head_dim` per token, `num_kv_heads`
    is 1 and there is no separate V). `sinks`: leading tokens a sliding layer always keeps.
    dtype: None means the model's dtype; "fp8_e4m3" stores KV as FP8 with per-layer scales.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kind: Literal["full", "sliding", "mla"] = "full"
    window: int | None = None
    sinks: int = 0
    v_head_dim: int | None = None  # None: same as head_dim; 0 for MLA (no V)
    dtype: str | None = None

    @property
    def group(self) -> tuple:
        """Layers with the same group share one block table (see docs/ARCHITECTURE.md)."""
        return (self.kind, self.window, self.sinks)


class KVManager(ABC):
    """Hands out fixed-size KV blocks to sequences. Pure bookkeeping: no tensors, no device.

    A block id indexes the same slot of every layer's cache tensor. Blocks are reference counted so
    that the prefix cache can share them; a block returns to the free list when its count hits 0
    and it is not held by the prefix cache.
    """

    block_size: int
    num_blocks: int

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold at once: num_blocks less any the manager reserves."""
        return self.num_blocks

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that could be handed out now (free, or evictable from the prefix cache)."""

    @abstractmethod
    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of seq's tokens (whole blocks).

        Called once when a waiting sequence is admitted (with an empty block table). Sets
        seq.block_table and returns the number of tokens covered, which the scheduler then
        treats as computed. Must leave at least one token uncomputed.
        """

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq.block_table to hold `num_tokens` tokens. All or nothing: False if short."""

    @abstractmethod
    def commit(self, seq: Sequence) -> None:
        """Offer seq's full, computed blocks to the prefix cache (no-op without one)."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block seq holds and clear its block table."""

    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks in use by running sequences, 0..1."""
