"""The unquantized QuantScheme: weights in the serving dtype, GEMM by torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferx_core.interfaces.quant import QuantLinear, QuantScheme


class DenseLinear(QuantLinear):
    """A plain linear layer whose output rows may be several fused checkpoint tensors."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.output_sizes = list(output_sizes)
        self.offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        out = sum(output_sizes)
        self.weight = torch.nn.Parameter(
            torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            torch.nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        target = {"weight": self.weight, "bias": self.bias}.get(kind)
        if target is None:
            raise ValueError(f"unquantized linear has no {kind!r} tensor")
        rows = slice(self.offsets[part], self.offsets[part] + self.output_sizes[part])
        dest = target.data[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{kind} part {part}: checkpoint shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Unquantized(QuantScheme):
    def linear(
        self,
        in_features: int,
        output_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> QuantLinear:
        return DenseLinear(in_features, output_sizes, bias, dtype, device)
