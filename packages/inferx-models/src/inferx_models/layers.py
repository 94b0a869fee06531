"""Building blocks of decoder models: RMSNorm, the rotary table, attention; math via ctx.ops."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from inferx_core.interfaces.attention import SplitAttention
from inferx_core.interfaces.model import BuildContext
from inferx_core.interfaces.quant import LinearSpec, ParallelStyle, QuantLinear


def linear(
    ctx: BuildContext,
    prefix: str,
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    parallel: ParallelStyle = "replicated",
    part_names: tuple[str, ...] = (),
) -> QuantLinear:
    """The quant scheme's method for one linear layer (LinearSpec), built on ctx's device."""
    spec = LinearSpec(prefix, in_features, tuple(output_sizes), bias, parallel, part_names)
    return ctx.quant.linear(spec, ctx.dtype, ctx.device, ctx.parallel)


class RMSNorm(nn.Module):
    """Holds the weight and eps; the arithmetic is ctx.ops.rms_norm, which with a residual also
    adds it first and returns the sum as the next residual."""

    def __init__(self, size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device))
        self.ops = ctx.ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, parts: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual, parts)


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings of a config, with rope_type and rope_theta always present.

    transformers 5 writes them as `rope_parameters` (theta inside); configs written before that,
    including most published checkpoints, have `rope_theta` beside a `rope_scaling` dict whose
    kind is under "rope_type" or the older "type".
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context rescaling: wavelengths longer than the original context are
    slowed by `factor`, shorter than original/high_freq_factor kept, and the band between
    blended linearly in original/wavelength."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    blend = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


class RotaryEmbedding(nn.Module):
    """The cos/sin table for rotating q and k by position (the "rotate half" layout of Llama and
    Qwen2) with ctx.ops.rotary.

    cos and sin are tabulated in float32 for every position up to max_positions once, so each
    layer does a lookup rather than trigonometry.
    """

    def __init__(
        self, head_dim: int, max_positions: int, params: dict[str, Any], device: torch.device
    ) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        kind = params["rope_type"]
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif kind != "default":
            raise NotImplementedError(f"rope_type {kind!r} is not supported (default, llama3)")
        angles = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        table = torch.cat([angles.cos(), angles.sin()], dim=-1)
        self.register_buffer("cos_sin", table.to(device), persistent=False)


class Attention(nn.Module):
    """Self-attention of one layer: fused QKV projection, rotary positions, the backend's paged
    attention (which owns the cache), output projection."""

    def __init__(
        self,
        layer: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        ctx: BuildContext,
        qkv_bias: bool = False,
        o_bias: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{layer}.self_attn"
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = linear(
            ctx,
            f"{prefix}.qkv_proj",
            hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            qkv_bias,
            "column",
            ("q_proj", "k_proj", "v_proj"),
        )
        self.o_proj = linear(ctx, f"{prefix}.o_proj", self.q_size, [hidden_size], o_bias, "row")
        self.rotary = rotary
        self.backend = ctx.attention
        self.attn = ctx.attention.layer(layer, head_dim**-0.5)
        self.ops = ctx.ops

    def _takes_parts(self) -> bool:
        # A backend may take the QKV GEMM's K-split partial results and add them up (and the
        # bias) itself, where the thinner GEMMs read the weight faster (decode steps).
        return self.backend.fuses_rotary and self.backend.takes_qkv_parts()

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, parts: bool = False
    ) -> torch.Tensor:
        """The layer's output, or with `parts` its partial results (QuantLinear.forward_parts)
        for a norm that adds them up."""
        if self._takes_parts():
            qkv, bias = self.ops.linear_split(self.qkv_proj, x)  # [S, T, q + 2 kv], bias apart
            return self._attend(positions, qkv, bias, parts)
        return self._attend(positions, self.qkv_proj(x)[None], None, parts)

    def forward_normed(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x, residual, parts=True), parts=True) and the norm's new residual: x
        is the partial results of the sublayer before. Where the backend takes QKV parts, the
        norm and the QKV GEMM are one ops call (ops.rms_norm_linear_split)."""
        if self._takes_parts():
            qkv, bias, residual = self.ops.rms_norm_linear_split(
                x, norm.weight, norm.eps, residual, self.qkv_proj
            )
            return self._attend(positions, qkv, bias, True), residual
        h, residual = norm(x, residual, parts=True)
        return self.forward(positions, h, parts=True), residual

    def _attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor | None, parts: bool
    ) -> torch.Tensor:
        """Attention from QKV as [S, T, q + 2 kv] K-slice parts (S = 1: the whole product) and
        the bias they lack, through o_proj."""
        parted = not (qkv.shape[0] == 1 and bias is None)
        if not parted:
            qkv = qkv[0]
        sizes = [self.q_size, self.kv_size, self.kv_size]
        q, k, v = qkv.split(sizes, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.backend.fuses_rotary:
            # bias= only with parts, keep_splits= only where the backend keeps splits: a
            # backend that never takes them need not know the keywords
            extra = {"bias": None if bias is None else tuple(bias.split(sizes))} if parted else {}
            if parts and self.backend.keeps_splits:
                extra["keep_splits"] = True
            out = self.backend.forward_with_rotary(
                self.attn, q, k, v, positions, self.rotary.cos_sin, **extra
            )
            if isinstance(out, SplitAttention):  # o_proj combines the context splits
                return self.ops.linear_parts(self.o_proj, out)
        else:
            q, k = self.ops.rotary(positions, q, k, self.rotary.cos_sin)
            out = self.backend.forward(self.attn, q, k, v)
        out = out.reshape(-1, self.q_size)
        return self.ops.linear_parts(self.o_proj, out) if parts else self.o_proj(out)
