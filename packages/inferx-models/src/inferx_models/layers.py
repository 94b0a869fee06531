"""Building blocks of decoder models: RMSNorm, the rotary table, attention, vocab-parallel
embedding and head; math via ctx.ops."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inferx_core.interfaces.attention import SplitAttention
from inferx_core.interfaces.model import BuildContext
from inferx_core.interfaces.quant import (
    ActivationQuant,
    LinearSpec,
    ParallelStyle,
    QuantizedActivation,
    QuantLinear,
    input_quant,
)
from inferx_core.parallel import ParallelContext


def linear(
    ctx: BuildContext,
    prefix: str,
    in_features: int,
    output_sizes: list[int],
    bias: bool,
    parallel: ParallelStyle = "replicated",
    part_names: tuple[str, ...] = (),
    part_heads: tuple[int, ...] = (),
) -> QuantLinear:
    """The quant scheme's method for one linear layer (LinearSpec), built on ctx's device."""
    spec = LinearSpec(
        prefix, in_features, tuple(output_sizes), bias, parallel, part_names, part_heads
    )
    return ctx.quant.linear(spec, ctx.dtype, ctx.device, ctx.parallel)


def heads_per_rank(heads: int, kv_heads: int, parallel: ParallelContext) -> tuple[int, int]:
    """(query heads, KV heads) of this rank: both split evenly over the ranks, except that with
    fewer KV heads than ranks each KV head is replicated on world_size / kv_heads ranks (rank r
    keeps KV head r * kv_heads // world_size, the one its query heads read). A world size that
    does not fit them is a ValueError naming parallel.tensor."""
    n = parallel.world_size
    if heads % n:
        raise ValueError(f"parallel.tensor = {n} does not divide num_attention_heads ({heads})")
    if kv_heads >= n and kv_heads % n:
        raise ValueError(f"parallel.tensor = {n} does not divide num_key_value_heads ({kv_heads})")
    if kv_heads < n and n % kv_heads:
        raise ValueError(
            f"parallel.tensor = {n} is not a multiple of num_key_value_heads ({kv_heads})"
        )
    return heads // n, max(kv_heads // n, 1)


def reduce_parts(parallel: ParallelContext, parts: torch.Tensor) -> torch.Tensor:
    """A row-parallel layer's output as partial results [S, ...] (QuantLinear.forward_parts)
    summed over the ranks: each rank's parts added up (in float32, as the norm would), then
    all-reduced, as one part. Callers skip it at world size 1."""
    x = parts[0] if parts.shape[0] == 1 else parts.float().sum(0).to(parts.dtype)
    return parallel.all_reduce(x.contiguous()).unsqueeze(0)


def _tp(ctx: BuildContext) -> ParallelContext | None:
    """ctx.parallel where there is more than one rank, else None: the hot path tests for None
    and calls no collective at world size 1."""
    return ctx.parallel if ctx.parallel.world_size > 1 else None


class VocabShard(nn.Module):
    """A [vocab, hidden] table split by rows over the ranks: each holds ceil(vocab / world size)
    rows from rank * that, the last rank's padded with zero rows where the world size does not
    divide the vocabulary (the padding never reaches the caller)."""

    def __init__(
        self, vocab: int, hidden: int, ctx: BuildContext, weight: nn.Parameter | None = None
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.rows = -(-vocab // ctx.parallel.world_size)
        self.start = ctx.parallel.rank * self.rows
        if weight is None:
            # Left uninitialised (the checkpoint fills it). Not nn.Embedding: its init on the
            # meta device imports torch._dynamo, over a second of every start-up.
            weight = torch.empty(self.rows, hidden, dtype=ctx.dtype, device=ctx.device)
            weight = nn.Parameter(weight, requires_grad=False)
        self.weight = weight

    def load(self, kind: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of the whole checkpoint table."""
        whole = (self.vocab, self.weight.shape[1])
        if kind != "weight" or tuple(tensor.shape) != whole:
            raise ValueError(f"{kind} of shape {tuple(tensor.shape)}, expected weight {whole}")
        mine = tensor[self.start : self.start + self.rows]
        self.weight.data[: mine.shape[0]].copy_(mine)
        self.weight.data[mine.shape[0] :].zero_()


class VocabEmbedding(VocabShard):
    """Input embeddings, vocab-parallel: each rank looks up the ids in its rows, zeroes the
    others, and the all-reduce adds the ranks' rows (one holds each id)."""

    def __init__(self, vocab: int, hidden: int, ctx: BuildContext) -> None:
        super().__init__(vocab, hidden, ctx)
        self.ops = ctx.ops
        self.tp = _tp(ctx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.ops.embedding(self.weight, ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = self.ops.embedding(self.weight, torch.where(inside, local, 0))
        out = out.masked_fill(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelHead(VocabShard):
    """The vocabulary projection, vocab-parallel: each rank computes the logits of its rows and
    the all-gather concatenates them. `weight`: the embedding's, for tied embeddings."""

    def __init__(
        self, vocab: int, hidden: int, ctx: BuildContext, weight: nn.Parameter | None = None
    ) -> None:
        super().__init__(vocab, hidden, ctx, weight)
        self.tp = _tp(ctx)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp is None:
            return logits
        logits = self.tp.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.vocab else logits[..., : self.vocab].contiguous()


# A norm's output: plain rows, or quantized for the layer it feeds.
Normed = torch.Tensor | QuantizedActivation


class RMSNorm(nn.Module):
    """Holds the weight and eps; the arithmetic is ctx.ops.rms_norm, which with a residual also
    adds it first and returns the sum as the next residual. With `quant` (the input_quant of
    the layer it feeds) the normed rows come quantized for it (ctx.ops.rms_norm_quant)."""

    def __init__(self, size: int, eps: float, ctx: BuildContext) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=ctx.dtype, device=ctx.device))
        self.ops = ctx.ops

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        parts: bool = False,
        quant: ActivationQuant | None = None,
    ) -> Normed | tuple[Normed, torch.Tensor]:
        if quant is not None:
            return self.ops.rms_norm_quant(x, self.weight, self.eps, quant, residual, parts)
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
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 keeps it there)
    if (
        params["rope_type"] in ("llama3", "yarn")
        and "original_max_position_embeddings" in hf_config
    ):
        params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    head_dim: int, max_positions: int, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss, DeepSeek): (inverse frequencies, attention scaling of cos and sin).

    Dimensions that turn more than beta_fast times over the original context keep their
    frequency, those turning fewer than beta_slow times are slowed by `factor`, and a linear ramp
    over the dimension index blends the band between. `truncate` (default true) widens that band
    to whole dimensions. The float32 arithmetic follows transformers' _compute_yarn_parameters
    step for step, so that the tables agree to the last bit at long positions.
    """
    base = params["rope_theta"]
    original = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor") or max_positions / original

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if params.get("mscale") and params.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, params["mscale"]) / yarn_mscale(
                factor, params["mscale_all_dim"]
            )
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength fits `rotations` times into the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero

    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its original frequency
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """The cos/sin table for rotating q and k by position (the "rotate half" layout of Llama and
    Qwen2) with ctx.ops.rotary.

    cos and sin are tabulated in float32 for every position up to max_positions once, so each
    layer does a lookup rather than trigonometry. YaRN's attention scaling is folded into the
    table (cos and sin both scaled), as transformers does.
    """

    def __init__(
        self, head_dim: int, max_positions: int, params: dict[str, Any], device: torch.device
    ) -> None:
        super().__init__()
        scaling = 1.0
        kind = params["rope_type"]
        if kind == "yarn":
            inv_freq, scaling = _yarn_inv_freq(head_dim, max_positions, params)
        else:
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif kind not in ("default", "yarn"):
            raise NotImplementedError(
                f"rope_type {kind!r} is not supported (default, llama3, yarn)"
            )
        angles = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        table = torch.cat([angles.cos() * scaling, angles.sin() * scaling], dim=-1)
        self.register_buffer("cos_sin", table.to(device), persistent=False)


class Attention(nn.Module):
    """Self-attention of one layer: fused QKV projection, rotary positions, the backend's paged
    attention (which owns the cache), output projection. With `qk_norm_eps` (Qwen3) each q and
    k head is RMS-normed over head_dim before the rotary (weights `q_norm`, `k_norm`); with
    `sinks` (gpt-oss) each query head has a learned sink logit (`sinks`, this rank's heads)."""

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
        qk_norm_eps: float | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        prefix = prefix or f"model.layers.{layer}.self_attn"
        self.layer = layer
        # this rank's heads; the projections are declared whole and shard themselves
        self.num_heads, self.num_kv_heads = heads_per_rank(num_heads, num_kv_heads, ctx.parallel)
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.qkv_proj = linear(
            ctx,
            f"{prefix}.qkv_proj",
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            qkv_bias,
            "column",
            ("q_proj", "k_proj", "v_proj"),
            (num_heads, num_kv_heads, num_kv_heads),
        )
        self.o_proj = linear(
            ctx, f"{prefix}.o_proj", num_heads * head_dim, [hidden_size], o_bias, "row"
        )
        # what the QKV GEMM takes pre-quantized from the norm before it (FP8 W8A8), or None
        self.input_quant = input_quant(self.qkv_proj)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, ctx)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, ctx)
        self.tp = _tp(ctx)
        self.rotary = rotary
        self.backend = ctx.attention
        # gpt-oss: a learned logit per query head (this rank's) joins the softmax; float32, as
        # the backends take it
        self.sinks: nn.Parameter | None = None
        if sinks:
            zeros = torch.zeros(self.num_heads, dtype=torch.float32, device=ctx.device)
            self.sinks = nn.Parameter(zeros, requires_grad=False)
        # An fp8 KV cache stores k / k_scale and v / v_scale: the checkpoint's scales where it
        # has them (self_attn.k_scale / v_scale), else 1.0 (ModelArch loaders fill them).
        self.k_scale: nn.Parameter | None = None
        self.v_scale: nn.Parameter | None = None
        if ctx.attention.layers[layer].dtype == "fp8_e4m3":
            one = torch.ones(1, dtype=torch.float32, device=ctx.device)
            self.k_scale = nn.Parameter(one.clone(), requires_grad=False)
            self.v_scale = nn.Parameter(one.clone(), requires_grad=False)
        self.attn = ctx.attention.layer(
            layer, head_dim**-0.5, sinks=self.sinks, k_scale=self.k_scale, v_scale=self.v_scale
        )
        self.ops = ctx.ops

    def _takes_parts(self) -> bool:
        # A backend may take the QKV GEMM's K-split partial results and add them up (and the
        # bias) itself, where the thinner GEMMs read the weight faster (decode steps). A q/k
        # norm needs the whole q and k, so it takes the summed product.
        return self.q_norm is None and self.backend.fuses_rotary and self.backend.takes_qkv_parts()

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | QuantizedActivation, parts: bool = False
    ) -> torch.Tensor:
        """The layer's output, or with `parts` its partial results (QuantLinear.forward_parts)
        for a norm that adds them up. x: the normed hidden rows, quantized where the QKV GEMM
        takes them so (input_quant)."""
        if self._takes_parts():
            qkv, bias = self.ops.linear_split(self.qkv_proj, x)  # [S, T, q + 2 kv], bias apart
            return self._attend(positions, qkv, bias, parts)
        return self._attend(positions, self.qkv_proj(x)[None], None, parts)

    def forward_normed(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x, residual, parts=True), parts=True) and the norm's new residual: x
        is the partial results of the sublayer before. Where the backend takes QKV parts, the
        norm and the QKV GEMM are one ops call (ops.rms_norm_linear_split). The norm quantizes
        its output where the QKV GEMM takes it so (input_quant)."""
        if self._takes_parts():
            qkv, bias, residual = self.ops.rms_norm_linear_split(
                x, norm.weight, norm.eps, residual, self.qkv_proj
            )
            return self._attend(positions, qkv, bias, True), residual
        h, residual = norm(x, residual, parts=True, quant=self.input_quant)
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
        if self.q_norm is not None and self.k_norm is not None:  # never parted (_takes_parts)
            q, k = self.q_norm(q), self.k_norm(k)  # before the rotary, fused or not
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
                y = self.ops.linear_parts(self.o_proj, out)
                return y if self.tp is None else reduce_parts(self.tp, y)
        else:
            q, k = self.ops.rotary(positions, q, k, self.rotary.cos_sin)
            out = self.backend.forward(self.attn, q, k, v)
        out = out.reshape(-1, self.q_size)
        # o_proj is row-parallel: over several ranks each holds a partial sum
        if parts:
            y = self.ops.linear_parts(self.o_proj, out)
            return y if self.tp is None else reduce_parts(self.tp, y)
        y = self.o_proj(out)
        return y if self.tp is None else self.tp.all_reduce(y)


def kv_scale_target(name: str) -> tuple[str, str] | None:
    """(attention module path, "k_scale" or "v_scale") for a checkpoint's FP8 KV scale tensor:
    `...self_attn.k_scale` / `v_scale`, or the older `...self_attn.k_proj.output_scale` /
    `v_proj.output_scale`; None for any other tensor."""
    path, _, leaf = name.rpartition(".")
    if leaf in ("k_scale", "v_scale") and path.endswith("self_attn"):
        return path, leaf
    if leaf == "output_scale" and path.endswith(("self_attn.k_proj", "self_attn.v_proj")):
        parent, _, proj = path.rpartition(".")
        return parent, f"{proj[0]}_scale"
    return None
