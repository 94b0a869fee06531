"""A one-layer attention-only model, and an attention backend that counts its calls."""

from __future__ import annotations

from typing import Any

import torch

from inferx_core.attention_torch import TorchAttention
from inferx_core.interfaces import BuildContext, KVLayerSpec, ModelArch


class CountingAttention(TorchAttention):
    calls = 0

    def forward(self, layer, q, k, v):  # type: ignore[override]
        CountingAttention.calls += 1
        return super().forward(layer, q, k, v)


class ToyForCausalLM(ModelArch):
    @classmethod
    def kv_layout(
        cls, hf_config: dict[str, Any], parallel=None, kv_dtype="auto"
    ) -> list[KVLayerSpec]:
        return [KVLayerSpec(num_q_heads=2, num_kv_heads=1, head_dim=hf_config["hidden_size"] // 2)]

    @classmethod
    def checkpoint_shapes(cls, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        h, v = hf_config["hidden_size"], hf_config["vocab_size"]
        return {"embed.weight": (v, h), "qkv.weight": (2 * h, h), "head.weight": (v, h)}

    def __init__(self, hf_config: dict[str, Any], ctx: BuildContext) -> None:
        super().__init__()
        h, v = hf_config["hidden_size"], hf_config["vocab_size"]
        self.h = h
        self.attention = ctx.attention
        self.attn = ctx.attention.layer(0, (h // 2) ** -0.5)
        self.embed = torch.nn.Embedding(v, h, dtype=ctx.dtype)
        # q (h: two heads), k and v (h/2 each: one kv head)
        self.qkv = torch.nn.Linear(h, 2 * h, bias=False, dtype=ctx.dtype)
        self.head = torch.nn.Linear(h, v, bias=False, dtype=ctx.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).split([self.h, self.h // 2, self.h // 2], dim=-1)
        d = self.h // 2
        out = self.attention.forward(
            self.attn, q.view(-1, 2, d), k.view(-1, 1, d), v.view(-1, 1, d)
        )
        return x + out.reshape(-1, self.h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        seen = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            seen.add(name)
        if seen != set(params):
            raise ValueError(f"missing weights: {sorted(set(params) - seen)}")
