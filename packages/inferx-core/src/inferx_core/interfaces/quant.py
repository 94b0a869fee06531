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

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        """y as [S, *y.shape]: S >= 1 partial results that add up to y, for a caller that sums
        them anyway (KernelOps.rms_norm with parts=True). A scheme may split the GEMM along K
        where thinner GEMMs read the weights faster; the default is y itself, S = 1."""
        return self(x).unsqueeze(0)

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(parts, bias): forward_parts without the bias, and the bias the caller must still
        add (None when there is none to add). The default is (y itself as one part, None)."""
        return self(x).unsqueeze(0), None


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
