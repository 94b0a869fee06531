"""DeepSeek-V2 and V2-Lite: multi-head latent attention (MLA: the KV cache holds one compressed
latent and one shared rope key a token) and fine-grained MoE (routed experts, greedy or
group-limited, plus shared experts) after first_k_dense_replace dense layers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from inferx_core.interfaces.attention import MLAWeights
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_core.interfaces.model import BuildContext
from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts, RouterSpec
from inferx_core.moe import FusedMoE
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_models.layers import (
    RMSNorm,
    RotaryEmbedding,
    heads_per_rank,
    linear,
    reduce_parts,
    rope_parameters,
    yarn_mscale,
)
from inferx_models.llama import FUSED, MLP
from inferx_models.qwen3 import Qwen3MoeForCausalLM, SparseMoeBlock

# q_a_layernorm and kv_a_layernorm use RMSNorm's default eps, not rms_norm_eps (DeepSeek's
# code and transformers' port alike).
LATENT_EPS = 1e-6


def with_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config checked for what this model implements, with head_dim set to the rope width
    (the shared decoder tabulates the rotary for head_dim) and one KV head per query head."""
    cfg = dict(hf_config)
    arch = "DeepseekV2ForCausalLM"
    refused = {
        "attention_bias": (bool(cfg.get("attention_bias")), "true"),
        "scoring_func": (cfg.get("scoring_func", "softmax") != "softmax", "other than softmax"),
        "topk_method": (
            cfg.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"),
            "other than greedy or group_limited_greedy",
        ),
        "rope_interleave": (cfg.get("rope_interleave", True) is False, "false"),
        "hidden_act": (cfg.get("hidden_act", "silu") != "silu", "other than silu"),
    }
    for key, (bad, what) in refused.items():
        if bad:
            raise NotImplementedError(
                f"{arch}: {key} = {cfg[key]!r} is not supported ({key} {what})"
            )
    cfg["head_dim"] = cfg["qk_rope_head_dim"]
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def is_moe_layer(hf_config: dict[str, Any], layer: int) -> bool:
    """DeepSeek's rule: routed experts from layer first_k_dense_replace on, every
    moe_layer_freq-th layer."""
    return (
        bool(hf_config.get("n_routed_experts"))
        and layer >= hf_config.get("first_k_dense_replace", 0)
        and layer % hf_config.get("moe_layer_freq", 1) == 0
    )


def router_spec(hf_config: dict[str, Any]) -> RouterSpec:
    """Softmax over the routed experts, then the top num_experts_per_tok (among the best
    topk_group of n_group groups, each scored by its best expert, for group_limited_greedy).
    As DeepSeek-V2's own code: with norm_topk_prob (and k > 1) the picked weights are
    renormalized and routed_scaling_factor is not applied, otherwise they are scaled by it.
    (transformers' port ignores norm_topk_prob; the published configs all set it false.)"""
    n, k = hf_config["n_routed_experts"], hf_config["num_experts_per_tok"]
    groups = topk_groups = 1
    if hf_config.get("topk_method", "greedy") == "group_limited_greedy":
        groups, topk_groups = hf_config["n_group"], hf_config["topk_group"]
    renormalize = bool(hf_config.get("norm_topk_prob")) and k > 1
    scaling = 1.0 if renormalize else float(hf_config.get("routed_scaling_factor", 1.0))
    return RouterSpec(
        n,
        k,
        renormalize=renormalize,
        num_groups=groups,
        topk_groups=topk_groups,
        group_score="max",
        scaling=scaling,
    )


def softmax_scale(hf_config: dict[str, Any]) -> float:
    """1/sqrt(qk_nope + qk_rope), times YaRN's mscale(factor, mscale_all_dim) squared when the
    rope is scaled and names mscale_all_dim (the rotary's own attention factor scales only the
    rope dimensions)."""
    scale = (hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"]) ** -0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


def fuses_shared_experts(hf_config: dict[str, Any], ctx: BuildContext) -> bool:
    """Whether a MoE layer holds its shared experts as always-on slots of the routed experts
    (ExpertsSpec.shared: experts n_routed_experts + i, i < n_shared_experts, each of
    moe_intermediate_size) instead of a SharedExperts MLP: where the kernel ops ask for it
    (KernelOps.fuse_shared_experts), the layer has shared experts, they use SiLU (elementwise
    over the intermediate dimension, so the MLP of n_shared_experts * moe_intermediate_size
    is that many experts of moe_intermediate_size, a whole multiple by DeepSeek's definition)
    and the weights are unquantized (the "none" scheme). A quantized checkpoint keeps the
    shared MLP apart: its scales cover the MLP's whole projections (per tensor, per row of
    2 * I columns, 128 x 128 blocks) and its scheme may quantize the MLP otherwise than the
    experts (a W8A8 linear layer beside weight-only FP8 experts), so splitting it into expert
    slots would change its numerics or need each format's scale slicing."""
    return (
        ctx.ops.fuse_shared_experts
        and bool(hf_config.get("n_shared_experts"))
        and hf_config.get("hidden_act", "silu") == "silu"
        and ctx.quant.name == "none"
    )


class SharedExperts(MLP):
    """A MoE layer's shared experts: one SiLU MLP of n_shared_experts * moe_intermediate_size
    that every token takes, x -> [T, H] (FusedMoE adds it to the routed experts' output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.linear_silu_and_mul(self.gate_up_proj, x))


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer.

    One GEMM from the hidden state (qkv_a_proj) gives the query (q_proj; with q LoRA the
    low-rank q_a_proj, normed and expanded by q_b_proj) and kv_a_proj_with_mqa's latent
    (kv_lora_rank, then normed) and shared rope key (qk_rope_head_dim). q's rope part and the
    rope key are rotated (interleaved pairs); the backend stores latent + rope key, and
    expands the latent through kv_b_proj (this layer's MLAWeights) into per-head nope keys and
    values, or absorbs kv_b_proj into the query and output.

    Tensor parallel: the query heads split over the ranks (q_proj or q_b_proj, and kv_b_proj,
    by whole heads; o_proj row-parallel, all-reduced). The latent and the rope key are one KV
    head that every query head reads (MQA), so each rank computes and caches them whole.
    Without q LoRA, qkv_a_proj is column-parallel: q_proj's part split by heads,
    kv_a_proj_with_mqa's declared as one head, which every rank keeps whole (LinearSpec.
    part_heads: fewer heads than ranks replicate). With q LoRA it is replicated: q_a_proj's
    latent, which every head expands from, is needed whole too.
    """

    def __init__(
        self, cfg: dict[str, Any], layer: int, rotary: RotaryEmbedding, ctx: BuildContext
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer}.self_attn"
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        self.heads = heads_per_rank(heads, heads, ctx.parallel)[0]  # this rank's
        self.nope, self.rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim, self.rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
        self.q_lora: int | None = cfg.get("q_lora_rank")
        qk = self.nope + self.rope
        self.q_out = self.q_lora or self.heads * qk  # this rank's q columns of qkv_a_proj
        self.qkv_a_proj = linear(
            ctx,
            f"{prefix}.qkv_a_proj",
            hidden,
            [self.q_lora or heads * qk, self.rank + self.rope],
            False,
            # q LoRA: q_a_proj's latent and kv_a's, whole on every rank; else q_proj by heads
            "replicated" if self.q_lora else "column",
            part_names=("q_a_proj" if self.q_lora else "q_proj", "kv_a_proj_with_mqa"),
            part_heads=() if self.q_lora else (heads, 1),
        )
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj = None
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(self.q_lora, LATENT_EPS, ctx)
            self.q_b_proj = linear(
                ctx,
                f"{prefix}.q_b_proj",
                self.q_lora,
                [heads * qk],
                False,
                "column",
                part_heads=(heads,),
            )
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_EPS, ctx)
        self.kv_b_proj = linear(
            ctx,
            f"{prefix}.kv_b_proj",
            self.rank,
            [heads * (self.nope + self.v_dim)],
            False,
            "column",
            part_heads=(heads,),
        )
        self.o_proj = linear(ctx, f"{prefix}.o_proj", heads * self.v_dim, [hidden], False, "row")
        self.tp = ctx.parallel if ctx.parallel.world_size > 1 else None
        self.rotary = rotary
        self.backend = ctx.attention
        self.ops = ctx.ops
        self.dtype, self.device = ctx.dtype, ctx.device
        self.mla = MLAWeights(self.nope, self.v_dim, self._expand)
        # An fp8 latent cache stores the row / k_scale (one scale: the latent is the value
        # too): the checkpoint's self_attn.k_scale where it has one, else 1.0.
        self.k_scale: nn.Parameter | None = None
        if ctx.attention.layers[layer].dtype == "fp8_e4m3":
            one = torch.ones(1, dtype=torch.float32, device=ctx.device)
            self.k_scale = nn.Parameter(one, requires_grad=False)
        self.attn = ctx.attention.layer(
            layer, softmax_scale(cfg), k_scale=self.k_scale, mla=self.mla
        )

    def _expand(self, latent: torch.Tensor) -> torch.Tensor:
        """kv_b_proj: latent [N, rank] -> [N, heads, nope + v]."""
        return self.kv_b_proj(latent).view(-1, self.heads, self.nope + self.v_dim)

    def absorb(self) -> None:
        """Set the MLA weights' dense W_UK and W_UV (views of kv_b_proj's weight where it is
        a plain tensor; otherwise the layer applied to the identity, in the model's dtype)."""
        w = self.kv_b_proj.dense_weight()
        if w is None:
            eye = torch.eye(self.rank, dtype=self.dtype, device=self.device)
            w = self.kv_b_proj(eye).t()
        w = w.view(self.heads, self.nope + self.v_dim, self.rank)
        self.mla.w_uk, self.mla.w_uv = w[:, : self.nope], w[:, self.nope :]

    def _attend(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> the attention output before o_proj, [T, heads * v_head_dim]."""
        if self.q_a_layernorm is not None and self.q_b_proj is not None:
            t = x.shape[0]
            q, kv = self.qkv_a_proj(x).split([self.q_out, self.rank + self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q)).view(t, self.heads, self.nope + self.rope)
            return self._attend_qkv(positions, q, kv)
        # Without q LoRA the GEMM's K-slice parts (a kernel package's decode GEMM) go to
        # mla_rope_norm, which sums them.
        parts, bias = self.ops.linear_split(self.qkv_a_proj, x)
        assert bias is None  # qkv_a_proj has none
        return self._attend_parts(positions, parts)

    def _attend_parts(self, positions: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
        """_attend from qkv_a_proj's output as [S, T, q + kv] K-slice parts (no q LoRA)."""
        q, kv = parts.split([self.q_out, self.rank + self.rope], dim=-1)
        q = q.view(q.shape[0], q.shape[1], self.heads, self.nope + self.rope)
        return self._attend_qkv(positions, q, kv)

    def _attend_qkv(
        self, positions: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        """The attention output from q [(S,) T, heads, nope + rope] and kv [(S,) T, rank +
        rope] (whole, or [S, ...] views of K-slice parts, which mla_rope_norm sums)."""
        t = q.shape[-3]
        # q rotated; k [T, 1, rank + rope]: the normed latent and the rotated rope key
        q, k = self.ops.mla_rope_norm(
            q,
            kv,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            positions,
            self.rotary.cos_sin,
        )
        out = self.backend.forward(self.attn, q, k, k[..., : self.rank])
        return out.reshape(t, self.heads * self.v_dim)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, parts: bool = False
    ) -> torch.Tensor:
        """The layer's output, or with `parts` o_proj's partial results for a norm that adds
        them up (Attention.forward's contract)."""
        return self._project(self._attend(positions, x), parts)

    def _project(self, out: torch.Tensor, parts: bool) -> torch.Tensor:
        """o_proj of the attention output (as forward returns it)."""
        if parts:
            y = self.ops.linear_parts(self.o_proj, out)
            return y if self.tp is None else reduce_parts(self.tp, y)
        y = self.o_proj(out)
        return y if self.tp is None else self.tp.all_reduce(y)

    def forward_normed(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward(norm(x, residual, parts=True), parts=True) and the norm's new residual;
        without q LoRA the norm and qkv_a_proj are one ops call (rms_norm_linear_split)."""
        if self.q_a_layernorm is not None:
            h, residual = norm(x, residual, parts=True)
            return self.forward(positions, h, parts=True), residual
        qkv, bias, residual = self.ops.rms_norm_linear_split(
            x, norm.weight, norm.eps, residual, self.qkv_a_proj
        )
        assert bias is None  # qkv_a_proj has none
        return self._project(self._attend_parts(positions, qkv), parts=True), residual


class DeepseekV2ForCausalLM(Qwen3MoeForCausalLM):
    """DeepseekV2ForCausalLM (DeepSeek-V2, V2-Lite, their Chat and Coder-V2 versions): MLA
    attention (MLAttention; with q LoRA when q_lora_rank is set), YaRN rotary on the rope
    dimensions, dense SiLU MLPs in the first first_k_dense_replace layers and after them a
    FusedMoE of n_routed_experts (router_spec) plus n_shared_experts shared ones: where
    fuses_shared_experts holds, n_shared_experts more slots of the routed experts that
    routing gives every token, else a SharedExperts MLP beside them.

    Checkpoints in the published layout: per-expert "mlp.experts.{e}.gate_proj.weight" (or
    transformers 5's stacked experts; Qwen3-MoE's loader), "mlp.shared_experts.*",
    "mlp.gate.weight". Fused, "mlp.shared_experts.{gate,up}_proj.weight" [s * I, H] load as
    experts n_routed_experts + i from rows [i * I, (i + 1) * I), "down_proj.weight" [H, s * I]
    from those columns; the fusion is at load only (checkpoint_shapes and the written presets
    keep the published layout). Tensor parallel as MLAttention says for attention; the dense
    MLPs and an unfused shared MLP column/row-parallel, the routed experts (and shared slots)
    split along their intermediate size: each rank a slice of every slot, summed by the
    layer's one all-reduce.
    """

    qk_norm = False
    fused = {k: v for k, v in FUSED.items() if k not in ("q_proj", "k_proj", "v_proj")} | {
        "q_proj": ("qkv_a_proj", 0),
        "q_a_proj": ("qkv_a_proj", 0),
        "kv_a_proj_with_mqa": ("qkv_a_proj", 1),
    }

    @classmethod
    def build_attention(
        cls, hf_config: dict[str, Any], layer: int, rotary: RotaryEmbedding, ctx: BuildContext
    ) -> nn.Module:
        return MLAttention(hf_config, layer, rotary, ctx)

    @classmethod
    def build_mlp(cls, hf_config: dict[str, Any], layer: int, ctx: BuildContext) -> nn.Module:
        if not is_moe_layer(hf_config, layer):
            return MLP(
                hf_config["hidden_size"],
                hf_config["intermediate_size"],
                False,
                ctx,
                f"model.layers.{layer}.mlp",
            )
        hidden, n = hf_config["hidden_size"], hf_config["n_routed_experts"]
        prefix = f"model.layers.{layer}.mlp"
        inter = hf_config["moe_intermediate_size"]
        router = router_spec(hf_config)
        n_shared = int(hf_config.get("n_shared_experts") or 0)
        if fuses_shared_experts(hf_config, ctx):
            experts = ExpertsSpec(f"{prefix}.experts", n + n_shared, hidden, inter, shared=n_shared)
            return SparseMoeBlock(ctx, prefix, hidden, router, experts)
        experts = ExpertsSpec(f"{prefix}.experts", n, hidden, inter)
        shared = None
        if n_shared:
            size = inter * n_shared
            shared = SharedExperts(hidden, size, False, ctx, f"{prefix}.shared_experts")
        return SparseMoeBlock(ctx, prefix, hidden, router, experts, shared=shared)

    @classmethod
    def mlp_shapes(cls, hf_config: dict[str, Any], layer: int) -> list[tuple[str, int, int, bool]]:
        hidden = hf_config["hidden_size"]

        def swiglu(prefix: str, inter: int) -> list[tuple[str, int, int, bool]]:
            return [
                (f"{prefix}.gate_proj", inter, hidden, False),
                (f"{prefix}.up_proj", inter, hidden, False),
                (f"{prefix}.down_proj", hidden, inter, False),
            ]

        if not is_moe_layer(hf_config, layer):
            return swiglu("mlp", hf_config["intermediate_size"])
        n, inter = hf_config["n_routed_experts"], hf_config["moe_intermediate_size"]
        shapes = [("mlp.gate", n, hidden, False)]
        for e in range(n):
            shapes += swiglu(f"mlp.experts.{e}", inter)
        if hf_config.get("n_shared_experts"):
            shapes += swiglu("mlp.shared_experts", inter * hf_config["n_shared_experts"])
        return shapes

    @classmethod
    def kv_layout(
        cls, hf_config: dict[str, Any], parallel: ParallelContext = SINGLE, kv_dtype: str = "auto"
    ) -> list[KVLayerSpec]:
        rank, rope = hf_config["kv_lora_rank"], hf_config["qk_rope_head_dim"]
        heads = hf_config["num_attention_heads"]
        heads = heads_per_rank(heads, heads, parallel)[0]
        spec = KVLayerSpec(
            heads, 1, rank + rope, kind="mla", v_head_dim=rank, rope_dim=rope, dtype=kv_dtype
        )
        return [spec] * hf_config["num_hidden_layers"]

    @classmethod
    def checkpoint_shapes(cls, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        cfg = with_defaults(hf_config)
        hidden, heads, vocab = cfg["hidden_size"], cfg["num_attention_heads"], cfg["vocab_size"]
        nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        rank, v_dim, q_lora = cfg["kv_lora_rank"], cfg["v_head_dim"], cfg.get("q_lora_rank")
        qk = nope + rope
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (hidden,)
            if q_lora:
                shapes[p + "self_attn.q_a_proj.weight"] = (q_lora, hidden)
                shapes[p + "self_attn.q_a_layernorm.weight"] = (q_lora,)
                shapes[p + "self_attn.q_b_proj.weight"] = (heads * qk, q_lora)
            else:
                shapes[p + "self_attn.q_proj.weight"] = (heads * qk, hidden)
            shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (rank + rope, hidden)
            shapes[p + "self_attn.kv_a_layernorm.weight"] = (rank,)
            shapes[p + "self_attn.kv_b_proj.weight"] = (heads * (nope + v_dim), rank)
            shapes[p + "self_attn.o_proj.weight"] = (hidden, heads * v_dim)
            shapes[p + "post_attention_layernorm.weight"] = (hidden,)
            for name, rows, cols, _ in cls.mlp_shapes(cfg, i):
                shapes[f"{p}{name}.weight"] = (rows, cols)
        shapes["model.norm.weight"] = (hidden,)
        if not cfg.get("tie_word_embeddings", False):
            shapes["lm_head.weight"] = (vocab, hidden)
        return shapes

    def __init__(self, hf_config: dict[str, Any], ctx: BuildContext) -> None:
        super().__init__(with_defaults(hf_config), ctx)
        # the MoE layers whose shared experts are expert slots, by their checkpoint prefix
        # ("model.layers.1.mlp.shared_experts.") -> the layer's experts
        self._shared_slots: dict[str, QuantExperts] = {
            f"{name}.shared_experts.": m.experts
            for name, m in self.named_modules()
            if isinstance(m, FusedMoE) and m.experts.spec.shared
        }

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights)
        for layer in self.model.layers:
            layer.self_attn.absorb()

    def _submodule(self, path: str, name: str) -> nn.Module:
        # FusedMoE keeps unfused shared experts as "shared"
        return super()._submodule(path.replace(".mlp.shared_experts", ".mlp.shared"), name)

    def _expected_names(self) -> set[str]:
        # fused shared experts: the experts check their slots (finish_loading)
        fused = tuple(self._shared_slots)
        return {n for n in super()._expected_names() if not n.startswith(fused)}

    def _load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        prefix, sep, rest = name.partition(".shared_experts.")
        experts = self._shared_slots.get(prefix + sep) if sep else None
        if experts is None:
            return super()._load_expert(name, tensor)
        self._load_shared(experts, name, rest, tensor)
        return True

    def _load_shared(
        self, experts: QuantExperts, name: str, rest: str, tensor: torch.Tensor
    ) -> None:
        """A shared MLP's projection ("gate_proj.weight" [s * I, H], "up_proj.weight",
        "down_proj.weight" [H, s * I]) into the experts' s shared slots: slot i takes gate and
        up rows, down columns [i * I, (i + 1) * I) (each rank keeps its share of those, as of
        every expert)."""
        arch = type(self).__name__
        spec = experts.spec
        head, _, kind = rest.partition(".")
        part = head.removesuffix("_proj")
        inter, hidden = spec.intermediate_size, spec.hidden_size
        whole = spec.shared * inter
        want = {"gate": (whole, hidden), "up": (whole, hidden), "down": (hidden, whole)}.get(part)
        if want is None or kind != "weight":
            raise ValueError(f"{arch}: unexpected checkpoint tensor {name!r}")
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"{arch}: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {want}"
            )
        dim = 1 if part == "down" else 0
        try:
            for i in range(spec.shared):
                piece = tensor.narrow(dim, i * inter, inter)
                experts.load(f"{part}.weight", piece, spec.routed + i)
        except ValueError as exc:
            raise ValueError(f"{arch}: checkpoint tensor {name!r}: {exc}") from None
