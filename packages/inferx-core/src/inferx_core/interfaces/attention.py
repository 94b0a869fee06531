"""The attention backend contract: owns the paged KV cache tensors and the attention kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from inferx_core.interfaces.kv import KVLayerSpec


@dataclass
class AttentionBatch:
    """One step's layout, built by the executor. Sequences are packed in the order of the chunks.

    Host lists describe each sequence; device tensors are ready for kernels.
    query_lens[i]: new tokens of sequence i this step; context_lens[i]: its tokens in the cache
    once this step has written them (start + query_len). slot_mapping[t]: the cache slot
    (block_id * block_size + offset) that new token t is written to.
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start: torch.Tensor  # [num_seqs + 1] int32, cumulative query_lens
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    context_len: torch.Tensor  # [num_seqs] int32

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


class AttentionBackend(ABC):
    """Paged attention for every layer of one model.

    Built once with the model's per-layer specs; allocates the cache; is told each step's layout
    with begin_step() (plan kernels there, once per step); then forward() runs once per layer.
    The model never sees metadata or cache tensors: its Attention layers call forward().
    """

    def __init__(
        self,
        layers: list[KVLayerSpec],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layers = layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Device bytes one block takes across all layers (sizes the cache)."""

    @abstractmethod
    def allocate(self, num_blocks: int) -> None:
        """Create the cache tensors for `num_blocks` blocks."""

    @abstractmethod
    def begin_step(self, batch: AttentionBatch) -> None:
        """Take this step's layout; prepare whatever the kernels need."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) to the cache, attend q ([T, Hq, D]); return [T, Hq, Dv].

        Each sequence's queries attend causally to its whole cached context.
        """
