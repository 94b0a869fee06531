"""A tiny mixture-of-experts decoder built only from InferX's public contracts: each layer is
RMSNorm -> attention (ctx.attention) -> RMSNorm -> FusedMoE (ctx.quant's router and experts).
No rotary embedding: the toy needs none to prove the contracts. Checkpoint names follow
Qwen3-MoE's per-expert layout ("model.layers.{i}.mlp.experts.{e}.gate_proj.weight")."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inferx_core.interfaces import (
    BuildContext,
    ExpertsSpec,
    KVLayerSpec,
    LinearSpec,
    ModelArch,
    QuantLinear,
    RouterSpec,
)
from inferx_core.moe import FusedMoE
from inferx_core.parallel import SINGLE, ParallelContext

QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
EXPERT_NAME = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """hidden, query heads, KV heads, head dim."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    return h, heads, cfg["num_key_value_heads"], h // heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device))
        self.eps, self.ops = eps, ctx.ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class ToyMoeLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, ctx: BuildContext) -> None:
        super().__init__()
        h, heads, kv_heads, d = _dims(cfg)
        prefix = f"model.layers.{index}"
        self.shape = (heads, kv_heads, d)
        eps = cfg["rms_norm_eps"]

        def linear(name: str, in_features: int, sizes: tuple[int, ...], **kw: Any) -> QuantLinear:
            spec = LinearSpec(f"{prefix}.self_attn.{name}", in_features, sizes, **kw)
            return ctx.quant.linear(spec, ctx.dtype, ctx.device, ctx.parallel)

        self.input_layernorm = RMSNorm(h, eps, ctx)
        sizes = (heads * d, kv_heads * d, kv_heads * d)
        self.qkv_proj = linear("qkv_proj", h, sizes, parallel="column", part_names=tuple(QKV))
        self.o_proj = linear("o_proj", heads * d, (h,), parallel="row")
        self.attention = ctx.attention
        self.attn = ctx.attention.layer(index, d**-0.5)
        self.post_attention_layernorm = RMSNorm(h, eps, ctx)
        num_experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
        self.mlp = FusedMoE(
            ctx,
            f"{prefix}.mlp",
            h,
            RouterSpec(num_experts, top_k, renormalize=cfg.get("norm_topk_prob", True)),
            ExpertsSpec(f"{prefix}.mlp.experts", num_experts, h, cfg["moe_intermediate_size"]),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads, kv_heads, d = self.shape
        q, k, v = self.qkv_proj(self.input_layernorm(x)).split(
            [heads * d, kv_heads * d, kv_heads * d], dim=-1
        )
        out = self.attention.forward(
            self.attn, q.view(-1, heads, d), k.view(-1, kv_heads, d), v.view(-1, kv_heads, d)
        )
        x = x + self.o_proj(out.reshape(-1, heads * d))
        return x + self.mlp(self.post_attention_layernorm(x))


class ToyMoeForCausalLM(ModelArch):
    @classmethod
    def kv_layout(
        cls, hf_config: dict[str, Any], parallel: ParallelContext = SINGLE, kv_dtype: str = "auto"
    ) -> list[KVLayerSpec]:
        _, heads, kv_heads, d = _dims(hf_config)
        spec = KVLayerSpec(num_q_heads=heads, num_kv_heads=kv_heads, head_dim=d, dtype=kv_dtype)
        return [spec] * hf_config["num_hidden_layers"]

    @classmethod
    def checkpoint_shapes(cls, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        h, heads, kv_heads, d = _dims(hf_config)
        vocab, inter = hf_config["vocab_size"], hf_config["moe_intermediate_size"]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
        for i in range(hf_config["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (heads * d, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_heads * d, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_heads * d, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, heads * d)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate.weight"] = (hf_config["num_experts"], h)
            for e in range(hf_config["num_experts"]):
                shapes[f"{p}mlp.experts.{e}.gate_proj.weight"] = (inter, h)
                shapes[f"{p}mlp.experts.{e}.up_proj.weight"] = (inter, h)
                shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (h, inter)
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (vocab, h)
        return shapes

    def __init__(self, hf_config: dict[str, Any], ctx: BuildContext) -> None:
        super().__init__()
        if ctx.parallel.world_size != 1:
            raise NotImplementedError("ToyMoeForCausalLM runs on one rank only")
        self.hf_config = hf_config
        h, vocab = hf_config["hidden_size"], hf_config["vocab_size"]
        self.ops = ctx.ops
        self.embed_tokens = nn.Parameter(torch.empty(vocab, h, dtype=ctx.dtype, device=ctx.device))
        layers = range(hf_config["num_hidden_layers"])
        self.layers = nn.ModuleList(ToyMoeLayer(hf_config, i, ctx) for i in layers)
        self.norm = RMSNorm(h, hf_config["rms_norm_eps"], ctx)
        self.lm_head = nn.Parameter(torch.empty(vocab, h, dtype=ctx.dtype, device=ctx.device))
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.ops.embedding(self.embed_tokens, input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        expected = self.checkpoint_shapes(self.hf_config)
        top = {
            "model.embed_tokens.weight": self.embed_tokens,
            "model.norm.weight": self.norm.weight,
            "lm_head.weight": self.lm_head,
        }
        seen = set()
        for name, tensor in weights:
            if name not in expected:
                raise ValueError(f"ToyMoeForCausalLM: unexpected checkpoint tensor {name!r}")
            match = LAYER_NAME.fullmatch(name)
            if match is None:
                top[name].copy_(tensor)
            else:
                self._load_layer(self.layers[int(match[1])], match[2], tensor)
            seen.add(name)
        missing = sorted(set(expected) - seen)
        if missing:
            raise ValueError(f"ToyMoeForCausalLM: checkpoint lacks {', '.join(missing[:5])}")
        for layer in self.layers:
            for method in (layer.qkv_proj, layer.o_proj, layer.mlp.gate, layer.mlp.experts):
                method.finish_loading()

    @staticmethod
    def _load_layer(layer: ToyMoeLayer, name: str, tensor: torch.Tensor) -> None:
        """One tensor of a layer, by its name within the layer ("self_attn.q_proj.weight")."""
        block, _, rest = name.partition(".")
        if block == "self_attn":
            proj = rest.removesuffix(".weight")
            if proj in QKV:
                layer.qkv_proj.load("weight", tensor, QKV[proj])
            else:
                layer.o_proj.load("weight", tensor)
        elif name == "mlp.gate.weight":
            layer.mlp.gate.load("weight", tensor)
        elif expert := EXPERT_NAME.fullmatch(name):
            layer.mlp.experts.load(f"{expert[2]}.weight", tensor, int(expert[1]))
        else:  # the two norms
            getattr(layer, block).weight.copy_(tensor)
