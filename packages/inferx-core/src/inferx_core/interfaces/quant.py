"""The quantization contract: a scheme gives each linear layer (and each MoE layer's experts) a
method that owns how its tensors load, shard and multiply."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts
    from inferx_core.parallel import ParallelContext

# How a linear layer is split over tensor-parallel ranks: "column" splits the output rows (each
# fused part on its own), "row" splits the input columns (the outputs are partial sums, added
# by an all-reduce), "replicated" keeps the whole layer on every rank.
ParallelStyle = Literal["column", "row", "replicated"]


@dataclass(frozen=True)
class LinearSpec:
    """One linear layer as a model declares it, before any sharding.

    prefix: its checkpoint name without ".weight" ("model.layers.0.self_attn.qkv_proj" for a
    fused layer: a scheme matches ignore lists and per-layer settings against it and against
    `part_names`, the checkpoint names of its fused parts, e.g. ("q_proj", "k_proj", "v_proj")).
    output_sizes: the fused parts' output rows (q, k, v or gate, up), whole-model sizes.
    part_heads: for a column-parallel layer, each part's rows as this many equal heads that a
    rank never splits (0 or absent: rows split evenly). Fewer heads than ranks replicate each
    head over world_size / heads ranks (the KV heads of a GQA model on many ranks): rank r keeps
    head r * heads // world_size.
    """

    prefix: str
    in_features: int
    output_sizes: tuple[int, ...]
    bias: bool = False
    parallel: ParallelStyle = "replicated"
    part_names: tuple[str, ...] = ()
    part_heads: tuple[int, ...] = ()

    @property
    def out_features(self) -> int:
        return sum(self.output_sizes)


ActGranularity = Literal["token", "group", "static"]


@dataclass(frozen=True, eq=False)
class ActivationQuant:
    """The e4m3 input a quantized linear layer takes already quantized (its `input_quant`):
    scales per token ("token": each row's absmax / 448), per token per `group` columns
    ("group"), or one static scale (`static_scale`, a [1] float32 tensor the layer owns).
    Dynamic scales are at least 1 / (448 * 512). A norm or activation kernel before the layer
    may quantize its output to it (KernelOps.rms_norm_quant, silu_and_mul_quant)."""

    granularity: ActGranularity
    group: int = 0
    static_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.granularity == "group") != (self.group > 0):
            raise ValueError(f"activation quantization {self.granularity!r}: group {self.group}")
        if (self.granularity == "static") != (self.static_scale is not None):
            raise ValueError("static activation quantization needs its scale, and only it")

    def same_as(self, other: ActivationQuant | None) -> bool:
        """Whether activations quantized for one layer serve the other unchanged (a static
        scale is the same tensor, not only the same value: a checkpoint may load it later)."""
        return (
            other is not None
            and (self.granularity, self.group) == (other.granularity, other.group)
            and self.static_scale is other.static_scale
        )

    def quantize(self, x: torch.Tensor) -> QuantizedActivation:
        """The reference: x [..., K] quantized in torch (inferx_core.quant_utils), what every
        fused kernel must give bit for bit."""
        from inferx_core.quant_utils import quantize_e4m3

        flat = x.reshape(-1, x.shape[-1])
        data, scale = quantize_e4m3(flat, self.granularity, self.group, self.static_scale)
        return QuantizedActivation(data.view(x.shape), scale, x.dtype, self)


@dataclass(frozen=True, eq=False)
class QuantizedActivation:
    """Activations already quantized for the next linear layer: `data` e4m3 [..., K], `scale`
    float32 [rows, 1] per token, [rows, ceil(K / group)] per group or [1, 1] static (rows:
    data's leading dims flattened), `dtype` the activations' own (the layer's output dtype),
    `spec` how they were quantized. A layer whose input_quant is the same spec takes it as
    input in place of a plain tensor."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    spec: ActivationQuant

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        """data times its scales, float32 [..., K] (exact: e4m3 values times float32 scales)."""
        flat = self.data.reshape(-1, self.data.shape[-1]).float()
        scale = self.scale
        if self.spec.granularity == "group":
            scale = scale.repeat_interleave(self.spec.group, dim=-1)[:, : flat.shape[1]]
        return (flat * scale).view(self.data.shape)


def input_quant(*linears: object) -> ActivationQuant | None:
    """The format every one of these layers takes pre-quantized (their `input_quant`, all the
    same spec), or None where one of them takes plain activations or they differ."""
    specs = [getattr(linear, "input_quant", None) for linear in linears]
    first = specs[0] if specs else None
    if first is None or not all(first.same_as(s) for s in specs[1:]):
        return None
    return first


class QuantLinear(torch.nn.Module, ABC):
    """A linear layer's method bound to its tensors: y = x @ W.T (+ b), W stored however the
    scheme likes, on this rank's shard.

    Checkpoint tensors arrive whole through load(), one fused part at a time; the method slices
    this rank's shard itself (by spec.parallel and the ParallelContext it was built with), so
    models never slice weights. A row-parallel layer's forward() returns this rank's partial
    sum; the model's all-reduce (ParallelContext.all_reduce) adds the ranks' parts.
    """

    spec: LinearSpec
    bias: torch.Tensor | None  # added after the GEMM, in the activations' dtype (this rank's)
    # The tensors the checkpoint holds for each fused part besides its bias ("<part>.<kind>"),
    # which the model requires by name: a scheme whose layers keep no "weight" names its own.
    checkpoint_kinds: tuple[str, ...] = ("weight",)
    # Where the method quantizes its input itself (FP8 W8A8), the format it takes: its
    # forward then also accepts a QuantizedActivation of this spec, which a fused norm or
    # activation kernel before it produced. None: plain activations only.
    input_quant: ActivationQuant | None = None
    # Whether forward_parts and forward_split take a keyword `trigger` (bool): True where the
    # kernel after the GEMM launches early (programmatic dependent launch), so the method's
    # GEMV may let it start before the GEMV ends. A kernel package passes it only to methods
    # that set this; others are called as before.
    takes_trigger: bool = False

    @abstractmethod
    def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Copy a whole checkpoint tensor of this layer, keeping this rank's shard. kind:
        "weight", "bias" or a scheme's own ("weight_scale", "qweight", ...); part: index into
        spec.output_sizes."""

    def finish_loading(self) -> None:
        """Called once every tensor is loaded: repack, transpose or check completeness here.
        Raise ValueError naming the missing tensor if the checkpoint lacked one."""

    def dense_weight(self) -> torch.Tensor | None:
        """The weight as a plain [out, in] tensor in the activations' dtype, for kernel packages
        that fuse the GEMM with the ops around it (norms, activations); None where the method
        stores it otherwise: kernel packages then call forward / forward_parts / forward_split,
        which the method may fuse itself."""
        return None

    def forward_parts(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """y as [S, *y.shape]: S >= 1 partial results that add up to y, for a caller that sums
        them anyway (KernelOps.rms_norm with parts=True). A scheme may split the GEMM along K
        where thinner GEMMs read the weights faster; the default is y itself, S = 1."""
        return self(x).unsqueeze(0)

    def forward_split(
        self, x: torch.Tensor | QuantizedActivation
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(parts, bias): forward_parts without the bias, and the bias the caller must still
        add (None when there is none to add). The default is (y itself as one part, None)."""
        return self(x).unsqueeze(0), None

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gated layer (outputs: gate rows, then as many up rows), silu(gate) * up where
        the method fuses it into its GEMM, rounded as KernelOps.silu_and_mul on forward's
        output would be; None (the default) where it does not: the caller runs forward and
        then silu_and_mul."""
        return None


@dataclass
class QuantConfig:
    """What a scheme is built from: the checkpoint's `quantization_config` (Hugging Face's
    convention; empty for an unquantized checkpoint) and the deployment's [quantization] table
    (`options`: its keys besides `scheme`)."""

    checkpoint: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


class QuantScheme:
    """Chosen by name ([quantization] scheme, or the checkpoint's quant_method). "none" is the
    unquantized default. Built as `Scheme(QuantConfig)`; it answers, for each layer by its spec
    (prefix and kind), with a method object that owns the layer's tensors.

    `checkpoint_methods`: the `quantization_config.quant_method` values (and, for
    compressed-tensors, format names) this scheme reads from checkpoints; `online`: whether it
    can quantize an unquantized checkpoint at load; `option_names`: the [quantization] keys it
    takes (any other is refused at construction, naming the key).
    """

    name: str = "none"
    checkpoint_methods: tuple[str, ...] = ()
    online: bool = False
    option_names: tuple[str, ...] = ()

    def __init__(self, config: QuantConfig | None = None) -> None:
        self.config = config or QuantConfig()
        for key in self.config.options:
            if key not in self.option_names:
                takes = ", ".join(self.option_names) or "none"
                raise ValueError(
                    f"quantization.{key}: unknown option of scheme {self.name!r} "
                    f"(its options: {takes})"
                )

    def linear(
        self,
        spec: LinearSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
    ) -> QuantLinear:
        """The method for one linear layer. The default is the unquantized one, which a scheme
        also returns for layers it leaves alone (ignore lists, routers, an lm_head)."""
        from inferx_core.quant_none import DenseLinear

        return DenseLinear(spec, dtype, device, parallel)

    def experts(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
    ) -> QuantExperts:
        """The method for one MoE layer's routed experts."""
        raise NotImplementedError(f"quantization scheme {self.name!r} has no MoE experts method")
