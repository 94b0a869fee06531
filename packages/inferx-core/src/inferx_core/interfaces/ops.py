"""The kernel-ops contract: the small fused operations models run between their GEMMs."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from inferx_core.interfaces.attention import SplitAttention
from inferx_core.interfaces.moe import QuantExperts, RouterSpec
from inferx_core.interfaces.quant import (
    ActivationQuant,
    QuantizedActivation,
    QuantLinear,
    input_quant,
)


class KernelOps(ABC):
    """Chosen by name ([engine] kernels); models call these through ctx.ops, never torch directly,
    so a kernel package can fuse them. "torch" (inferx_core.ops_torch) is the reference."""

    # Whether models build MoE layers' shared experts as always-on slots of the routed experts
    # (ExpertsSpec.shared: routed and shared in one pair of grouped GEMMs, route_experts
    # appending the fixed slots) rather than a separate MLP added after. Off by default: a
    # kernel package turns it on where its moe_experts runs the slots in the same launches
    # (the torch reference would only loop over two more experts).
    fuse_shared_experts: bool = False

    @abstractmethod
    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        parts: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over the last dim, normalised in float32, cast back, scaled by weight.

        With `residual`: first x = x + residual (in x's dtype); returns (normed, x) so the sum is
        the next layer's residual (Hugging Face's order of operations, fused). With `parts`
        (needs `residual`): x is [S, *residual.shape], partial results of the GEMM before
        (QuantLinear.forward_parts), first summed in float32 and cast to x's dtype once."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[..., 2I] holding gate then up -> silu(gate) * up, [..., I]."""

    def rms_norm_quant(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        quant: ActivationQuant,
        residual: torch.Tensor | None = None,
        parts: bool = False,
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        """rms_norm, its output (rounded to its dtype as rms_norm's) quantized for the layer
        that takes it (quant: that layer's input_quant): quant.quantize(rms_norm(...)), which a
        kernel package may do in the norm's own kernel. Returns what rms_norm does, with the
        normed rows as a QuantizedActivation."""
        out = self.rms_norm(x, weight, eps, residual, parts)
        if isinstance(out, tuple):
            return quant.quantize(out[0]), out[1]
        return quant.quantize(out)

    def silu_and_mul_quant(self, x: torch.Tensor, quant: ActivationQuant) -> QuantizedActivation:
        """silu_and_mul(x) quantized for the layer after it (its input_quant); fusable as
        rms_norm_quant."""
        return quant.quantize(self.silu_and_mul(x))

    def norm_for(
        self,
        linear: torch.nn.Module,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
        parts: bool = False,
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor | None]:
        """(the normed rows as `linear` takes them, the new residual or None): rms_norm_quant
        where the layer takes pre-quantized input (QuantLinear.input_quant), else rms_norm."""
        quant = input_quant(linear)
        if quant is not None:
            out = self.rms_norm_quant(x, weight, eps, quant, residual, parts)
        else:
            out = self.rms_norm(x, weight, eps, residual, parts)
        return out if isinstance(out, tuple) else (out, None)

    def linear_silu_and_mul(
        self, linear: torch.nn.Module, x: torch.Tensor, quant: ActivationQuant | None = None
    ) -> torch.Tensor | QuantizedActivation:
        """silu_and_mul(linear(x)) for a fused gate_up layer; a kernel package may run the two
        as one (the activation in the GEMM's epilogue) where it knows the layer's weights.
        With `quant` (the next layer's input_quant) the activation comes quantized to it;
        without, a method that fuses the two itself (QuantLinear.forward_silu_and_mul) runs
        them."""
        if quant is not None:
            return self.silu_and_mul_quant(linear(x), quant)
        fused = linear.forward_silu_and_mul(x) if isinstance(linear, QuantLinear) else None
        return fused if fused is not None else self.silu_and_mul(linear(x))

    def linear_parts(
        self, linear: torch.nn.Module, x: torch.Tensor | QuantizedActivation | SplitAttention
    ) -> torch.Tensor:
        """linear.forward_parts(x) (QuantLinear): the layer's output as partial results for a
        norm that sums them; a kernel package may run the GEMM itself where it knows the
        layer's weights. x may be an attention output still split along the context
        (SplitAttention, for o_proj): combined first here, or inside the GEMM by a kernel
        package."""
        if isinstance(x, SplitAttention):
            x = x.reduce().flatten(1)
        return linear.forward_parts(x)

    def linear_split(
        self, linear: torch.nn.Module, x: torch.Tensor | QuantizedActivation
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """linear.forward_split(x): (parts, bias) for a consumer that sums them (the QKV GEMM
        of a decode step, summed by the attention backend); overridable as linear_parts."""
        return linear.forward_split(x)

    def rms_norm_linear_split(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor,
        linear: torch.nn.Module,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """rms_norm(x, weight, eps, residual, parts=True), then linear_split of the normed rows:
        (parts, bias, the new residual). A kernel package may run the norm inside the GEMM. A
        layer that takes pre-quantized input gets it from rms_norm_quant (norm_for)."""
        h, new_residual = self.norm_for(linear, x, weight, eps, residual, parts=True)
        assert new_residual is not None
        return (*self.linear_split(linear, h), new_residual)

    def rms_norm_linear_silu_and_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor,
        linear: torch.nn.Module,
        quant: ActivationQuant | None = None,
    ) -> tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        """rms_norm(x, weight, eps, residual, parts=True), then linear_silu_and_mul of the normed
        rows: (activation, the new residual); fusable as rms_norm_linear_split. The norm's
        output comes quantized where gate_up takes it so (norm_for), the activation where
        `quant` (down_proj's input_quant) is given."""
        h, new_residual = self.norm_for(linear, x, weight, eps, residual, parts=True)
        assert new_residual is not None
        return self.linear_silu_and_mul(linear, h, quant), new_residual

    def embedding(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The rows of weight [vocab, hidden] at token ids: a model's input embeddings."""
        return torch.nn.functional.embedding(ids, weight)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x.argmax(1) of [rows, vocab] logits (int64 [rows]): greedy sampling's token per row,
        the first index among equal maxima. A kernel package may reduce a row in more programs
        than torch's one block of threads a row."""
        return x.argmax(dim=1)

    def route_experts(
        self, logits: torch.Tensor, spec: RouterSpec, selection_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A MoE router's logits [T, E], or [S, T, E] partial logits (linear_parts') to sum
        first -> (topk_weights [T, k + s] float32, topk_ids [T, k + s]): inferx_core.moe.route,
        the top k picks then spec.shared fixed (1.0, E + i) pairs, which a kernel package may
        fuse (the parts' sum, softmax, top-k, renormalize, the fixed pairs)."""
        from inferx_core.moe import route

        if logits.dim() == 3:
            logits = logits[0] if logits.shape[0] == 1 else logits.float().sum(0)
        return route(logits, spec, selection_bias)

    def moe_experts(
        self,
        experts: QuantExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """experts(x, topk_weights, topk_ids): a MoE layer's routed experts. A kernel package
        may run them as grouped GEMMs where experts.expert_weights() hands out the tensors; a
        method without them runs its own forward."""
        return experts(x, topk_weights, topk_ids)

    def moe_experts_parts(
        self,
        experts: QuantExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """moe_experts as partial results [S, T, H] for the norm after the layer, which sums
        them (rms_norm's parts: float32, in order, rounded once). A kernel package may hand
        over each token's weighted expert outputs unsummed, so the norm's sum replaces the
        layer's own; by default the sum as one part."""
        return self.moe_experts(experts, x, topk_weights, topk_ids).unsqueeze(0)

    def mla_rope_norm(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-head latent attention's work between its projections and attention: q's rope
        parts and the shared rope key rotated, the latent normed.

        q: [T, heads, nope + rope], each head's nope part then its rope part; kv: [T, rank +
        rope], the latent then the rope key (either may be a strided view of a GEMM's output,
        its last dim contiguous). Or both as S partial sums of one GEMM (linear_split's K-slice
        parts), q [S, T, heads, nope + rope] and kv [S, T, rank + rope]: summed first, in
        float32 and rounded once to their dtype. norm_weight: [rank], the latent's RMSNorm
        weight (eps); cos_sin: [max_positions, rope] float32, cos then sin (RotaryEmbedding's
        table), looked up at positions [T]. Returns (q rotated, [T, heads, nope + rope]
        contiguous; k, [T, 1, rank + rope]: rms_norm(latent) then the rotated rope key). The
        rotation pairs dimensions (2i, 2i + 1) as DeepSeek does (rotate_interleaved: float32,
        rounded once to the dtype); the norm is this KernelOps' rms_norm. A kernel package may
        run it all as one launch."""
        from inferx_core.ops_torch import rotate_interleaved

        nope, rank = check_mla_rope_norm(q, kv, norm_weight, cos_sin)
        if q.dim() == 4:
            q, kv = summed_parts(q), summed_parts(kv)
        rows = cos_sin[positions]
        q_pe = rotate_interleaved(q[..., nope:], rows)
        k_pe = rotate_interleaved(kv[:, None, rank:], rows)
        normed = self.rms_norm(kv[:, :rank], norm_weight, eps)
        assert isinstance(normed, torch.Tensor)
        q = torch.cat([q[..., :nope], q_pe], dim=-1)
        return q, torch.cat([normed[:, None], k_pe], dim=-1)

    @abstractmethod
    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] by position (the "rotate half" layout); returns
        the rotated pair. An implementation may rotate in place: pass tensors the caller owns.

        cos_sin: [max_positions, D] float32, cos in the first D/2 columns and sin in the rest."""


def check_parts(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    """rms_norm(parts=True)'s input check, shared by every KernelOps: x is [S, *residual.shape]."""
    if residual is None or x.shape[1:] != residual.shape:
        raise ValueError(
            f"rms_norm: parts of shape {tuple(x.shape)} need a residual of shape "
            f"{tuple(x.shape[1:])}"
        )


def check_mla_rope_norm(
    q: torch.Tensor, kv: torch.Tensor, norm_weight: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[int, int]:
    """mla_rope_norm's input check, shared by every KernelOps; returns (nope, rank)."""
    rope, rank = cos_sin.shape[-1], norm_weight.shape[0]
    nope = q.shape[-1] - rope
    parts = q.dim() == 4  # S partial sums of each
    if (
        q.dim() not in (3, 4)
        or kv.dim() != q.dim() - 1
        or norm_weight.dim() != 1
        or cos_sin.dim() != 2
        or rope % 2
        or nope < 0
        or kv.shape != (*q.shape[: 2 if parts else 1], rank + rope)
    ):
        raise ValueError(
            f"mla_rope_norm: q {tuple(q.shape)}, kv {tuple(kv.shape)}, norm weight "
            f"{tuple(norm_weight.shape)} and cos_sin {tuple(cos_sin.shape)} do not fit q [T, "
            "heads, nope + rope], kv [T, rank + rope] (or [S, T, ...] parts of both), weight "
            "[rank], cos_sin [positions, rope] with rope even"
        )
    return nope, rank


def summed_parts(parts: torch.Tensor) -> torch.Tensor:
    """[S, ...] partial sums -> their sum in float32, rounded once to their dtype."""
    if parts.shape[0] == 1:
        return parts[0]
    return parts.float().sum(0).to(parts.dtype)
