"""Model contracts: an architecture (a torch module over a paged cache) and a checkpoint format."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inferx_core.interfaces.attention import AttentionBackend
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_core.interfaces.ops import KernelOps
from inferx_core.interfaces.quant import QuantScheme
from inferx_core.parallel import SINGLE, ParallelContext


@dataclass
class BuildContext:
    """What an architecture builds itself with. Layers call these, never a kernel directly.
    A layer's AttentionLayer takes its spec from ctx.attention.layers (what the backend was
    built with: ModelArch.kv_layout)."""

    dtype: torch.dtype
    device: torch.device
    attention: AttentionBackend
    quant: QuantScheme
    ops: KernelOps = field(default_factory=lambda: _reference_ops())
    parallel: ParallelContext = SINGLE


def _reference_ops() -> KernelOps:
    from inferx_core.ops_torch import TorchOps

    return TorchOps()


class ModelArch(torch.nn.Module, ABC):
    """One model family, registered under its Hugging Face architecture name.

    Built as `Arch(hf_config, ctx: BuildContext)`. Forward runs over a flat batch of tokens from
    many sequences (no padding); attention goes through ctx.attention, which knows the step's
    layout.
    """

    @classmethod
    @abstractmethod
    def kv_layout(
        cls, hf_config: dict[str, Any], parallel: ParallelContext = SINGLE, kv_dtype: str = "auto"
    ) -> list[KVLayerSpec]:
        """One spec per attention layer, in layer order, with this rank's heads (KV heads
        replicated where there are fewer than ranks) and the cache dtype asked for."""

    @classmethod
    @abstractmethod
    def checkpoint_shapes(cls, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """Every tensor a Hugging Face checkpoint of this config holds, by name (dummy weights)."""

    @classmethod
    def checkpoint_dtypes(cls, hf_config: dict[str, Any]) -> dict[str, torch.dtype]:
        """The checkpoint tensors stored in a dtype of their own, by name (quantized payloads
        such as MXFP4's uint8 blocks and scales); every other one is in the checkpoint's float
        dtype. Dummy weights draw these as random bytes."""
        return {}

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T] token ids and positions -> [T, hidden] final hidden states."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] logits, in the model's dtype or float32 (the sampler
        upcasts them where it computes on them; greedy rows take the argmax as they are)."""

    def compute_logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """compute_logits written into `out` ([N, vocab], of the dtype compute_logits returns):
        the CUDA graphs' one static output. Override it so the GEMM writes there itself."""
        return out.copy_(self.compute_logits(hidden))

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Consume Hugging Face-named tensors into the final (fused) layout. Unknown names and
        missing tensors are errors."""


@dataclass
class Checkpoint:
    """An opened checkpoint: HF-style config, a weight stream, and its tokenizer if it has one."""

    hf_config: dict[str, Any]
    weights: Iterator[tuple[str, torch.Tensor]]
    tokenizer: Any = None  # inferx_core.tokenizer.Tokenizer
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class CheckpointFormat(ABC):
    """Reads one on-disk format ("safetensors", "gguf", "dummy")."""

    @abstractmethod
    def detect(self, path: Path) -> bool:
        """True if this format can open `path` (for load_format = "auto")."""

    @abstractmethod
    def open(
        self, path: Path, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Checkpoint:
        """Open `path`; weights are yielded lazily, already in `dtype`, on `device` where the
        format can place them there directly (reading or making them on a GPU saves start-up
        time); a format may yield host tensors, which the model copies."""
