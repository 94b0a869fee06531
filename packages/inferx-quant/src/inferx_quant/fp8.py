"""FP8 W8A8: e4m3 weights with float32 scales, activations quantized to e4m3 as they arrive.

Reads two checkpoint layouts, from the checkpoint's `quantization_config`:
- compressed-tensors "float-quantized" (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK):
  `weight` e4m3 and `weight_scale` per tensor [1], per output channel [out, 1] or per block
  [ceil(out/bn), ceil(in/bk)]; `input_scale` [1] where activations are static.
- Hugging Face's quant_method "fp8" (Qwen3-FP8, DeepSeek-V3): `weight_block_size` [bn, bk] with
  `weight_scale_inv` per block, activations per token in groups of bk columns; without a block
  size, per-tensor `weight_scale` (and `input_scale` where activation_scheme is "static").
Online (`[quantization] scheme = "fp8"` on an unquantized checkpoint) quantizes each weight at
load per output channel, with activations per token.
MoE experts (fp8_experts.Fp8Experts) keep per-row scales and run weight-only.

Numerics, for every device without a fast path (the CPU reference): the activations are
quantized to e4m3 exactly as the GPU kernels must (quantize_fp8), then both operands are
dequantized to float32 and multiplied, so the CPU path carries the activation quantization
error too, not only the weights'. A scale a layer learns per tensor is expanded over its rows:
fused parts (q, k, v) each keep their own and dequantization stays exact.

A layer with per-token, per-group or static activations advertises that format as its
`input_quant`: the model's norm or SiLU-and-mul before it may then hand it activations already
quantized (a QuantizedActivation, from one fused kernel), which it multiplies as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts
from inferx_core.interfaces.quant import (
    ActivationQuant,
    LinearSpec,
    QuantConfig,
    QuantizedActivation,
    QuantLinear,
    QuantScheme,
)
from inferx_core.moe import UnquantizedExperts
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_core.quant_none import DenseLinear, part_shard, shard_tensor
from inferx_core.quant_utils import (
    FP8,
    FP8_MAX,
    dynamic_scale,
    is_ignored,
    quantize_e4m3,
    quantize_fp8,
)

# The layers online FP8 leaves alone, as an ignore-list entry: MoE routers.
ONLINE_UNQUANTIZED = r"re:.*\.gate"

WeightStrategy = Literal["channel", "tensor", "block"]
# token / tensor / group: dynamic, from each row's (the tensor's, each row's bk columns') absmax;
# static: one input_scale from the checkpoint; none: weight-only, activations stay as they are.
ActStrategy = Literal["token", "tensor", "group", "static", "none"]


@dataclass(frozen=True)
class Fp8Format:
    """How one layer's tensors are quantized. block: (rows, columns) of a weight scale block."""

    weights: WeightStrategy = "channel"
    activations: ActStrategy = "token"
    block: tuple[int, int] | None = None
    # Hugging Face's block checkpoints name the scale weight_scale_inv, though it multiplies
    # like compressed-tensors' weight_scale does.
    inverse_name: bool = False

    @property
    def scale_kind(self) -> str:
        return "weight_scale_inv" if self.inverse_name else "weight_scale"


def quantize_activations(
    x: torch.Tensor, fmt: Fp8Format, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales): per token [M, 1], per tensor [1, 1] (dynamic
    or the static input_scale), or per token per group of bk columns [M, ceil(K / bk)] (the
    last group may be narrower): quant_utils.quantize_e4m3, plus the dynamic per tensor."""
    if fmt.activations == "tensor":
        scale = dynamic_scale(x.float().abs().amax()).reshape(1, 1)
        return quantize_fp8(x.float(), scale), scale
    if fmt.activations == "group":
        assert fmt.block is not None
        return quantize_e4m3(x, "group", fmt.block[1])
    if fmt.activations in ("token", "static"):
        return quantize_e4m3(x, fmt.activations, static_scale=input_scale)
    raise ValueError(f"activations {fmt.activations!r} are not quantized")


def input_quant_of(fmt: Fp8Format, input_scale: torch.Tensor | None) -> ActivationQuant | None:
    """The pre-quantized input a layer of this format takes (QuantLinear.input_quant): per
    token, per group or static; None for weight-only and for the dynamic per-tensor scale,
    which needs every row's absmax before any row is quantized (no per-row kernel has it)."""
    if fmt.activations == "token":
        return ActivationQuant("token")
    if fmt.activations == "group":
        return ActivationQuant("group", fmt.block[1])  # type: ignore[index]
    if fmt.activations == "static":
        return ActivationQuant("static", static_scale=input_scale)
    return None


def _expand_cols(scale: torch.Tensor, size: int, cols: int) -> torch.Tensor:
    return scale.repeat_interleave(size, dim=-1)[..., :cols]


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (e4m3 [rows, cols], float32 [rows]): one scale per output channel,
    absmax / 448 (an all-zero row keeps a tiny nonzero scale so that it stays 0, not NaN)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return quantize_fp8(w, scale[:, None]), scale


class Fp8Linear(QuantLinear):
    """A linear layer of e4m3 weights [out, in] (this rank's shard, fused parts' rows stacked
    like DenseLinear's) and float32 weight scales: per output row [out] for the per-channel
    and per-tensor layouts (a per-tensor scale repeated over its part's rows), or per block
    [ceil(out/bn), ceil(in/bk)]. input_scale: the static activation scale, the largest of the
    fused parts' (they share one input, as vLLM does)."""

    takes_trigger = True  # forward_parts / forward_split: the TMA GEMM's PDL trigger

    def __init__(
        self,
        spec: LinearSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
        fmt: Fp8Format | None = None,
        online: bool = False,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.fmt = fmt or Fp8Format()
        self.online = online
        if online and self.fmt.weights != "channel":
            raise ValueError("online FP8 quantizes weights per channel only")
        self.whole_sizes = list(spec.output_sizes)
        self.shards = [(0, n) for n in self.whole_sizes]  # (start, rows) of each part here
        in_features, self.in_start = spec.in_features, 0
        if spec.parallel == "column":
            whole = spec.output_sizes
            self.shards = [part_shard(n, spec, i, parallel) for i, n in enumerate(whole)]
        elif spec.parallel == "row":
            what = f"{spec.prefix}'s input columns"
            self.in_start, in_features = parallel.shard(in_features, what)
        sizes = [n for _, n in self.shards]
        self.output_sizes = sizes
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        out = sum(sizes)
        self.weight = torch.nn.Parameter(
            torch.empty(out, in_features, dtype=FP8, device=device), requires_grad=False
        )
        if self.fmt.weights == "block":
            self._check_blocks()
            bn, bk = self.fmt.block  # type: ignore[misc]
            scale_shape: tuple[int, ...] = (math.ceil(out / bn), math.ceil(in_features / bk))
        else:
            scale_shape = (out,)
        self.weight_scale = torch.nn.Parameter(
            torch.empty(scale_shape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.input_scale: torch.nn.Parameter | None = None
        if self.fmt.activations == "static":
            self.input_scale = torch.nn.Parameter(
                torch.zeros(1, dtype=torch.float32, device=device), requires_grad=False
            )
        self.input_quant = input_quant_of(self.fmt, self.input_scale)
        has_bias = spec.bias and (spec.parallel != "row" or parallel.rank == 0)
        self.bias = (
            torch.nn.Parameter(torch.empty(out, dtype=dtype, device=device), requires_grad=False)
            if has_bias
            else None
        )
        self.loaded: set[tuple[str, int]] = set()

    def _check_blocks(self) -> None:
        """Each fused part's rows and this rank's shard must start on a block boundary, or the
        checkpoint's block scales would not map onto the rows they scale."""
        bn, bk = self.fmt.block  # type: ignore[misc]
        for part, ((start, _), offset) in enumerate(zip(self.shards, self.offsets, strict=True)):
            if start % bn or offset % bn:
                raise ValueError(
                    f"{self._name(part)}: its rows on this rank (from row {start}, at row "
                    f"{offset} of {self.spec.prefix}) do not start on a weight_block_size "
                    f"block of {bn} rows; FP8 block scales need whole blocks per part and rank"
                )
        if self.in_start % bk:
            raise ValueError(
                f"{self.spec.prefix}: this rank's input columns start at {self.in_start}, "
                f"not on a weight_block_size block of {bk} columns"
            )

    def _name(self, part: int) -> str:
        """The checkpoint name of fused part `part` (the layer's own for an unfused one)."""
        if not self.spec.part_names:
            return self.spec.prefix
        parent = self.spec.prefix.rpartition(".")[0]
        return f"{parent}.{self.spec.part_names[part]}" if parent else self.spec.part_names[part]

    def _rows(self, part: int) -> slice:
        return slice(self.offsets[part], self.offsets[part] + self.output_sizes[part])

    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        if kind == "weight":
            self._load_weight(tensor, part)
        elif kind == self.fmt.scale_kind and not self.online:
            if self.fmt.weights == "block":
                self._load_block_scale(tensor, part)
            else:
                self._load_row_scale(tensor, part)
        elif kind == "input_scale" and self.input_scale is not None:
            if tensor.numel() != 1:
                raise ValueError(f"input_scale of shape {tuple(tensor.shape)}, expected one value")
            value = tensor.float().reshape(1).to(self.input_scale.device)
            self.input_scale.data.copy_(torch.maximum(self.input_scale.data, value))
        elif kind == "bias" and self.spec.bias:
            bias = shard_tensor(tensor, kind, self.spec, part, self.parallel)
            if bias is not None and self.bias is not None:
                self._copy(self.bias.data[self._rows(part)], bias, kind, part)
        else:
            raise ValueError(f"{self.spec.prefix}: FP8 {self._layout()} has no {kind!r} tensor")
        self.loaded.add((kind, part))

    def _layout(self) -> str:
        return "online" if self.online else f"{self.fmt.weights} / {self.fmt.activations}"

    def _check(self, dest: torch.Tensor, src: torch.Tensor, kind: str, part: int) -> None:
        if tuple(dest.shape) != tuple(src.shape):
            raise ValueError(
                f"{self._name(part)}.{kind}: checkpoint shape {tuple(src.shape)}, "
                f"expected {tuple(dest.shape)} on this rank"
            )

    def _copy(self, dest: torch.Tensor, src: torch.Tensor, kind: str, part: int) -> None:
        self._check(dest, src, kind, part)
        dest.copy_(src)

    def _load_weight(self, tensor: torch.Tensor, part: int) -> None:
        if self.online and tensor.dtype == FP8:
            raise ValueError(
                f"{self._name(part)}.weight is float8_e4m3fn, but the checkpoint has no "
                "quantization_config saying how it is scaled"
            )
        if not self.online and tensor.dtype != FP8:
            raise ValueError(
                f"{self._name(part)}.weight is {tensor.dtype}, expected float8_e4m3fn "
                "(the checkpoint's quantization_config says it is FP8)"
            )
        shard = shard_tensor(tensor, "weight", self.spec, part, self.parallel)
        assert shard is not None
        rows = self._rows(part)
        if self.online:
            # per-channel scales are per row, so quantizing this rank's rows alone is exact
            self._check(self.weight.data[rows], shard, "weight", part)
            shard, self.weight_scale.data[rows] = quantize_weight_rows(shard)
        self._copy(self.weight.data[rows], shard, "weight", part)

    def _load_row_scale(self, tensor: torch.Tensor, part: int) -> None:
        """A per-tensor ([], [1]) or per-channel ([rows], [rows, 1]) scale of one part, stored
        per row of this rank."""
        whole = self.whole_sizes[part]
        scale = tensor.float().reshape(-1)
        if scale.numel() == 1:
            scale = scale.expand(whole)
        elif scale.numel() != whole:
            raise ValueError(
                f"{self._name(part)}.{self.fmt.scale_kind}: checkpoint shape "
                f"{tuple(tensor.shape)}, expected [1] or [{whole}, 1]"
            )
        start, n = self.shards[part]  # a row-parallel layer keeps every row's scale
        rows = self.weight_scale.data[self._rows(part)]
        self._copy(rows, scale[start : start + n], self.fmt.scale_kind, part)

    def _load_block_scale(self, tensor: torch.Tensor, part: int) -> None:
        bn, bk = self.fmt.block  # type: ignore[misc]
        whole = (math.ceil(self.whole_sizes[part] / bn), math.ceil(self.spec.in_features / bk))
        kind = self.fmt.scale_kind
        if tuple(tensor.shape) != whole:
            raise ValueError(
                f"{self._name(part)}.{kind}: checkpoint shape {tuple(tensor.shape)}, expected "
                f"{whole} ({bn}x{bk} blocks of [{self.whole_sizes[part]}, "
                f"{self.spec.in_features}])"
            )
        start, n = self.shards[part]
        cols = self.weight.shape[1]
        block = tensor.float()[start // bn : start // bn + math.ceil(n / bn)]
        block = block[:, self.in_start // bk : self.in_start // bk + math.ceil(cols / bk)]
        first = self.offsets[part] // bn
        self._copy(self.weight_scale.data[first : first + block.shape[0]], block, kind, part)

    def finish_loading(self) -> None:
        needed = ["weight"]
        if not self.online:
            needed.append(self.fmt.scale_kind)
        if self.input_scale is not None:
            needed.append("input_scale")
        for part in range(len(self.whole_sizes)):
            for kind in needed:
                if (kind, part) not in self.loaded:
                    raise ValueError(f"the checkpoint lacks {self._name(part)}.{kind}")

    def dequantized_weight(self) -> torch.Tensor:
        """The weight in float32, [out, in] of this rank: e4m3 values times their scales."""
        w = self.weight.float()
        scale = self.weight_scale
        if self.fmt.weights == "block":
            bn, bk = self.fmt.block  # type: ignore[misc]
            scale = scale.repeat_interleave(bn, dim=0)[: w.shape[0]]
            return w * _expand_cols(scale, bk, w.shape[1])
        return w * scale[:, None]

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """On a GPU, inferx-kernels-cuda's FP8 GEMMs (fp8_gemm.fp8_linear). Elsewhere the
        reference path: activations quantized (quantize_activations) and dequantized, the
        weight dequantized, one float32 GEMM, cast back to x's dtype; then the bias. x may be
        already quantized to this layer's input_quant (a fused norm or activation kernel's
        output): the GEMM then takes it as it is."""
        if isinstance(x, QuantizedActivation):
            return self._forward_quantized(x)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        if x.is_cuda:
            return self._gpu(x, parts=False)
        if self.fmt.activations == "none":
            xd = x2.float()
        else:
            xq, scale = quantize_activations(x2, self.fmt, self.input_scale)
            if self.fmt.activations == "group":
                scale = _expand_cols(scale, self.fmt.block[1], k)  # type: ignore[index]
            xd = xq.float() * scale
        return self._reference_gemm(xd, x.dtype).reshape(*lead, -1)

    def forward_parts(
        self, x: torch.Tensor | QuantizedActivation, trigger: bool = False
    ) -> torch.Tensor:
        """On a GPU, the FP8 GEMM's K-slice parts, the bias in part 0, where it splits K (the
        TMA decode GEMM at decode sizes on Hopper: the caller's sum replaces its reduce
        launch); else y as one part. trigger: the kernel after the GEMM may launch early
        (QuantLinear.takes_trigger; the TMA GEMM's PDL)."""
        if isinstance(x, QuantizedActivation):
            self._check_quantized(x)
        if not (x.data if isinstance(x, QuantizedActivation) else x).is_cuda:
            return super().forward_parts(x)
        return self._gpu(x, parts=True, trigger=trigger)

    def forward_split(
        self, x: torch.Tensor | QuantizedActivation, trigger: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """forward_parts, whose part 0 already holds the bias: none is left to add."""
        return self.forward_parts(x, trigger), None

    def _gpu(
        self, x: torch.Tensor | QuantizedActivation, parts: bool, trigger: bool = False
    ) -> torch.Tensor:
        """inferx-kernels-cuda's FP8 GEMM (fp8_gemm.fp8_linear, or fp8_scaled_linear for x
        already quantized): y [..., N], or with `parts` [S, ..., N]."""
        lead, k = x.shape[:-1], x.shape[-1]
        if isinstance(x, QuantizedActivation):
            y = _gpu_kernels().fp8_scaled_linear(
                x.data.reshape(-1, k), x.scale, self.weight, self.weight_scale, self.bias,
                x.dtype, self._block(), parts=parts, trigger=trigger,
            )  # fmt: skip
        else:
            y = _gpu_kernels().fp8_linear(
                x.reshape(-1, k), self.weight, self.weight_scale, self.bias,
                self.fmt.activations, self._block(), self.input_scale, parts=parts,
                trigger=trigger,
            )  # fmt: skip
        return y.reshape(*y.shape[:-2], *lead, y.shape[-1])

    def _block(self) -> tuple[int, int] | None:
        return self.fmt.block if self.fmt.weights == "block" else None

    def _reference_gemm(self, xd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """xd [M, K] float32 (dequantized activations) times the dequantized weight, cast to
        dtype, plus the bias."""
        y = (xd @ self.dequantized_weight().t()).to(dtype)
        return y if self.bias is None else y + self.bias

    def _check_quantized(self, x: QuantizedActivation) -> None:
        if self.input_quant is None or not self.input_quant.same_as(x.spec):
            raise ValueError(
                f"{self.spec.prefix}: activations quantized as {x.spec.granularity!r}, but "
                f"this layer takes {self._layout()} and no such pre-quantized input"
            )

    def _forward_quantized(self, x: QuantizedActivation) -> torch.Tensor:
        self._check_quantized(x)
        lead, k = x.shape[:-1], x.shape[-1]
        if x.data.is_cuda:
            return self._gpu(x, parts=False)
        return self._reference_gemm(x.dequantize().reshape(-1, k), x.dtype).reshape(*lead, -1)


def _gpu_kernels() -> Any:
    """inferx_kernels_cuda.fp8_gemm, imported when a GPU layer first needs it."""
    from inferx_kernels_cuda import fp8_gemm

    return fp8_gemm


def _check_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        return
    try:
        _gpu_kernels()
    except ImportError as exc:
        raise ValueError(
            "quantization scheme 'fp8' on a GPU runs inferx-kernels-cuda's FP8 GEMMs: "
            f"pip install inferx-kernels-cuda ({exc})"
        ) from None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"quantization scheme 'fp8' needs FP8 tensor cores (sm_89+); this GPU "
            f"({torch.cuda.get_device_name(device)}) is sm_{major}{minor}"
        )


def _refuse(key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"quantization_config.{key} = {value!r} is not supported ({supported})")


def _ct_args(args: dict[str, Any], key: str) -> None:
    """The parts of a compressed-tensors QuantizationArgs every FP8 layout shares."""
    if args.get("num_bits") != 8 or args.get("type") != "float":
        got = (args.get("num_bits"), args.get("type"))
        raise _refuse(f"{key}.num_bits/type", got, "FP8 reads num_bits 8, type 'float'")
    if args.get("symmetric", True) is not True:
        raise _refuse(f"{key}.symmetric", args.get("symmetric"), "FP8 is symmetric")


def _ct_format(group: dict[str, Any], key: str) -> Fp8Format:
    """One compressed-tensors config group as an Fp8Format."""
    weights = group.get("weights")
    if not weights:
        raise _refuse(f"{key}.weights", weights, "FP8 quantizes weights")
    _ct_args(weights, f"{key}.weights")
    if weights.get("dynamic"):
        raise _refuse(f"{key}.weights.dynamic", True, "weights carry their scales")
    strategy = weights.get("strategy")
    block = None
    if strategy == "block":
        block_structure = weights.get("block_structure")
        if not (isinstance(block_structure, list) and len(block_structure) == 2):
            raise _refuse(f"{key}.weights.block_structure", block_structure, "[rows, columns]")
        block = (int(block_structure[0]), int(block_structure[1]))
    elif strategy not in ("channel", "tensor"):
        raise _refuse(f"{key}.weights.strategy", strategy, "channel, tensor or block")
    if group.get("output_activations"):
        raise _refuse(f"{key}.output_activations", group["output_activations"], "none")
    acts = group.get("input_activations")
    act: ActStrategy
    if not acts:
        act = "none"  # weight-only FP8 (W8A16)
    else:
        _ct_args(acts, f"{key}.input_activations")
        act_strategy = acts.get("strategy")
        if not acts.get("dynamic"):
            if act_strategy != "tensor":
                raise _refuse(f"{key}.input_activations.strategy", act_strategy, "static: tensor")
            act = "static"
        elif act_strategy in ("token", "tensor"):
            act = act_strategy
        elif act_strategy == "group" and block and acts.get("group_size") == block[1]:
            act = "group"
        else:
            raise _refuse(
                f"{key}.input_activations.strategy",
                act_strategy,
                "dynamic: token, tensor, or group with group_size equal to the weights' "
                "block columns",
            )
    return Fp8Format(strategy, act, block)


@dataclass(frozen=True)
class _Group:
    """A compressed-tensors config group: the layers it targets and how they are quantized."""

    names: tuple[str, ...]  # layer names and "re:" patterns
    all_linear: bool  # targets "Linear": every linear layer no name claims
    fmt: Fp8Format


class Fp8(QuantScheme):
    """FP8 W8A8 (see the module docstring for the layouts). Layers the checkpoint's ignore list
    names (compressed-tensors `ignore`; Hugging Face's `modules_to_not_convert` or
    `ignored_layers`) stay unquantized DenseLinear, as do layers no config group targets."""

    name = "fp8"
    checkpoint_methods = ("float-quantized", "fp8")
    online = True

    def __init__(self, config: QuantConfig | None = None) -> None:
        super().__init__(config)
        ckpt = self.config.checkpoint
        self.groups: list[_Group] = []
        self.ignore: list[str] = []
        self.is_online = not ckpt
        self._gpu_checked = False
        if not ckpt:
            self.groups = [_Group((), True, Fp8Format("channel", "token"))]
            # MoE routers (FusedMoE's "{prefix}.gate") stay unquantized: a rounded logit can
            # flip a token's experts. A checkpoint's own config says where its routers are.
            self.ignore = [ONLINE_UNQUANTIZED]
        elif str(ckpt.get("quant_method", "")).lower() == "compressed-tensors":
            self._parse_compressed_tensors(ckpt)
        elif str(ckpt.get("quant_method", "")).lower() == "fp8":
            self._parse_hf_fp8(ckpt)
        else:
            raise _refuse("quant_method", ckpt.get("quant_method"), "compressed-tensors, fp8")

    def _parse_compressed_tensors(self, ckpt: dict[str, Any]) -> None:
        if ckpt.get("transform_config"):
            raise _refuse("transform_config", ckpt["transform_config"], "FP8 reads none yet")
        kv = ckpt.get("kv_cache_scheme")
        kv_format = kv and (kv.get("num_bits"), kv.get("type"), kv.get("strategy"))
        if kv and kv_format != (8, "float", "tensor"):
            # the per-layer k_scale / v_scale it writes are what kv_cache.dtype = fp8_e4m3 reads
            raise _refuse("kv_cache_scheme", kv, "8-bit float per tensor")
        sparsity = ckpt.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            raise _refuse("sparsity_config.format", sparsity["format"], "dense")
        groups = ckpt.get("config_groups") or {}
        if not groups:
            raise _refuse("config_groups", groups, "at least one group")
        for name, group in groups.items():
            key = f"config_groups.{name}"
            fmt = group.get("format") or ckpt.get("format")
            if fmt != "float-quantized":
                raise _refuse(f"{key}.format", fmt, "FP8 reads 'float-quantized'")
            # targets name module classes ("Linear", the only one a linear layer here is),
            # layers, or "re:" patterns over layer names
            targets = [str(t) for t in group.get("targets") or []]
            classes = [t for t in targets if t[:1].isupper() and "." not in t]
            if any(c != "Linear" for c in classes):
                raise _refuse(f"{key}.targets", targets, "'Linear', layer names, 're:' patterns")
            names = tuple(t for t in targets if t not in classes)
            self.groups.append(_Group(names, bool(classes), _ct_format(group, key)))
        self.ignore = list(ckpt.get("ignore") or [])

    def _parse_hf_fp8(self, ckpt: dict[str, Any]) -> None:
        fmt = ckpt.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse("fmt", fmt, "e4m3")
        scheme = ckpt.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse("activation_scheme", scheme, "dynamic or static")
        block = ckpt.get("weight_block_size")
        if block is not None:
            if not (isinstance(block, list) and len(block) == 2):
                raise _refuse("weight_block_size", block, "[rows, columns]")
            if scheme != "dynamic":
                raise _refuse("activation_scheme", scheme, "block-wise FP8 is dynamic")
            layout = Fp8Format("block", "group", (int(block[0]), int(block[1])), inverse_name=True)
        else:
            layout = Fp8Format("tensor", "tensor" if scheme == "dynamic" else "static")
        self.groups = [_Group((), True, layout)]
        self.ignore = list(ckpt.get("modules_to_not_convert") or ckpt.get("ignored_layers") or [])

    def format_for(self, spec: LinearSpec) -> Fp8Format | None:
        """How the checkpoint quantized this layer; None where it left it unquantized."""
        if is_ignored(spec, self.ignore):
            return None
        for group in self.groups:
            try:
                if group.names and is_ignored(spec, list(group.names)):
                    return group.fmt
            except ValueError:
                raise ValueError(
                    f"{spec.prefix}: the quantization_config targets some of its fused parts "
                    f"({', '.join(spec.part_names)}) with another config group than the rest"
                ) from None
        for group in self.groups:
            if group.all_linear:
                return group.fmt
        return None

    def linear(
        self,
        spec: LinearSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> QuantLinear:
        fmt = self.format_for(spec)
        if fmt is None:
            return DenseLinear(spec, dtype, device, parallel)
        if not self._gpu_checked:
            _check_gpu(torch.device(device))
            self._gpu_checked = True
        return Fp8Linear(spec, dtype, device, parallel, fmt, online=self.is_online)

    def experts_format(self, spec: ExpertsSpec) -> Fp8Format | None:
        """How the checkpoint quantized a MoE layer's experts, from the names of each expert's
        projections ("{prefix}.{e}.gate_proj", as the checkpoint's config groups and ignore
        list name them); None where it left them all unquantized. One experts method holds
        one layout: a config that quantizes some experts or projections differently from the
        others is refused, as are static activation scales (the experts run weight-only)."""
        found: dict[Fp8Format | None, str] = {}
        dims = {"gate_proj": spec.intermediate_size, "up_proj": spec.intermediate_size}
        entries = [*self.ignore, *(n for g in self.groups for n in g.names)]
        # Names alone (no "re:" pattern) that name none of these experts answer alike for
        # all of them: ask about one (a Qwen3-FP8 config lists every layer's router and norms).
        alike = not any(n.startswith(("re:", f"{spec.prefix}.")) for n in entries)
        for e in range(1 if alike else spec.num_experts):
            for part in ("gate_proj", "up_proj", "down_proj"):
                rows = dims.get(part, spec.hidden_size)
                cols = spec.intermediate_size if part == "down_proj" else spec.hidden_size
                name = f"{spec.prefix}.{e}.{part}"
                found.setdefault(self.format_for(LinearSpec(name, cols, (rows,))), name)
        if len(found) > 1:
            layouts = "; ".join(
                f"{name} {'unquantized' if fmt is None else fmt}" for fmt, name in found.items()
            )
            raise ValueError(
                f"{spec.prefix}: the quantization_config quantizes the experts' projections in "
                f"more than one way ({layouts}); FP8 experts hold one layout per layer"
            )
        fmt = next(iter(found))
        if fmt is None:
            return None
        if fmt.activations == "static":
            raise ValueError(
                f"{spec.prefix}: FP8 experts with static activation scales (input_scale) are "
                "not supported; the experts run weight-only (dynamic activations)"
            )
        return fmt

    def experts(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> QuantExperts:
        """Fp8Experts where the config quantizes the experts, else UnquantizedExperts. The
        router ("{prefix}.gate") is a linear layer the scheme answers for separately."""
        from inferx_quant.fp8_experts import Fp8Experts

        fmt = self.experts_format(spec)
        if fmt is None:
            return UnquantizedExperts(spec, dtype, device, parallel)
        if not self._gpu_checked:
            _check_gpu(torch.device(device))
            self._gpu_checked = True
        return Fp8Experts(spec, dtype, device, parallel, fmt, online=self.is_online)
