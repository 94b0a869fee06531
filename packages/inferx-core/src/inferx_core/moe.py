"""Mixture-of-experts in plain torch: the routing function, the unquantized experts method and
the FusedMoE layer a model names (router + experts + optional shared experts). The reference
every faster MoE kernel is tested against; it runs on the CPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from inferx_core.interfaces.model import BuildContext
from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, QuantExperts, RouterSpec
from inferx_core.interfaces.quant import LinearSpec
from inferx_core.parallel import SINGLE, ParallelContext


def route(
    logits: torch.Tensor, spec: RouterSpec, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights [T, k + s] float32, topk_ids [T, k + s] int64):
    the top k picks, largest first, then the spec's s shared experts (append_shared)."""
    logits = logits.float()
    k = spec.top_k
    if spec.softmax_after_topk:
        values, ids = logits.topk(k, dim=-1)
        weights = values.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
        pick = scores if selection_bias is None else scores + selection_bias.float()
        if spec.num_groups > 1:
            t = pick.shape[0]
            grouped = pick.view(t, spec.num_groups, -1)
            if spec.group_score == "max":
                group_scores = grouped.max(dim=-1).values
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(spec.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            pick = pick.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf)
        ids = pick.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return append_shared(weights, ids, spec)


def append_shared(
    weights: torch.Tensor, ids: torch.Tensor, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed picks [T, k] with the spec's shared experts appended: weight 1.0 (they are
    not scaled by `scaling`, which is the routed experts' alone) and ids num_experts ..
    num_experts + shared - 1, [T, k + shared]; unchanged without shared experts."""
    if not spec.shared:
        return weights, ids
    t = ids.shape[0]
    fixed = torch.arange(spec.num_experts, spec.num_experts + spec.shared, device=ids.device)
    ones = torch.ones(t, spec.shared, dtype=weights.dtype, device=weights.device)
    return torch.cat([weights, ones], 1), torch.cat([ids, fixed.to(ids.dtype).expand(t, -1)], 1)


def activate(h: torch.Tensor, spec: ExpertsSpec) -> torch.Tensor:
    """An expert's gate_up output [N, 2I] (in the activation's layout) -> [N, I]."""
    if spec.activation == "silu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate = h[..., 0::2].clamp(max=spec.limit)
    up = h[..., 1::2].clamp(min=-spec.limit, max=spec.limit)
    return gate * torch.sigmoid(spec.alpha * gate) * (up + 1)


def expert_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_bias: torch.Tensor | None,
    spec: ExpertsSpec,
) -> torch.Tensor:
    """One expert on its tokens: x [N, H] -> down(activate(gate_up(x))) [N, H]."""
    return F.linear(activate(F.linear(x, gate_up, gate_up_bias), spec), down, down_bias)


def run_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert(topk_ids[t, j], x[t]), looping over the experts that
    have tokens; expert(e, rows [N, H]) -> [N, H]. The weighted sum is kept in float32 (or x's
    wider dtype) and cast to x's dtype once, so the order experts are added in barely matters.
    Reads the per-expert counts on the host (one sync): not for CUDA graphs."""
    t, k = topk_ids.shape
    flat = topk_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens = order // k
    acc = torch.promote_types(x.dtype, torch.float32)
    weights = topk_weights.flatten()[order].to(acc).unsqueeze(1)
    out = torch.zeros(t, x.shape[1], dtype=acc, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            rows = tokens[start : start + n]
            y = expert(e, x.index_select(0, rows))
            out.index_add_(0, rows, y.to(acc) * weights[start : start + n])
        start += n
    return out.to(x.dtype)


# An expert's projections, as its checkpoint names them ("{e}.gate_proj.weight").
_PARTS = ("gate", "up", "down")


def gate_and_up(
    tensor: torch.Tensor, spec: ExpertsSpec, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up rows (dim 1) of a gate_up tensor [E', 2n, ...], as views, by the
    activation's layout: "silu" gate rows then up rows, "swiglu_oai" interleaved."""
    if spec.activation == "silu":
        gate, up = tensor.split(n, 1)
        return gate, up
    return tensor[:, 0::2], tensor[:, 1::2]


def check_experts_loaded(
    spec: ExpertsSpec, loaded: dict[str, set[int]], names: dict[str, str]
) -> None:
    """A QuantExperts.finish_loading check: every expert's gate, up and down projections were
    loaded with each kind of `names` (loaded: "{part}.{kind}" -> experts; names: kind -> its
    checkpoint name); a ValueError names the first tensor the checkpoint lacks (a shared
    expert's by its slot: the model names the shared MLP's tensor it comes from)."""
    for e in range(spec.num_experts):
        for what, name in names.items():
            for part in _PARTS:
                if e not in loaded.get(f"{part}.{what}", ()):
                    if e >= spec.routed:
                        raise ValueError(
                            f"checkpoint lacks shared expert {e - spec.routed}'s "
                            f"{part}_proj.{name} (slot {e} of {spec.prefix})"
                        )
                    raise ValueError(f"checkpoint lacks {spec.prefix}.{e}.{part}_proj.{name}")


def expert_rows(
    spec: ExpertsSpec,
    kind: str,
    tensor: torch.Tensor,
    expert: int | None,
    shape: tuple[int, ...],
) -> tuple[range, torch.Tensor]:
    """What a QuantExperts.load() call covers: the experts (all for a stacked tensor, expert
    alone for a per-expert one) and the tensor with a leading expert dimension, checked against
    one expert's `shape`; errors name the layer, the tensor and the expert."""
    if expert is None:
        experts = range(spec.num_experts)
    else:
        if not 0 <= expert < spec.num_experts:
            raise ValueError(f"{spec.prefix}: no expert {expert} ({spec.num_experts} experts)")
        experts = range(expert, expert + 1)
        tensor = tensor.unsqueeze(0)
    if tuple(tensor.shape) != (len(experts), *shape):
        got = tuple(tensor.shape)[0 if expert is None else 1 :]
        want = shape if expert is not None else (len(experts), *shape)
        raise ValueError(
            f"{spec.prefix}: {kind} of expert {'all' if expert is None else expert} has "
            f"shape {got}, expected {want}"
        )
    return experts, tensor


class UnquantizedExperts(QuantExperts):
    """A MoE layer's routed experts in the serving dtype, stacked: gate_up [E, 2n, H] in the
    activation's layout ("silu": gate rows then up rows; "swiglu_oai": interleaved) and down
    [E, H, n], with optional biases [E, 2n] / [E, H]; n is this rank's share of the
    intermediate size.

    load() takes weights as [out, in] (a linear layer's layout), per expert (expert=e) or
    stacked (expert=None, a leading [E] dimension), by kind: "gate.weight", "up.weight",
    "down.weight", "gate_up.weight" (gate and up in the activation's layout) and the same with
    ".bias". Checkpoints that store experts as [in, out] (gpt-oss: gate_up_proj [E, H, 2I],
    down_proj [E, I, H]) are passed as transposed views: tensor.transpose(-1, -2). Each rank
    keeps the same slice of every expert's gate and up rows and down columns; the down bias
    lives on rank 0 only, so the all-reduce adds it once.
    """

    def __init__(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        e, h = spec.num_experts, spec.hidden_size
        self.start, n = parallel.shard(spec.intermediate_size, f"{spec.prefix}'s intermediate size")
        self.n = n

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(
                torch.empty(*shape, dtype=dtype, device=device), requires_grad=False
            )

        self.gate_up = param(e, 2 * n, h)
        self.down = param(e, h, n)
        self.gate_up_bias = param(e, 2 * n) if spec.bias else None
        self.down_bias = param(e, h) if spec.bias and parallel.rank == 0 else None
        self._loaded: dict[str, set[int]] = {}

    def load(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> None:
        part, _, what = kind.partition(".")
        if part not in (*_PARTS, "gate_up") or what not in ("weight", "bias"):
            raise ValueError(f"{self.spec.prefix}: unquantized experts have no {kind!r} tensor")
        if what == "bias" and not self.spec.bias:
            raise ValueError(f"{self.spec.prefix}: the experts have no biases ({kind!r})")
        spec = self.spec
        inter = spec.intermediate_size
        rows = {"gate_up": 2 * inter, "down": spec.hidden_size}.get(part, inter)
        cols = inter if part == "down" else spec.hidden_size
        shape = (rows, cols) if what == "weight" else (rows,)
        experts, tensor = expert_rows(spec, kind, tensor, expert, shape)
        index = slice(experts.start, experts.stop)
        if part == "gate_up":
            gate, up = gate_and_up(tensor, spec, inter)
            self._copy("gate", what, gate, index)
            self._copy("up", what, up, index)
            parts: tuple[str, ...] = ("gate", "up")
        else:
            self._copy(part, what, tensor, index)
            parts = (part,)
        for p in parts:
            self._loaded.setdefault(f"{p}.{what}", set()).update(experts)

    def _copy(self, part: str, what: str, tensor: torch.Tensor, index: slice) -> None:
        """Copy this rank's share of whole gate / up / down tensors [E', ...] to experts index."""
        if part == "down":
            if what == "weight":
                self.down.data[index].copy_(tensor.narrow(2, self.start, self.n))
            elif self.down_bias is not None:  # rank 0's
                self.down_bias.data[index].copy_(tensor)
            return
        dest = (self.gate_up if what == "weight" else self.gate_up_bias).data[index]
        gate, up = gate_and_up(dest, self.spec, self.n)
        (gate if part == "gate" else up).copy_(tensor.narrow(1, self.start, self.n))

    def finish_loading(self) -> None:
        whats = ("weight", "bias") if self.spec.bias else ("weight",)
        check_experts_loaded(self.spec, self._loaded, {what: what for what in whats})

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(
            "dense",
            self.gate_up,
            self.down,
            gate_up_bias=self.gate_up_bias,
            down_bias=self.down_bias,
        )

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b13 = None if self.gate_up_bias is None else self.gate_up_bias[e]
        b2 = None if self.down_bias is None else self.down_bias[e]
        return expert_mlp(x, self.gate_up[e], b13, self.down[e], b2, self.spec)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, topk_weights, topk_ids, self.spec.num_experts, self._expert)


class FusedMoE(torch.nn.Module):
    """A MoE layer: router, routed experts and optional shared experts, x [T, H] -> [T, H].

    The router ("{prefix}.gate") is a replicated linear layer from ctx.quant like any other, so
    the scheme decides whether it is quantized (schemes usually leave routers alone: a flipped
    choice of expert changes a token's whole output). Its selection bias (RouterSpec's, float32)
    is the parameter `selection_bias`. The experts come from ctx.quant.experts; routing from
    ctx.ops.route_experts and the experts run through ctx.ops.moe_experts, both of which a kernel
    package may fuse.

    Shared experts come one of two ways. Fused: `experts` has `shared` slots after the
    router's num_experts (ExpertsSpec.shared); the layer's RouterSpec gets the same count, so
    routing appends them to every token with weight 1.0 and the experts' grouped GEMMs run
    them with the routed ones (no module, no add). Apart: `shared`, a module x -> [T, H]
    returning this rank's partial sum like the experts do, added to their output. Either way
    the layer all-reduces once.
    """

    def __init__(
        self,
        ctx: BuildContext,
        prefix: str,
        hidden: int,
        router: RouterSpec,
        experts: ExpertsSpec,
        router_bias: bool = False,
        shared: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        if router.shared not in (0, experts.shared):
            raise ValueError(
                f"{prefix}: the router has {router.shared} shared experts, the experts "
                f"{experts.shared}"
            )
        if experts.routed != router.num_experts:
            raise ValueError(
                f"{prefix}: the router picks among {router.num_experts} experts, the experts "
                f"have {experts.routed} routed ones ({experts.num_experts} with "
                f"{experts.shared} shared)"
            )
        if experts.shared and shared is not None:
            raise ValueError(f"{prefix}: shared experts both fused into the experts and apart")
        router = dataclasses.replace(router, shared=experts.shared)
        self.router = router
        gate = LinearSpec(f"{prefix}.gate", hidden, (router.num_experts,), router_bias)
        self.gate = ctx.quant.linear(gate, ctx.dtype, ctx.device, ctx.parallel)
        self.selection_bias = None
        if router.selection_bias:
            self.selection_bias = torch.nn.Parameter(
                torch.zeros(router.num_experts, device=ctx.device), requires_grad=False
            )
        self.experts = ctx.quant.experts(experts, ctx.dtype, ctx.device, ctx.parallel)
        self.shared = shared
        self.ops = ctx.ops
        self.parallel = ctx.parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the router's logits as partial sums (linear_parts: a kernel package may split its
        # K), summed by route_experts
        logits = self.ops.linear_parts(self.gate, x)
        weights, ids = self.ops.route_experts(logits, self.router, self.selection_bias)
        return self._experts(x, weights, ids)

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x, residual, parts=True)) as partial results [S, T, H] for the next
        norm (KernelOps.moe_experts_parts: a kernel package may leave the top-k sum to it), and
        the norm's new residual: x is the partial results of the sublayer before ([S, T, H]),
        `norm` an RMSNorm (weight, eps)."""
        h, residual = self.ops.rms_norm(x, norm.weight, norm.eps, residual, parts=True)
        logits = self.ops.linear_parts(self.gate, h)
        weights, ids = self.ops.route_experts(logits, self.router, self.selection_bias)
        if self.shared is None and self.parallel.world_size == 1:
            weights, ids = self._with_shared(weights, ids)
            return self.ops.moe_experts_parts(self.experts, h, weights, ids), residual
        return self._experts(h, weights, ids).unsqueeze(0), residual

    def _with_shared(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.router.shared and ids.shape[-1] == self.router.top_k:
            # a KernelOps whose route_experts predates RouterSpec.shared: appended in torch
            return append_shared(weights, ids, self.router)
        return weights, ids

    def _experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self._with_shared(weights, ids)
        out = self.ops.moe_experts(self.experts, x, weights, ids)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.parallel.world_size > 1:
            out = self.parallel.all_reduce(out)
        return out
