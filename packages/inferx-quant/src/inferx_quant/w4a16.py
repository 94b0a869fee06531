"""W4A16: 4-bit integer weights in groups along K, each group with its own scale and zero point;
activations stay in the serving dtype. Reads GPTQ and AWQ (GEMM) checkpoints.

The layouts, for a linear layer y = x @ W.T with W [N, K] (N outputs, K inputs), g = group size
(-1: one group over all of K, G = K / g groups), w = (q - zero) * scale:

- GPTQ (AutoGPTQ / GPTQModel): `qweight` int32 [K / 8, N], eight 4-bit values of one column
  along K, nibble j (bits 4j..4j+3) holding row 8i + j; `qzeros` int32 [G, N / 8], eight columns'
  zeros along N in order, nibble j holding column 8c + j; `scales` [G, N] (fp16); `g_idx` int32
  [K], the group of each input row (k // g, unless the checkpoint was quantized in act-order,
  `desc_act`, where rows were visited by decreasing Hessian diagonal and formed groups in that
  order). checkpoint_format "gptq" (the original) stores each zero minus one, so the zero is the
  stored value + 1 (a symmetric 4-bit checkpoint stores 7, 0x77777777 a word); "gptq_v2"
  stores the zero itself.
- AWQ GEMM (AutoAWQ): `qweight` int32 [K, N / 8], packed along N in AWQ's interleaved order:
  nibble i of word c holds column 8c + AWQ_ORDER[i]; `qzeros` int32 [G, N / 8], the same
  order; `scales` [G, N] (fp16). Always asymmetric (zero_point), no g_idx.

At load both become one layout, which the CPU reference and the CUDA kernel read: `qweight`
int32 [K / 8, N] packed along K (GPTQ's), its rows in the order groups are contiguous in,
`scales` [G, N] as stored, `zeros` uint8 [G, N] (the zero points themselves) and, for
act-order, `perm` int32 [K]: kernel row i is input row perm[i] (the activations' columns are
gathered by it, so the weights stream in group order).

Act-order split along K (a row-parallel layer over several ranks): a rank's contiguous slice
of input rows holds a scattered subset of each group's rows, so its groups are not runs of g
rows. The rank keeps the scales and zeros of every group its rows touch (in practice all G,
on every rank: with groups of 128, 5% of the whole layer's bytes each), sorts its rows by
group (`perm` over its K), and gives the kernel `row_group` int32 [K]: the scales' and zeros'
row of each kernel row (sorted, so runs of one value). A single rank, or a slice whose g_idx
is plain k // g in whole groups, keeps the layout above.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

import torch

from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts
from inferx_core.interfaces.quant import LinearSpec, QuantConfig, QuantLinear, QuantScheme
from inferx_core.moe import UnquantizedExperts
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_core.quant_none import DenseLinear, part_shard

BITS = 4
PACK = 32 // BITS  # 4-bit values in an int32
# Nibble i of an AWQ word holds column 8c + AWQ_ORDER[i] (AutoAWQ's pack order).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP_SIZES = (-1, 32, 64, 128)
Method = Literal["gptq", "awq"]


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., R / 8, C] packed along rows, nibble j of word [i, c] row 8i + j -> uint8
    [..., R, C] (leading dimensions, e.g. experts, kept)."""
    shifts = torch.arange(0, 32, BITS, device=packed.device, dtype=torch.int32)
    values = (packed.unsqueeze(-2) >> shifts[:, None]) & 0xF  # [..., R / 8, 8, C]
    return values.to(torch.uint8).reshape(*packed.shape[:-2], -1, packed.shape[-1])


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [..., R, C / 8] packed along columns -> uint8 [..., R, C]: nibble i of word [r, c]
    is column 8c + order[i] (8c + i without an order)."""
    shifts = torch.arange(0, 32, BITS, device=packed.device, dtype=torch.int32)
    values = ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)  # [..., R, C / 8, 8]
    if order is not None:
        inverse = [order.index(j) for j in range(PACK)]  # the nibble holding column 8c + j
        values = values[..., inverse]
    return values.reshape(*packed.shape[:-1], -1)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., R, C] of 4-bit values -> int32 [..., R / 8, C] packed along rows
    (unpack_rows' inverse)."""
    *lead, r, c = values.shape
    shifts = torch.arange(0, 32, BITS, device=values.device, dtype=torch.int64)
    v = values.to(torch.int64).reshape(*lead, r // PACK, PACK, c)
    return _as_int32((v << shifts[:, None]).sum(-2))


def dequantize(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group: int,
    perm: torch.Tensor | None = None,
    row_group: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loaded layout (module docstring) -> the weight [N, K] in float32, (q - zero) *
    scale, exact (a 4-bit difference times a 16-bit scale fits float32's mantissa), rows back
    in input order. zeros None: symmetric, zero 8. row_group: each row's group (the scales'
    and zeros' row), instead of runs of `group` rows."""
    q = unpack_rows(qweight).float()  # [K, N] in group order
    if row_group is None:
        rows = torch.arange(q.shape[0], device=q.device) // group
    else:
        rows = row_group.long()
    zero = 8.0 if zeros is None else zeros.float()[rows]
    w = (q - zero) * scales.float()[rows]
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.long(), w)
    return w.t()


def sort_by_group(
    g_idx: torch.Tensor, group: int, groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An act-order K slice's rows, g_idx [E, k] (each row's group of the whole layer's
    `groups`), sorted into group order -> (perm [E, k], the rows' groups in that order [E, k],
    bad [E]: a group index outside [0, groups), or a group given more than `group` rows)."""
    counts = torch.zeros(g_idx.shape[0], groups + 1, dtype=torch.int64, device=g_idx.device)
    counts.scatter_add_(1, g_idx.clamp(0, groups), torch.ones_like(g_idx))
    bad = (g_idx < 0).any(1) | (g_idx >= groups).any(1) | (counts[:, :groups] > group).any(1)
    perm = torch.argsort(g_idx, dim=1, stable=True)
    return perm, g_idx.gather(1, perm), bad


def pack_cols(values: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """uint8 [R, C] of 4-bit values -> int32 [R, C / 8] packed along columns, nibble i of word
    [r, c] column 8c + order[i] (unpack_cols' inverse)."""
    r, c = values.shape
    v = values.to(torch.int64).reshape(r, c // PACK, PACK)
    if order is not None:
        v = v[..., list(order)]
    shifts = torch.arange(0, 32, BITS, device=values.device, dtype=torch.int64)
    return _as_int32((v << shifts).sum(-1))


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@dataclass(frozen=True)
class W4Format:
    """How a checkpoint stores its 4-bit layers. group_size -1: one group over all of K.
    zero_offset: added to each stored zero (1 for GPTQ's original format)."""

    method: Method
    group_size: int = 128
    sym: bool = True
    zero_offset: int = 0
    desc_act: bool = False


class W4A16Linear(QuantLinear):
    """A linear layer of 4-bit weights (module docstring: layouts). Fused parts (q, k, v) load
    one at a time and are put side by side along N at finish_loading; act-order parts must
    share one g_idx (they do: they share their input, so GPTQ orders their rows alike).
    Tensor parallel: column-parallel keeps each part's rows (whole packed words), row-parallel
    its inputs, in whole groups; act-order row-parallel ones their inputs anywhere on a
    16-row boundary, with every group's scales they touch and a `row_group` (module
    docstring).

    forward: on a CUDA tensor the Triton kernel of inferx_kernels_cuda.w4a16 (imported on first
    use, so this module never imports CUDA-only code); elsewhere the reference: the weight
    dequantized exactly to float32, one float32 GEMM, cast to x's dtype, then the bias."""

    use_kernel = True  # A/B switch: False keeps the reference path on a GPU too
    takes_trigger = True  # forward_parts / forward_split: the kernel's PDL trigger

    def __init__(
        self,
        spec: LinearSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
        fmt: W4Format | None = None,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.fmt = fmt or W4Format("gptq")
        self.device = torch.device(device)
        whole_k = spec.in_features
        self.whole_group = whole_k if self.fmt.group_size == -1 else self.fmt.group_size
        if whole_k % self.whole_group or whole_k % 16:
            raise ValueError(
                f"{spec.prefix}: its {whole_k} input columns are not a multiple of group_size "
                f"{self.whole_group} and of 16"
            )
        # This rank's share: (start, rows) of each fused part's outputs, and of the inputs.
        self.shards = [(0, n) for n in spec.output_sizes]
        self.in_start, self.k = 0, whole_k
        if spec.parallel == "column":
            self.shards = [
                part_shard(n, spec, i, parallel) for i, n in enumerate(spec.output_sizes)
            ]
        # act-order split along K: g_idx decides the layout at finish_loading, so every
        # group's scales and zeros are kept until then
        self.k_split_act_order = (
            spec.parallel == "row"
            and parallel.world_size > 1
            and self.fmt.desc_act
            and self.fmt.group_size != -1
        )
        if spec.parallel == "row" and parallel.world_size > 1:
            self.in_start, self.k = parallel.shard(whole_k, f"{spec.prefix}'s input columns")
            step = self.whole_group if self.fmt.group_size != -1 else PACK
            unit = f"a group of {step}"
            if self.k_split_act_order:  # any rows, in whole 4-bit words and kernel K steps
                step, unit = 16, "a multiple of 16 rows"
            if self.in_start % step or self.k % step:
                raise ValueError(
                    f"parallel.tensor = {parallel.world_size} splits {spec.prefix}'s inputs "
                    f"at {self.in_start}, not on {unit}"
                )
        if self.k % 16:
            raise ValueError(f"{spec.prefix}: {self.k} input columns here, not a multiple of 16")
        for part, (start, n) in enumerate(self.shards):
            if start % PACK or n % PACK:
                raise ValueError(
                    f"{self._name(part)}: this rank's output rows {start}..{start + n} do not "
                    "start and end on a multiple of 8 (4-bit values packed 8 to a word)"
                )
        # Groups on this rank: per channel one group over its inputs; else whole groups (all of
        # them while an act-order split waits for its g_idx).
        self.group = self.k if self.fmt.group_size == -1 else self.whole_group
        self.groups = self.k // self.group
        self.group_start = self.in_start // self.whole_group
        if self.k_split_act_order:
            self.groups, self.group_start = whole_k // self.whole_group, 0
        self.output_sizes = [n for _, n in self.shards]
        self.offsets = [sum(self.output_sizes[:i]) for i in range(len(self.output_sizes))]
        out = sum(self.output_sizes)
        kinds = ["qweight", "qzeros", "scales"]
        if self.fmt.desc_act:
            kinds.append("g_idx")
        self.checkpoint_kinds = tuple(kinds)
        # A row-parallel layer's bias is added once, by rank 0, so the all-reduce adds it once.
        has_bias = spec.bias and (spec.parallel != "row" or parallel.rank == 0)
        self.bias = (
            torch.nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
            if has_bias
            else None
        )
        self._parts: dict[tuple[str, int], torch.Tensor] = {}
        # Set by finish_loading, as parameters (so that counting a model's parameters counts
        # the bytes its forward pass reads).
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.zeros: torch.Tensor
        self.perm: torch.Tensor | None = None
        self.row_group: torch.Tensor | None = None

    def _name(self, part: int) -> str:
        """The checkpoint name of fused part `part` (the layer's own for an unfused one)."""
        if not self.spec.part_names:
            return self.spec.prefix
        parent = self.spec.prefix.rpartition(".")[0]
        return f"{parent}.{self.spec.part_names[part]}" if parent else self.spec.part_names[part]

    def _expected(self, kind: str, part: int) -> tuple[tuple[int, ...], str]:
        """(shape, dtype class) of a whole checkpoint tensor of part `part`."""
        k, n = self.spec.in_features, self.spec.output_sizes[part]
        groups = k // self.whole_group
        if kind == "qweight":
            shape = (k // PACK, n) if self.fmt.method == "gptq" else (k, n // PACK)
            return shape, "int32"
        if kind == "qzeros":
            return (groups, n // PACK), "int32"
        if kind == "scales":
            return (groups, n), "float"
        if kind == "g_idx":
            return (k,), "int"
        return (n,), "float"  # bias

    def _shard(self, kind: str, t: torch.Tensor, part: int) -> torch.Tensor:
        """This rank's share of a whole checkpoint tensor: its output rows (N, or N / 8 packed
        words) and its inputs (K, K / 8 packed words, or their groups)."""
        start, n = self.shards[part]
        k0, k = self.in_start, self.k
        g0, g = self.group_start, self.groups
        if kind == "qweight" and self.fmt.method == "gptq":
            return t[k0 // PACK : (k0 + k) // PACK, start : start + n]
        if kind == "qweight":
            return t[k0 : k0 + k, start // PACK : (start + n) // PACK]
        if kind == "qzeros":
            return t[g0 : g0 + g, start // PACK : (start + n) // PACK]
        if kind == "scales":
            return t[g0 : g0 + g, start : start + n]
        if kind == "g_idx":
            return t[k0 : k0 + k] - g0
        return t[start : start + n]  # bias

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        known = ("qweight", "qzeros", "scales", "bias") + (
            ("g_idx",) if self.fmt.method == "gptq" else ()
        )
        if kind not in known or (kind == "bias" and not self.spec.bias):
            raise ValueError(f"{self.spec.prefix}: {self.fmt.method} layer has no {kind!r} tensor")
        shape, cls = self._expected(kind, part)
        name = f"{self._name(part)}.{kind}"
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, expected {shape}")
        ok = {
            "int32": tensor.dtype == torch.int32,
            "int": tensor.dtype in (torch.int32, torch.int64),
            "float": tensor.dtype.is_floating_point,
        }[cls]
        if not ok:
            raise ValueError(f"{name} is {tensor.dtype}, expected {cls}")
        shard = self._shard(kind, tensor, part)
        if kind != "bias":
            self._parts[(kind, part)] = shard.to(self.device)
        elif self.bias is not None:  # a row-parallel layer's bias: rank 0's
            rows = slice(self.offsets[part], self.offsets[part] + self.output_sizes[part])
            self.bias.data[rows].copy_(shard)

    def finish_loading(self) -> None:
        for part in range(len(self.output_sizes)):
            for kind in self.checkpoint_kinds:
                if (kind, part) not in self._parts:
                    raise ValueError(f"the checkpoint lacks {self._name(part)}.{kind}")
        parts = range(len(self.output_sizes))
        got = self._parts
        if self.fmt.method == "gptq":
            qweight = torch.cat([got["qweight", p] for p in parts], dim=1)
            zeros = [unpack_cols(got["qzeros", p]) for p in parts]
            zero = torch.cat(zeros, dim=1).to(torch.int32) + self.fmt.zero_offset
        else:  # AWQ: unpacked along N, repacked along K
            values = torch.cat([unpack_cols(got["qweight", p], AWQ_ORDER) for p in parts], 1)
            qweight = pack_rows(values)
            zero = torch.cat([unpack_cols(got["qzeros", p], AWQ_ORDER) for p in parts], 1)
            zero = zero.to(torch.int32)
        if self.fmt.sym and not bool((zero == 1 << (BITS - 1)).all()):
            stored = "7 (zero - 1)" if self.fmt.zero_offset else "8"
            raise ValueError(
                f"{self.spec.prefix}: the checkpoint is symmetric (sym) but its qzeros are not "
                f"the zero point 8 (stored as {stored} in this checkpoint_format)"
            )
        scales = torch.cat([got["scales", p] for p in parts], dim=1)
        g_idx = self._g_idx()
        if self.k_split_act_order:
            perm, groups = self._split_act_order(g_idx)
            zero, scales = zero[groups], scales[groups]
        else:
            perm = self._act_order_perm(g_idx)
        self.zeros = _param(zero.to(torch.uint8))
        self.scales = _param(scales)
        if perm is not None:
            qweight = pack_rows(unpack_rows(qweight)[perm])
            self.perm = _param(perm.to(torch.int32))
        self.qweight = _param(qweight)
        self._parts.clear()

    def _g_idx(self) -> torch.Tensor | None:
        """This rank's g_idx (int64, its input rows), the one its fused parts share; None
        where the checkpoint has none."""
        idx = [self._parts.get(("g_idx", p)) for p in range(len(self.output_sizes))]
        if idx[0] is None:
            return None
        g_idx = idx[0].long()
        for part, other in enumerate(idx[1:], 1):
            if other is None or not torch.equal(other.long(), g_idx):
                raise ValueError(
                    f"{self._name(part)}.g_idx differs from {self._name(0)}.g_idx: the parts "
                    f"of {self.spec.prefix} must share one act-order (g_idx)"
                )
        return g_idx

    def _act_order_perm(self, g_idx: torch.Tensor | None) -> torch.Tensor | None:
        """The row order that makes each group's rows contiguous, from g_idx; None where g_idx
        is absent or already k // group_size."""
        if g_idx is None:
            return None
        trivial = torch.arange(self.k, device=g_idx.device) // self.group
        if torch.equal(g_idx, trivial):
            return None
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], trivial):
            raise ValueError(
                f"{self._name(0)}.g_idx does not give each of the {self.groups} groups "
                f"{self.group} rows"
            )
        return perm

    def _split_act_order(self, g_idx: torch.Tensor | None) -> tuple[torch.Tensor | None, slice]:
        """An act-order layer's slice of K (module docstring) -> (the row order, the groups of
        scales and zeros to keep). Where the slice's g_idx is plain k // g in whole groups,
        the layout of one rank: no order, no row_group, this slice's groups. Else rows sorted
        by group, `row_group` set, and the groups from the first to the last the rows touch."""
        g, k0, k = self.whole_group, self.in_start, self.k
        plain = torch.arange(k0, k0 + k) // g
        g_idx = plain if g_idx is None else g_idx  # (finish_loading has checked it is there)
        if k0 % g == 0 and k % g == 0 and torch.equal(g_idx, plain.to(g_idx.device)):
            self.group_start, self.groups = k0 // g, k // g
            return None, slice(k0 // g, (k0 + k) // g)
        perm, row_group, bad = sort_by_group(g_idx[None], g, self.groups)
        if bool(bad[0]):
            raise ValueError(
                f"{self._name(0)}.g_idx does not give each of the {self.groups} groups {g} "
                f"rows (rows {k0}..{k0 + k} of it)"
            )
        perm, row_group = perm[0], row_group[0]
        lo, hi = int(row_group[0]), int(row_group[-1])
        self.group_start, self.groups = lo, hi - lo + 1
        self.row_group = _param((row_group - lo).to(torch.int32))
        in_order = torch.equal(perm, torch.arange(k, device=perm.device))
        return None if in_order else perm, slice(lo, hi + 1)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in float32, [out, in] (dequantize: exact, rows in input order)."""
        return dequantize(
            self.qweight, self.scales, self.zeros, self.group, self.perm, self.row_group
        )

    def dense_weight(self) -> torch.Tensor | None:
        return None

    def _kernels(self, x: torch.Tensor) -> ModuleType | None:
        return _cuda_kernels() if x.is_cuda and self.use_kernel else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        kernels = self._kernels(x2)
        if kernels is not None:
            y = kernels.w4a16_linear(
                x2, *self._kernel_args(), bias=self.bias, row_group=self.row_group
            )
        else:
            y = (x2.float() @ self.dequantized_weight().t()).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*lead, y.shape[-1])

    def forward_parts(self, x: torch.Tensor, trigger: bool = False) -> torch.Tensor:
        """On a GPU the kernel's split-K partial results as they are (bias in the first): the
        caller's sum replaces the kernel's own reduce. trigger: the kernel after it launches
        early (QuantLinear.takes_trigger; w4a16.pdl_launch decides)."""
        kernels = self._kernels(x)
        if kernels is None or x.dim() != 2:
            return super().forward_parts(x)
        return kernels.w4a16_linear_parts(
            x, *self._kernel_args(), bias=self.bias, trigger=trigger, row_group=self.row_group
        )

    def forward_split(
        self, x: torch.Tensor, trigger: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        kernels = self._kernels(x)
        if kernels is None or x.dim() != 2:
            return super().forward_split(x)
        parts = kernels.w4a16_linear_parts(
            x, *self._kernel_args(), trigger=trigger, row_group=self.row_group
        )
        return parts, self.bias

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """On a GPU the kernel's K-split sum with silu(gate) * up in the same launch (gate_up's
        reduce and SiLU-and-mul in one); elsewhere None (forward, then silu_and_mul)."""
        kernels = self._kernels(x)
        if kernels is None or x.dim() != 2:
            return None
        return kernels.w4a16_linear(
            x, *self._kernel_args(), bias=self.bias, row_group=self.row_group, gated=True
        )

    def _kernel_args(self) -> tuple[Any, ...]:
        return self.qweight, self.scales, self.zeros, self.group, self.perm


def quantize_rtn(
    w: torch.Tensor, fmt: W4Format, order: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """A float weight [N, K] rounded to nearest into fmt's checkpoint tensors (qweight, qzeros,
    scales, and GPTQ's g_idx), in the published layout: for checkpoints to test and measure
    with, not a GPTQ or AWQ calibration. Symmetric: zero 8, scale = absmax / 7; asymmetric:
    scale = (max - min) / 15 (zeros from 1 in GPTQ's original format, which stores zero - 1).
    order: the input rows in the order they form groups (act-order); default 0..K-1."""
    n, k = w.shape
    g = k if fmt.group_size == -1 else fmt.group_size
    rows = torch.arange(k, device=w.device)
    order = rows if order is None else order.to(w.device)
    g_idx = torch.empty(k, dtype=torch.int64, device=w.device)
    g_idx[order] = rows // g
    wt = w.t().float()
    grouped = wt[order].reshape(k // g, g, n)  # each group's rows together
    if fmt.sym:
        scales = (grouped.abs().amax(1) / 7).clamp(min=2**-24).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        lo, hi = grouped.amin(1), grouped.amax(1)
        scales = ((hi - lo) / 15).clamp(min=2**-24).half()
        zeros = (-lo / scales.float()).round().clamp(fmt.zero_offset, 15).long()
    s, z = scales.float()[g_idx], zeros[g_idx]
    q = ((wt / s).round() + z).clamp(0, 15).to(torch.uint8)
    if fmt.method == "awq":
        return {
            "qweight": pack_cols(q, AWQ_ORDER),
            "qzeros": pack_cols(zeros.to(torch.uint8), AWQ_ORDER),
            "scales": scales,
        }
    return {
        "qweight": pack_rows(q),
        "qzeros": pack_cols((zeros - fmt.zero_offset).to(torch.uint8)),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous(), requires_grad=False)


@functools.cache
def _cuda_kernels() -> ModuleType | None:
    """inferx_kernels_cuda.w4a16 where it imports (the package and triton installed)."""
    try:
        from inferx_kernels_cuda import w4a16
    except ImportError:
        return None
    return w4a16


def _refuse(key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{key} = {value!r} is not supported ({supported})")


def _skipped(spec: LinearSpec, skip: Callable[[str], bool]) -> bool:
    """Whether `skip` says the layer stays unquantized: by its name, or a fused layer's by all
    of its parts' checkpoint names; only some of them is an error (one method holds all of its
    rows)."""
    if not spec.part_names:
        return skip(spec.prefix)
    parent = spec.prefix.rpartition(".")[0]
    names = [f"{parent}.{p}" if parent else p for p in spec.part_names]
    hits = [skip(n) for n in names]
    if all(hits):
        return True
    if any(hits):
        left = [n for n, hit in zip(names, hits, strict=True) if hit]
        raise ValueError(
            f"{spec.prefix}: the checkpoint leaves {', '.join(left)} unquantized but not the "
            "other parts of the fused layer"
        )
    return False


def _get(ckpt: dict[str, Any], *keys: str, default: Any = None) -> tuple[str, Any]:
    """(key, value) of the first of `keys` the config has (older spellings after newer)."""
    for key in keys:
        if key in ckpt:
            return key, ckpt[key]
    return keys[0], default


class _W4A16(QuantScheme):
    """What GPTQ and AWQ share: bits, group size, and the layers left unquantized:
    `modules_to_not_convert` (an entry names a layer when it is part of its name, as vLLM and
    transformers read it). The lm_head and embeddings stay in the serving dtype anyway."""

    def __init__(self, config: QuantConfig | None = None) -> None:
        super().__init__(config)
        ckpt = self.config.checkpoint
        if not ckpt:
            raise ValueError(
                f"quantization scheme {self.name!r} reads {self.name} checkpoints; this one has "
                "no quantization_config"
            )
        key, bits = _get(ckpt, "bits", "w_bit")
        if bits != BITS:
            raise _refuse(key, bits, "W4A16 reads 4-bit weights")
        key, group = _get(ckpt, "group_size", "q_group_size", default=128)
        if group not in GROUP_SIZES:
            raise _refuse(key, group, f"group_size one of {', '.join(map(str, GROUP_SIZES))}")
        self.group_size = int(group)
        self.not_convert = [str(m) for m in ckpt.get("modules_to_not_convert") or []]
        self.fmt = self._parse(ckpt)

    def _parse(self, ckpt: dict[str, Any]) -> W4Format:
        raise NotImplementedError

    def skips(self, name: str) -> bool:
        """Whether the checkpoint leaves the layer (or fused part) `name` unquantized."""
        return any(m in name for m in self.not_convert)

    def linear(
        self,
        spec: LinearSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> QuantLinear:
        if _skipped(spec, self.skips) or spec.prefix.rpartition(".")[2] == "gate":
            # ".gate" is a MoE router ("mlp.gate", Mixtral's "block_sparse_moe.gate"; a dense
            # MLP's is "gate_proj"): GPTQ and AWQ tools leave routers unquantized
            return DenseLinear(spec, dtype, device, parallel)
        self._check_kernels(device, "W4A16 kernel")
        return W4A16Linear(spec, dtype, device, parallel, self.fmt)

    def _check_kernels(self, device: torch.device, what: str) -> None:
        if torch.device(device).type == "cuda" and _cuda_kernels() is None:
            raise ValueError(
                f"quantization scheme {self.name!r} on a GPU runs inferx-kernels-cuda's {what} "
                "(Triton), which does not import here: pip install inferx-kernels-cuda"
            )

    def experts(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> QuantExperts:
        """W4A16Experts (inferx_quant.w4a16_experts) where the checkpoint quantizes the
        experts; UnquantizedExperts where it leaves all of them alone (by the names of each
        expert's projections, "{prefix}.{e}.gate_proj", as the layers' rules read them). Some
        quantized and some not is refused: one method holds one layout a layer."""
        from inferx_quant.w4a16_experts import W4A16Experts

        names = [
            f"{spec.prefix}.{e}.{p}_proj"
            for e in range(spec.routed)
            for p in ("gate", "up", "down")
        ]
        hits = [self.skips(n) for n in names]
        if all(hits):
            return UnquantizedExperts(spec, dtype, device, parallel)
        if any(hits):
            left = names[hits.index(True)]
            kept = names[hits.index(False)]
            raise ValueError(
                f"{spec.prefix}: the checkpoint leaves {left} unquantized but not {kept}; "
                f"{self.name} experts hold one layout a layer"
            )
        self._check_kernels(device, "fused MoE kernels")
        return W4A16Experts(spec, dtype, device, parallel, self.fmt)


class Gptq(_W4A16):
    """GPTQ checkpoints (AutoGPTQ, GPTQModel, AutoRound's GPTQ export): symmetric or not, with
    or without act-order, checkpoint_format "gptq" or "gptq_v2". Besides
    modules_to_not_convert, a layer stays unquantized where `modules_in_block_to_quantize`
    lists the quantized ones of each decoder block and omits it, or where a GPTQModel
    `dynamic` entry "-:<regex>" matches its name."""

    name = "gptq"
    checkpoint_methods = ("gptq",)

    def _parse(self, ckpt: dict[str, Any]) -> W4Format:
        key, fmt = _get(ckpt, "checkpoint_format", "format", default="gptq")
        fmt = str(fmt).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(key, fmt, "gptq or gptq_v2")
        pack = ckpt.get("pack_dtype", "int32")
        if pack not in ("int32", "torch.int32"):
            raise _refuse("pack_dtype", pack, "int32")
        if ckpt.get("lm_head"):
            raise _refuse("lm_head", ckpt["lm_head"], "the lm_head stays unquantized")
        self.skip_patterns: list[str] = []
        for pattern, override in (ckpt.get("dynamic") or {}).items():
            if not str(pattern).startswith("-:"):
                raise _refuse(
                    f"dynamic[{pattern!r}]", override, "only '-:' entries, layers left unquantized"
                )
            self.skip_patterns.append(str(pattern)[2:])
        listed = ckpt.get("modules_in_block_to_quantize")
        self.in_block: list[str] | None = None
        if listed:
            flat = [m for group in listed for m in ([group] if isinstance(group, str) else group)]
            self.in_block = [str(m) for m in flat]
        return W4Format(
            "gptq",
            self.group_size,
            sym=bool(ckpt.get("sym", True)),
            zero_offset=1 if fmt == "gptq" else 0,
            desc_act=bool(ckpt.get("desc_act", False)),
        )

    def skips(self, name: str) -> bool:
        if super().skips(name):
            return True
        if any(re.match(p, name) for p in self.skip_patterns):
            return True
        if self.in_block is not None:
            return not any(name.endswith("." + m) or name == m for m in self.in_block)
        return False


class Awq(_W4A16):
    """AWQ checkpoints in AutoAWQ's GEMM layout (version "gemm"), with zero points."""

    name = "awq"
    checkpoint_methods = ("awq",)

    def _parse(self, ckpt: dict[str, Any]) -> W4Format:
        version = str(ckpt.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse("version", ckpt.get("version"), "AWQ's GEMM layout, version 'gemm'")
        if ckpt.get("zero_point", True) is not True:
            raise _refuse("zero_point", ckpt.get("zero_point"), "AWQ with zero points")
        backend = str(ckpt.get("backend", "autoawq")).lower()
        if backend != "autoawq":
            raise _refuse("backend", ckpt.get("backend"), "AutoAWQ's layout, 'autoawq'")
        return W4Format("awq", self.group_size, sym=False)
