"""The fused-MoE contract: how a token picks its experts (RouterSpec) and the method that owns a
layer's routed experts (QuantExperts, built by the quant scheme like a linear layer's)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class RouterSpec:
    """Routing of one MoE layer: from router logits [T, num_experts] to top_k (weight, expert)
    pairs per token, then `shared` fixed pairs.

    scoring: "softmax" over all experts, or "sigmoid" per expert (DeepSeek-V3).
    softmax_after_topk: pick the top_k raw logits, then softmax over those k (gpt-oss, Mixtral);
    otherwise score all experts first, then pick (Qwen-MoE, DeepSeek).
    renormalize: scale the picked scores to sum to 1 (Qwen3-MoE's norm_topk_prob).
    num_groups / topk_groups: group-limited routing (DeepSeek): experts form num_groups equal
    groups, a group scores by its best expert ("max") or the sum of its best two ("top2"), and
    tokens pick only among the best topk_groups groups.
    selection_bias: a per-expert bias added to the scores for picking only, not to the weights
    (DeepSeek-V3's e_score_correction_bias; the tensor is passed to route()).
    scaling: the routed experts' output is multiplied by this (routed_scaling_factor).
    shared: always-on experts after the routed ones (ExpertsSpec.shared): every token also
    gets the pairs (1.0, num_experts + i) for i < shared, after its top_k picks, unscaled. The
    logits stay [T, num_experts]; routing returns [T, top_k + shared].
    """

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    softmax_after_topk: bool = False
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: Literal["max", "top2"] = "max"
    selection_bias: bool = False
    scaling: float = 1.0
    shared: int = 0

    def __post_init__(self) -> None:
        if self.shared < 0:
            raise ValueError(f"shared experts {self.shared} must be >= 0")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be 1..num_experts ({self.num_experts})")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.num_groups} groups, {self.topk_groups} "
                "picked: groups must divide the experts and 1 <= topk_groups <= num_groups"
            )
        if self.softmax_after_topk and (self.scoring != "softmax" or self.num_groups > 1):
            raise ValueError("softmax_after_topk needs softmax scoring and no expert groups")


# Activations between an expert's gate_up and down projections:
# "silu": silu(gate) * up, gate the first half of gate_up's output and up the second.
# "swiglu_oai": gpt-oss's: gate and up interleaved (even / odd columns), gate clamped above at
#   `limit`, up to [-limit, limit], out = gate * sigmoid(alpha * gate) * (up + 1).
Activation = Literal["silu", "swiglu_oai"]


@dataclass(frozen=True)
class ExpertsSpec:
    """One MoE layer's routed experts, before any sharding.

    prefix: checkpoint prefix of the experts ("model.layers.0.mlp.experts"); per-expert
    checkpoints name "{prefix}.{e}.gate_proj.weight" etc., stacked ones "{prefix}.gate_up_proj"
    with a leading expert dimension (the model maps names to load() calls).
    shared: the last `shared` of the num_experts are shared experts that every token takes
    with weight 1.0 (RouterSpec.shared routes them), held and run like the routed ones, so
    one grouped GEMM per projection does both. num_experts counts them: a method allocating
    [num_experts, ...] holds them unchanged. A shared MLP of intermediate size s * I is s such
    experts (SiLU-and-mul is elementwise over the intermediate dimension: rows [i*I, (i+1)*I)
    of its gate and up, the same columns of its down); the model loads them as experts
    num_experts - shared + i.
    """

    prefix: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: Activation = "silu"
    bias: bool = False
    alpha: float = 1.702  # swiglu_oai
    limit: float = 7.0  # swiglu_oai
    shared: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.shared < self.num_experts:
            raise ValueError(
                f"{self.prefix}: {self.shared} shared experts must leave routed ones among the "
                f"{self.num_experts} experts (0 <= shared < num_experts)"
            )

    @property
    def routed(self) -> int:
        """The routed experts: the first num_experts - shared."""
        return self.num_experts - self.shared


@dataclass(frozen=True)
class ExpertWeights:
    """A layer's expert tensors as stored, for kernel packages that run the experts as one
    grouped GEMM per projection (KernelOps.moe_experts). Shapes are this rank's.

    format "dense": gate_up [E, 2n, H] and down [E, H, n] in the activations' dtype.
    format "mxfp4": gate_up [E, 2n, H / 32, 16] and down [E, H, n / 32, 16] uint8 (two e2m1
    values a byte, the low nibble the even element) with e8m0 scales gate_up_scales
    [E, 2n, H / 32] and down_scales [E, H, n / 32] uint8 (value = e2m1 * 2^(scale - 127));
    n is a whole number of 32-column groups, a rank's share zero-padded to it.
    format "fp8": gate_up [E, 2n, H] and down [E, H, n] float8_e4m3fn, scaled per output row by
    gate_up_scales [E, 2n] and down_scales [E, H] float32 (weight-only: the activations stay in
    their dtype); with scale_block_k = bk > 0 the scales are per row per bk columns of K,
    gate_up_scales [E, 2n, ceil(H / bk)] and down_scales [E, H, ceil(n / bk)] (a checkpoint's
    block scales repeated over their rows), unit stride along K.
    format "w4a16": 4-bit integers in groups along K (GPTQ / AWQ), packed as the W4A16 linear
    layer keeps them (inferx_quant.w4a16): gate_up int32 [E, H / 8, 2n] and down int32
    [E, n / 8, H], eight values of one output a word along K (nibble j of word [i, c] is input
    row 8i + j of output c: GPTQ's packing), so an expert's outputs are the unit-stride axis;
    scales gate_up_scales [E, H / g, 2n] and down_scales [E, n / g, H] float16 as checkpoints
    store them; zero points gate_up_zeros / down_zeros uint8 of the scales' shapes (the zero
    itself), None where the checkpoint is symmetric (zero 8); weight = (q - zero) * scale.
    group_size g: 32, 64 or 128, or -1 for one group over each projection's whole K (then H for
    gate_up, n for down). Act-order (GPTQ desc_act) checkpoints have their rows sorted into
    group order at load, per expert, with gate_up_perm int32 [E, H] and down_perm [E, n]: row
    i of expert e's weight multiplies activation column perm[e, i]; None otherwise. Every
    tensor contiguous; n a multiple of g (a rank's share never cuts a group), except where
    down_row_group int32 [E, n] is given (act-order split over tensor-parallel ranks: a rank's
    rows of down hold a scattered part of each group): then down_scales / down_zeros are
    [E, G', H], the groups the rank's rows touch, row i of expert e's down takes scale and zero
    row down_row_group[e, i], and n need only be a multiple of 16.
    gate_up's rows (its columns, for "w4a16") are in the activation's layout
    (ExpertsSpec.activation); biases [E, 2n] / [E, H] in the activations' dtype, None where
    there are none (the down bias on rank 0 only).
    """

    format: Literal["dense", "mxfp4", "fp8", "w4a16"]
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    scale_block_k: int = 0
    gate_up_zeros: torch.Tensor | None = None
    down_zeros: torch.Tensor | None = None
    gate_up_perm: torch.Tensor | None = None
    down_perm: torch.Tensor | None = None
    group_size: int = 0
    down_row_group: torch.Tensor | None = None


class QuantExperts(torch.nn.Module, ABC):
    """The routed experts of one MoE layer bound to their tensors, however the scheme stores
    them. Tensor-parallel ranks hold a slice of every expert's intermediate dimension (the
    output is then this rank's partial sum, as a row-parallel linear's; the down bias is
    rank 0's alone)."""

    spec: ExpertsSpec

    @abstractmethod
    def load(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> None:
        """Copy one checkpoint tensor. kind: "gate_up", "gate", "up" or "down" followed by
        ".weight" / ".bias" or a scheme's own suffix (".blocks", ".scales", ...); expert: the
        expert's index for a per-expert tensor, None for one stacked over all experts
        ([num_experts, ...]). "gate_up" is stacked in the activation's layout. Weights are
        [out, in] like a linear layer's: a model whose checkpoint stores them [in, out]
        (gpt-oss's gate_up_proj / down_proj) passes tensor.transpose(-1, -2)."""

    def finish_loading(self) -> None:
        """Called once every tensor is loaded; raise ValueError naming a missing tensor."""

    def expert_weights(self) -> ExpertWeights | None:
        """The tensors in a layout fused kernels read (ExpertWeights), or None where the method
        stores them otherwise: KernelOps.moe_experts then calls forward."""
        return None

    @abstractmethod
    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, hidden], topk_weights [T, k] float32, topk_ids [T, k] int -> [T, hidden]:
        sum over j of topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), in x's dtype."""
