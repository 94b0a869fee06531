"""Qwen3 and Qwen3-MoE: the Llama decoder with each q and k head RMS-normed before the rotary,
and for the MoE model routed experts (FusedMoE) in place of the dense MLP in most layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from inferx_core.interfaces.model import BuildContext
from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts, RouterSpec
from inferx_core.moe import FusedMoE
from inferx_models.llama import LlamaForCausalLM

_EXPERT_PARTS = ("gate", "up", "down", "gate_up")


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama's layout (biases only with `attention_bias`, head_dim from the config)
    plus `self_attn.q_norm` / `k_norm` over head_dim."""

    qk_norm = True


def num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer: published configs say `num_experts`, transformers 5 writes
    `num_local_experts`."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def is_moe_layer(hf_config: dict[str, Any], layer: int) -> bool:
    """Qwen3-MoE's rule: every decoder_sparse_step-th layer, except those in mlp_only_layers."""
    step = hf_config.get("decoder_sparse_step", 1)
    return (
        layer not in (hf_config.get("mlp_only_layers") or [])
        and num_experts(hf_config) > 0
        and (layer + 1) % step == 0
    )


class SparseMoeBlock(FusedMoE):
    """A FusedMoE layer ("mlp.gate" router, "mlp.experts") as a decoder layer's MLP: its
    forward_normed keeps MLP.forward_normed's contract (the output as parts, the residual)."""


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE: softmax routing to num_experts_per_tok of the experts, renormalized with
    norm_topk_prob; layers outside is_moe_layer keep a dense MLP of intermediate_size.

    Experts load from the published layout, one tensor per expert and projection
    ("mlp.experts.{e}.gate_proj.weight"), or stacked over the experts as transformers 5 holds
    them in memory ("mlp.experts.gate_up_proj" [E, 2I, H], "mlp.experts.down_proj" [E, H, I]).
    """

    @classmethod
    def build_mlp(cls, hf_config: dict[str, Any], layer: int, ctx: BuildContext) -> nn.Module:
        if not is_moe_layer(hf_config, layer):
            return super().build_mlp(hf_config, layer, ctx)
        hidden, n = hf_config["hidden_size"], num_experts(hf_config)
        prefix = f"model.layers.{layer}.mlp"
        top_k = hf_config["num_experts_per_tok"]
        router = RouterSpec(n, top_k, renormalize=bool(hf_config.get("norm_topk_prob", False)))
        experts = ExpertsSpec(f"{prefix}.experts", n, hidden, hf_config["moe_intermediate_size"])
        return SparseMoeBlock(ctx, prefix, hidden, router, experts)

    @classmethod
    def mlp_shapes(cls, hf_config: dict[str, Any], layer: int) -> list[tuple[str, int, int, bool]]:
        if not is_moe_layer(hf_config, layer):
            return super().mlp_shapes(hf_config, layer)
        hidden, n = hf_config["hidden_size"], num_experts(hf_config)
        inter = hf_config["moe_intermediate_size"]
        shapes = [("mlp.gate", n, hidden, False)]
        for e in range(n):
            shapes += [
                (f"mlp.experts.{e}.gate_proj", inter, hidden, False),
                (f"mlp.experts.{e}.up_proj", inter, hidden, False),
                (f"mlp.experts.{e}.down_proj", hidden, inter, False),
            ]
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((n, t) for n, t in weights if not self._load_expert(n, t))
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                try:
                    layer.mlp.experts.finish_loading()
                except ValueError as exc:
                    raise ValueError(f"{type(self).__name__}: {exc}") from None

    def _expected_names(self) -> set[str]:
        # Either expert layout will do: the experts check their own completeness.
        return {n for n in super()._expected_names() if ".mlp.experts." not in n}

    def _load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """Load `name` into its layer's experts if it is an expert tensor; False if it is not."""
        layer, sep, rest = name.partition(".mlp.experts.")
        if not sep:
            return False
        arch = type(self).__name__
        experts = self._submodule(f"{layer}.mlp.experts", name)
        head, _, kind = rest.partition(".")
        expert: int | None = None
        if head.isdigit():  # "{e}.gate_proj.weight"
            expert = int(head)
            head, _, kind = kind.partition(".")
        else:  # stacked: "gate_up_proj", "down_proj"
            kind = kind or "weight"
        part = head.removesuffix("_proj")
        if not isinstance(experts, QuantExperts) or part not in _EXPERT_PARTS or not kind:
            raise ValueError(f"{arch}: unexpected checkpoint tensor {name!r}")
        try:
            experts.load(f"{part}.{kind}", tensor, expert)
        except ValueError as exc:
            raise ValueError(f"{arch}: checkpoint tensor {name!r}: {exc}") from None
        return True
