"""KV cache contracts: what a layer stores per token, how layers group, who hands out blocks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from inferx_core.sequence import Sequence

KV_DTYPES = ("auto", "fp8_e4m3")


@dataclass(frozen=True)
class KVLayerSpec:
    """What one attention layer keeps per token and what its attention needs.

    The model declares one per layer (ModelArch.kv_layout), with the heads of this rank.

    kind: "full" (every past token), "sliding" (the last `window` tokens: blocks behind the window
    go back to the pool), "mla" (one compressed latent per token: `num_kv_heads` is 1, `head_dim`
    is kv_lora_rank + rope_dim, and there is no separate V; `v_head_dim` is kv_lora_rank).
    dtype: "auto" keeps the cache in the model's dtype; "fp8_e4m3" stores it in e4m3 with per-layer
    k/v scales (AttentionLayer.k_scale / v_scale).
    learned_sinks: one learned logit per query head joins each softmax as an extra column
    (gpt-oss); softcap: logits pass through softcap * tanh(x / softcap) (0: none).
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kind: Literal["full", "sliding", "mla"] = "full"
    window: int | None = None
    v_head_dim: int | None = None  # None: same as head_dim
    dtype: str = "auto"
    learned_sinks: bool = False
    softcap: float = 0.0
    rope_dim: int = 0  # mla: the trailing rope part of head_dim

    def __post_init__(self) -> None:
        if self.kind == "sliding" and not (self.window and self.window > 0):
            raise ValueError(f"a sliding layer needs a positive window, not {self.window}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be one of {', '.join(KV_DTYPES)}, not {self.dtype!r}")

    @property
    def group_key(self) -> tuple:
        """Layers with equal keys share one KV group: one block table per sequence."""
        return (self.kind, self.window if self.kind == "sliding" else None)

    def needs(self) -> set[str]:
        """The attention features this layer needs beyond plain full attention (see
        AttentionBackend.features)."""
        out = set()
        if self.kind != "full":
            out.add(self.kind)
        if self.dtype == "fp8_e4m3":
            out.add("fp8_kv")
        if self.learned_sinks:
            out.add("sinks")
        if self.softcap:
            out.add("softcap")
        return out


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per sequence (equal KVLayerSpec.group_key).

    A block id indexes the same slot of every cache tensor of the group's layers. Every group
    draws its blocks from one pool, so a block id means one page in one group at a time.
    """

    index: int
    kind: Literal["full", "sliding", "mla"]
    window: int | None
    layers: tuple[int, ...]


def kv_groups(specs: list[KVLayerSpec]) -> list[KVGroup]:
    """Group layers by KVLayerSpec.group_key, in order of each group's first layer."""
    order: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        order.setdefault(spec.group_key, []).append(i)
    return [
        KVGroup(g, key[0], key[1], tuple(layers)) for g, (key, layers) in enumerate(order.items())
    ]


class KVManager(ABC):
    """Hands out fixed-size KV blocks to sequences, one block table per KV group. Pure
    bookkeeping: no tensors, no device. The scheduler asks it, and does no block arithmetic.

    Blocks are reference counted so that the prefix cache can share them; a block returns to the
    free pool when its count hits 0 and it is not held by the prefix cache. A sliding group's
    blocks that fall wholly behind its window are returned as the sequence grows.
    """

    block_size: int
    num_blocks: int
    groups: list[KVGroup]

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold at once: num_blocks less any the manager reserves."""
        return self.num_blocks

    @abstractmethod
    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks one sequence of num_tokens tokens holds at most, over every group."""

    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens could ever be held (alone, in an empty
        cache): the scheduler refuses a request that cannot, rather than preempting forever."""
        return self.blocks_needed(num_tokens) <= self.num_usable_blocks

    def fills_block(self, start: int, end: int) -> bool:
        """Whether computing tokens [start, end) of a sequence completes a block (then the
        scheduler offers it to the prefix cache with commit())."""
        return end // self.block_size != start // self.block_size

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that could be handed out now (free, or evictable from the prefix cache)."""

    @abstractmethod
    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest cached prefix of seq's tokens (whole blocks).

        Called once when a waiting sequence is admitted (with empty block tables). Sets
        seq.block_tables and returns the number of tokens covered, which the scheduler then
        treats as computed. Must leave at least one token uncomputed. A sliding group needs only
        the blocks the next query reads; its entries behind the window are 0, as if freed.
        """

    @abstractmethod
    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make seq's block tables hold its first `num_tokens` tokens (a no-op when they do).
        All or nothing: False if short of blocks."""

    @abstractmethod
    def commit(self, seq: Sequence) -> None:
        """Offer seq's full, computed blocks to the prefix cache (no-op without one)."""

    @abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block seq holds and clear its block tables."""

    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks in use by running sequences, 0..1."""
