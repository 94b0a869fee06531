"""The unquantized QuantScheme: weights in the serving dtype, GEMM by torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts
from inferx_core.interfaces.quant import LinearSpec, QuantLinear, QuantScheme
from inferx_core.parallel import SINGLE, ParallelContext

SPLIT_PARTS = 4
SPLIT_MAX_ROWS = 64
# forward_split splits only weights up to this size: cuBLAS leaves a 3B QKV (10 MiB) short of
# bandwidth (the split is faster at one row) but reads an 8B one (48 MiB) as fast as the split
# does (bench_split_gemm).
SPLIT_QKV_MAX_BYTES = 16 << 20


def part_shard(
    rows: int, spec: LinearSpec, part: int, parallel: ParallelContext
) -> tuple[int, int]:
    """(start, length) of this rank's rows of fused part `part` of a column-parallel layer,
    whose whole part has `rows` rows (a scheme's own tensors may have fewer rows than the
    weight, in proportion): an equal slice, or by whole heads (LinearSpec.part_heads), one
    head replicated over several ranks where there are fewer heads than ranks."""
    n = parallel.world_size
    heads = spec.part_heads[part] if spec.part_heads else 0
    what = f"{spec.prefix}'s part {part} ({heads} heads)" if heads else f"{spec.prefix}'s rows"
    if not heads or heads >= n:
        if heads % n:
            raise ValueError(f"parallel.tensor = {n} does not divide {what}")
        return parallel.shard(rows, what)
    if n % heads:
        raise ValueError(f"parallel.tensor = {n} is not a multiple of {what}")
    per = rows // heads
    return parallel.rank * heads // n * per, per


def shard_tensor(
    tensor: torch.Tensor, kind: str, spec: LinearSpec, part: int, parallel: ParallelContext
) -> torch.Tensor | None:
    """This rank's share of a whole checkpoint tensor of a linear layer: a column-parallel
    layer's rows of fused part `part` (part_shard), a row-parallel one's slice of columns (dim 1 of
    a 2-D tensor; its bias only on rank 0, else None). Tensors of other layouts (a scheme's
    packed ones) pass `kind` as "weight" when they are sliced like the weight."""
    if parallel.world_size == 1 or spec.parallel == "replicated":
        return tensor
    if spec.parallel == "column":
        start, n = part_shard(tensor.shape[0], spec, part, parallel)
        return tensor.narrow(0, start, n)
    if kind == "bias" or tensor.dim() == 1:
        return tensor if parallel.rank == 0 else None
    start, n = parallel.shard(tensor.shape[1], f"{spec.prefix}'s {kind} columns")
    return tensor.narrow(1, start, n)


def split_k_bmm(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """[parts, M, N] partial products of x [M, K] and weight [N, K] over equal slices of K,
    one batched GEMM over strided views (no copies)."""
    m, k = x.shape
    xs = x.view(m, parts, k // parts).transpose(0, 1)  # [parts, M, K/parts]
    ws = weight.view(-1, parts, k // parts).permute(1, 2, 0)  # [parts, K/parts, N]
    return torch.bmm(xs, ws)


class DenseLinear(QuantLinear):
    """A plain linear layer whose output rows may be several fused checkpoint tensors, holding
    this rank's shard: column-parallel keeps each part's slice of rows, row-parallel a slice of
    the input columns."""

    def __init__(
        self,
        spec: LinearSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        sizes = list(spec.output_sizes)
        in_features = spec.in_features
        if spec.parallel == "column":
            sizes = [part_shard(n, spec, i, parallel)[1] for i, n in enumerate(sizes)]
        elif spec.parallel == "row":
            in_features = parallel.shard(in_features, f"{spec.prefix}'s input columns")[1]
        self.output_sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        out = sum(sizes)
        self.weight = torch.nn.Parameter(
            torch.empty(out, in_features, dtype=dtype, device=device), requires_grad=False
        )
        # A row-parallel layer's bias is added once, by rank 0, so the all-reduce adds it once.
        has_bias = spec.bias and (spec.parallel != "row" or parallel.rank == 0)
        self.bias = (
            torch.nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
            if has_bias
            else None
        )

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        if kind not in ("weight", "bias"):
            raise ValueError(f"{self.spec.prefix}: unquantized linear has no {kind!r} tensor")
        tensor = shard_tensor(tensor, kind, self.spec, part, self.parallel)
        if tensor is None:
            return  # a row-parallel bias on a rank other than 0
        target = self.weight if kind == "weight" else self.bias
        if target is None:
            raise ValueError(f"{self.spec.prefix}: the layer has no bias")
        rows = slice(self.offsets[part], self.offsets[part] + self.output_sizes[part])
        dest = target.data[rows]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{self.spec.prefix}: {kind} part {part}: checkpoint shape "
                f"{tuple(tensor.shape)}, expected {tuple(dest.shape)} on this rank"
            )
        dest.copy_(tensor)

    def dense_weight(self) -> torch.Tensor:
        return self.weight

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
    """Every layer in the serving dtype: QuantScheme's default DenseLinear, and plain experts."""

    name = "none"

    def experts(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> QuantExperts:
        from inferx_core.moe import UnquantizedExperts

        return UnquantizedExperts(spec, dtype, device, parallel)
