"""MXFP4 (OCP microscaling FP4), as gpt-oss checkpoints store their MoE experts: the scheme, the
experts method that keeps the packed blocks and scales, and the torch reference dequantization.

Layout (transformers' and OpenAI's): a weight [out, in] is stored as `*_blocks` uint8
[..., out, in / 32, 16], two e2m1 values a byte (the low nibble the even element), and
`*_scales` uint8 [..., out, in / 32], one e8m0 exponent per 32 elements (value = e2m1 *
2^(scale - 127)). Blocks are in a linear layer's [out, in] order, unlike gpt-oss's bf16 expert
tensors, which are [in, out]: transformers transposes after dequantizing, we need not.
"""

from __future__ import annotations

import re

import torch

from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, QuantExperts
from inferx_core.interfaces.quant import QuantConfig, QuantScheme
from inferx_core.moe import UnquantizedExperts, expert_mlp, expert_rows, run_experts
from inferx_core.parallel import SINGLE, ParallelContext

BLOCK = 32  # elements per e8m0 scale
# e2m1 by its 4-bit code: sign bit 3, then 2 exponent bits and 1 mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127


def dequant_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 and scales [..., G] uint8 -> [..., G * 32] in `dtype`.

    Exact in float32 and bfloat16 (an e2m1 value times a power of two) for scales within
    their exponent range."""
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32], even elements low
    scale = torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return (values * scale).flatten(-2).to(dtype)


def should_convert(prefix: str, not_convert: list[str]) -> bool:
    """Whether a module is quantized, by transformers' reading of modules_to_not_convert: an
    entry matches a module from the start of its name up to a module boundary, as a regex
    ("model.layers.*.self_attn"), or as a suffix ("lm_head")."""
    for entry in not_convert:
        if re.match(rf"(?:{entry})(?:(?<=\.)|(?=\.|$))", prefix) or prefix.endswith(entry):
            return False
    return True


class Mxfp4Experts(QuantExperts):
    """A MoE layer's experts as MXFP4: gate_up blocks [E, 2I, H / 32, 16] and scales
    [E, 2I, H / 32] (gate and up rows in the activation's layout), down blocks [E, H, I / 32, 16]
    and scales [E, H, I / 32], all uint8 as the checkpoint stores them; biases [E, 2I] / [E, H]
    in the serving dtype.

    The torch reference: forward dequantizes each expert that has tokens to the activations'
    dtype, runs it as UnquantizedExperts would, and drops the dequantized copy. No weight is
    ever kept wider than 4 bits.

    load() kinds: "gate_up.blocks", "gate_up.scales", "down.blocks", "down.scales",
    "gate_up.bias", "down.bias"; per expert or stacked ([E] leading), like UnquantizedExperts.
    """

    def __init__(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        if parallel.world_size > 1:
            raise NotImplementedError(
                f"{spec.prefix}: MXFP4 experts do not support tensor parallelism yet "
                f"(parallel.tensor = {parallel.world_size}); run on one GPU"
            )
        e, h, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
        for what, cols in (("hidden size", h), ("intermediate size", inter)):
            if cols % BLOCK:
                raise ValueError(f"{spec.prefix}: {what} {cols} is not a multiple of {BLOCK}")
        self.spec = spec
        # [out rows, in columns] of each weight
        self.dims = {"gate_up": (2 * inter, h), "down": (h, inter)}
        for part, (rows, cols) in self.dims.items():
            blocks = torch.zeros(
                e, rows, cols // BLOCK, BLOCK // 2, dtype=torch.uint8, device=device
            )
            scales = torch.zeros(e, rows, cols // BLOCK, dtype=torch.uint8, device=device)
            self.register_buffer(f"{part}_blocks", blocks)
            self.register_buffer(f"{part}_scales", scales)
        self.gate_up_bias: torch.nn.Parameter | None = None
        self.down_bias: torch.nn.Parameter | None = None
        if spec.bias:
            for part, (rows, _) in self.dims.items():
                bias = torch.zeros(e, rows, dtype=dtype, device=device)
                setattr(self, f"{part}_bias", torch.nn.Parameter(bias, requires_grad=False))
        self._loaded: dict[str, set[int]] = {}

    def load(self, kind: str, tensor: torch.Tensor, expert: int | None = None) -> None:
        spec = self.spec
        part, _, what = kind.partition(".")
        if part not in self.dims or what not in ("blocks", "scales", "bias"):
            raise ValueError(f"{spec.prefix}: MXFP4 experts have no {kind!r} tensor")
        if what == "bias" and not spec.bias:
            raise ValueError(f"{spec.prefix}: the experts have no biases ({kind!r})")
        dest = getattr(self, f"{part}_{what}")
        experts, tensor = expert_rows(spec, kind, tensor, expert, tuple(dest.shape[1:]))
        if what != "bias" and tensor.dtype != torch.uint8:
            raise ValueError(f"{spec.prefix}: {kind} is {tensor.dtype}, expected torch.uint8")
        dest.data[experts.start : experts.stop].copy_(tensor)
        self._loaded.setdefault(kind, set()).update(experts)

    def finish_loading(self) -> None:
        whats = ("blocks", "scales", "bias") if self.spec.bias else ("blocks", "scales")
        for part in self.dims:
            for what in whats:
                done = self._loaded.get(f"{part}.{what}", set())
                lacking = [e for e in range(self.spec.num_experts) if e not in done]
                if lacking:
                    raise ValueError(
                        f"checkpoint lacks {self.spec.prefix}.{part}_proj_{what} "
                        f"(expert {lacking[0]}{' and more' if len(lacking) > 1 else ''})"
                    )

    def expert_weights(self) -> ExpertWeights:
        return ExpertWeights(
            "mxfp4",
            self.gate_up_blocks,
            self.down_blocks,
            self.gate_up_scales,
            self.down_scales,
            self.gate_up_bias,
            self.down_bias,
        )

    def weight(self, part: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's gate_up or down weight dequantized to [out, in] in `dtype`."""
        blocks = getattr(self, f"{part}_blocks")[e]
        return dequant_mxfp4(blocks, getattr(self, f"{part}_scales")[e], dtype)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        b13 = None if self.gate_up_bias is None else self.gate_up_bias[e]
        b2 = None if self.down_bias is None else self.down_bias[e]
        w13, w2 = self.weight("gate_up", e, x.dtype), self.weight("down", e, x.dtype)
        return expert_mlp(x, w13, b13, w2, b2, self.spec)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(x, topk_weights, topk_ids, self.spec.num_experts, self._expert)


class Mxfp4(QuantScheme):
    """Reads MXFP4 checkpoints (quant_method "mxfp4", gpt-oss): the MoE experts in MXFP4 unless
    modules_to_not_convert names them; every linear layer (attention, router, and the embedding
    and head, which are not linear layers here) unquantized, as transformers leaves them."""

    name = "mxfp4"
    checkpoint_methods = ("mxfp4",)

    def __init__(self, config: QuantConfig | None = None) -> None:
        super().__init__(config)
        self.not_convert: list[str] = list(
            self.config.checkpoint.get("modules_to_not_convert") or []
        )

    def experts(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> QuantExperts:
        if not should_convert(spec.prefix, self.not_convert):
            return UnquantizedExperts(spec, dtype, device, parallel)
        return Mxfp4Experts(spec, dtype, device, parallel)
