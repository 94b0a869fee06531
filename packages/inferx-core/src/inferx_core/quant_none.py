"""The unquantized QuantScheme: weights in the serving dtype, GEMM by torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferx_core.interfaces.quant import QuantLinear, QuantScheme

SPLIT_PARTS = 4
SPLIT_MAX_ROWS = 64
# forward_split splits only weights up to this size: cuBLAS leaves a 3B QKV (10 MiB) short of
# bandwidth (the split is faster at one row) but reads an 8B one (48 MiB) as fast as the split
# does (bench_split_gemm).
SPLIT_QKV_MAX_BYTES = 16 << 20


def split_k_bmm(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, M, N] partial products of x [M, K] and weight [N, K] over equal slices of K,
    one batched GEMM over strided views (no copies)."""
    m, k = x.shape
    xs = x.view(m, parts, k // parts).transpose(0, 1)  # [parts, M, K/parts]
    ws = weight.view(-1, parts, k // parts).permute(1, 2, 0)  # [parts, K/parts, N]
    return torch.bmm(xs, ws)


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

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        """On a GPU, at most SPLIT_MAX_ROWS rows: SPLIT_PARTS GEMMs over slices of K in one
        batched call. cuBLAS runs the decode-sized o_proj and down_proj of 3B/8B models on too
        few thread blocks to reach memory bandwidth or splits K with a reduce kernel of its own;
        four slices are faster, and the caller's fused add + RMSNorm does the reduce
        (docs/BENCHMARKS.md, bench_split_gemm)."""
        if self.bias is not None or not self._splits(x):
            return super().forward_parts(x)
        return split_k_bmm(x, self.weight, SPLIT_PARTS)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward_parts' split with the bias left to the caller, for weights of at most
        SPLIT_QKV_MAX_BYTES: the fused QKV of a decode step, whose parts and bias the attention
        backend's decode kernel sums."""
        nbytes = self.weight.numel() * self.weight.element_size()
        if nbytes > SPLIT_QKV_MAX_BYTES or not self._splits(x):
            return super().forward_split(x)
        return split_k_bmm(x, self.weight, SPLIT_PARTS), self.bias

    def _splits(self, x: torch.Tensor) -> bool:
        return (
            x.is_cuda
            and x.dim() == 2
            and x.shape[0] <= SPLIT_MAX_ROWS
            and self.weight.shape[1] % SPLIT_PARTS == 0
        )


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
