"""The quantization contract: a scheme owns how a linear layer's weights load and multiply."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class QuantLinear(torch.nn.Module, ABC):
    """y = x @ W.T (+ b), with W stored however the scheme likes.

    `output_sizes` splits the output rows into fused parts (q, k, v or gate, up): a checkpoint's
    separate tensors are loaded one part at a time with load(). Tensor-parallel sharding slices
    inside load() by (tp_rank, tp_size), so models never slice weights themselves.
    """

    @abstractmethod
    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Copy a checkpoint tensor of this layer. kind: "weight", "bias" or a scheme's own
        ("scales", "blocks", ...); part: index into output_sizes."""

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        """y as [S, *y.shape]: S >= 1 partial results that add up to y, for a caller that sums
        them anyway (KernelOps.rms_norm with parts=True). A scheme may split the GEMM along K
        where thinner GEMMs read the weights faster; the default is y itself, S = 1."""
        return self(x).unsqueeze(0)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(parts, bias): forward_parts without the bias, and the bias the caller must still
        add (None when there is none to add). The default is (y itself as one part, None)."""
        return self(x).unsqueeze(0), None


class QuantScheme(ABC):
    """Chosen by name in config ([quantization] scheme). "none" is the unquantized default."""

    @abstractmethod
    def linear(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> QuantLinear:
        """Build a linear layer whose output is the concatenation of `output_sizes` parts."""
