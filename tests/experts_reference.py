"""Helpers of the quantized-experts tests (test_fp8_experts, test_w4a16_experts): random routing,
the float64 pair-by-pair reference on the exact dequantized weights, the relative error."""

from __future__ import annotations

import torch

from inferx_core.interfaces.moe import ExpertsSpec, RouterSpec
from inferx_core.moe import route


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def shapes(spec: ExpertsSpec) -> dict[str, tuple[int, int]]:
    """Each projection's weight shape [out, in]."""
    h, n = spec.hidden_size, spec.intermediate_size
    return {"gate": (n, h), "up": (n, h), "down": (h, n)}


def routing(tokens: int, spec: ExpertsSpec, k: int, seed: int):
    logits = torch.randn(tokens, spec.num_experts, generator=gen(seed))
    return route(logits, RouterSpec(spec.num_experts, k, renormalize=True))


def reference(x, topk_weights, topk_ids, spec: ExpertsSpec, weights, biases) -> torch.Tensor:
    """Pair by pair in float64. weights[expert, part] is a tuple whose last item is the exact
    dequantized weight [out, in]; biases[expert, part] where the spec has them."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = {}
            for p in ("gate", "up"):
                h[p] = weights[e, p][-1].double() @ x[t].double()
                if biases:
                    h[p] = h[p] + biases[e, p].double()
            if spec.activation == "silu":
                a = torch.nn.functional.silu(h["gate"]) * h["up"]
            else:
                gate = h["gate"].clamp(max=spec.limit)
                up = h["up"].clamp(-spec.limit, spec.limit)
                a = gate * torch.sigmoid(spec.alpha * gate) * (up + 1)
            y = weights[e, "down"][-1].double() @ a
            if biases:
                y = y + biases[e, "down"].double()
            out[t] += topk_weights[t, j].double() * y
    return out


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the reference's largest magnitude."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def moe_layers(llm):
    """The routed layers (0 and 2) of the tests' tiny Qwen3-MoE."""
    layers = llm.engine.executor.model.model.layers
    return layers[0].mlp, layers[2].mlp
