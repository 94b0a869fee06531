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


def group_shard(groups: int, parallel: ParallelContext) -> tuple[int, int, int]:
    """(first group, groups kept, groups held) of this rank's share of `groups` MXFP4 scale
    groups: whole groups, as evenly as they go (rank r keeps [r * G // N, (r + 1) * G // N)),
    held in ceil(G / N) groups so every rank's tensors have one shape (the rest zeros)."""
    n, r = parallel.world_size, parallel.rank
    start, stop = r * groups // n, (r + 1) * groups // n
    return start, stop - start, -(-groups // n)


class Mxfp4Experts(QuantExperts):
    """A MoE layer's experts as MXFP4: gate_up blocks [E, 2n, H / 32, 16] and scales
    [E, 2n, H / 32] (gate and up rows in the activation's layout), down blocks [E, H, n / 32, 16]
    and scales [E, H, n / 32], all uint8 as the checkpoint stores them; biases [E, 2n] / [E, H]
    in the serving dtype (the down bias on rank 0 only).

    n is this rank's share of the intermediate size I. Tensor parallel ranks split every
    expert's intermediate dimension, as UnquantizedExperts do, but in whole 32-wide scale groups
    (a group's one scale cannot be split without requantizing): rank r keeps groups
    [r * G // N, (r + 1) * G // N) of the G = I / 32, and holds ceil(G / N) groups, the last
    zero where it keeps fewer. Zero gate and up rows with zero biases give a zero activation
    (silu(0) * 0, and swiglu_oai's 0 * sigmoid(0) * (0 + 1)), and zero down columns add
    nothing, so the padding changes no output.

    The torch reference: forward dequantizes each expert that has tokens to the activations'
    dtype, runs it as UnquantizedExperts would, and drops the dequantized copy. No weight is
    ever kept wider than 4 bits.

    load() kinds: "gate_up.blocks", "gate_up.scales", "down.blocks", "down.scales",
    "gate_up.bias", "down.bias"; per expert or stacked ([E] leading), like UnquantizedExperts;
    whole checkpoint tensors, of which each rank keeps its share.
    """

    def __init__(
        self,
        spec: ExpertsSpec,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext = SINGLE,
    ) -> None:
        super().__init__()
        e, h, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
        for what, cols in (("hidden size", h), ("intermediate size", inter)):
            if cols % BLOCK:
                raise ValueError(f"{spec.prefix}: {what} {cols} is not a multiple of {BLOCK}")
        self.spec = spec
        self.rank = parallel.rank
        first, kept, held = group_shard(inter // BLOCK, parallel)
        self.start, self.kept, self.n = first * BLOCK, kept * BLOCK, held * BLOCK
        n = self.n
        # [out rows, in columns] of each weight: the checkpoint's, and this rank's
        self.whole = {"gate_up": (2 * inter, h), "down": (h, inter)}
        self.dims = {"gate_up": (2 * n, h), "down": (h, n)}
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
                if part == "down" and parallel.rank != 0:
                    continue  # the ranks' partial sums are all-reduced: rank 0 adds it once
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
        rows, cols = self.whole[part]
        shape = {
            "blocks": (rows, cols // BLOCK, BLOCK // 2),
            "scales": (rows, cols // BLOCK),
            "bias": (rows,),
        }[what]
        experts, tensor = expert_rows(spec, kind, tensor, expert, shape)
        if what != "bias" and tensor.dtype != torch.uint8:
            raise ValueError(f"{spec.prefix}: {kind} is {tensor.dtype}, expected torch.uint8")
        self._loaded.setdefault(kind, set()).update(experts)
        dest = getattr(self, f"{part}_{what}")
        if dest is None:  # the down bias on a rank other than 0
            return
        dest = dest.data[experts.start : experts.stop]
        start, kept, n = self.start, self.kept, self.n
        if part == "down":
            if what != "bias":  # this rank's scale groups of the intermediate columns
                g0, g = start // BLOCK, kept // BLOCK
                dest[:, :, :g].copy_(tensor[:, :, g0 : g0 + g])
            else:
                dest.copy_(tensor)
        elif spec.activation == "silu":  # gate rows, then up rows
            inter = spec.intermediate_size
            dest[:, :kept].copy_(tensor[:, start : start + kept])
            dest[:, n : n + kept].copy_(tensor[:, inter + start : inter + start + kept])
        else:  # interleaved: gate j and up j are rows 2j and 2j + 1
            dest[:, : 2 * kept].copy_(tensor[:, 2 * start : 2 * (start + kept)])

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
