"""The Llama decoder family: Llama 1/2/3 and Qwen2, which differ only in biases and defaults."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from inferx_core.interfaces.kv import KVLayerSpec
from inferx_core.interfaces.model import BuildContext, ModelArch
from inferx_core.interfaces.quant import QuantLinear, input_quant
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_models.layers import (
    Attention,
    ParallelHead,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    VocabShard,
    heads_per_rank,
    kv_scale_target,
    linear,
    reduce_parts,
    rope_parameters,
)

# Checkpoint projection -> (our linear layer, part of it): q/k/v and gate/up are fused.
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int]:
    """hidden size, query heads, KV heads, head dim."""
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    return hidden, heads, kv_heads, cfg.get("head_dim") or hidden // heads


class MLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, bias: bool, ctx: BuildContext, prefix: str
    ) -> None:
        super().__init__()
        self.gate_up_proj = linear(
            ctx,
            f"{prefix}.gate_up_proj",
            hidden,
            [intermediate, intermediate],
            bias,
            "column",
            ("gate_proj", "up_proj"),
        )
        self.down_proj = linear(ctx, f"{prefix}.down_proj", intermediate, [hidden], bias, "row")
        # what down_proj takes pre-quantized from SiLU-and-mul (FP8 W8A8), or None
        self.act_quant = input_quant(self.down_proj)
        self.ops = ctx.ops
        self.tp = ctx.parallel if ctx.parallel.world_size > 1 else None

    def forward_normed(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP of norm(x, residual, parts=True) as down_proj's partial results
        (QuantLinear.forward_parts) for the next norm, and that norm's new residual; the norm,
        gate_up and SiLU-and-mul are one ops call (ops.rms_norm_linear_silu_and_mul), whose
        norm and activation come quantized where gate_up and down_proj take them so. x is the
        partial results of the attention before."""
        h, residual = self.ops.rms_norm_linear_silu_and_mul(
            x, norm.weight, norm.eps, residual, self.gate_up_proj, self.act_quant
        )
        out = self.ops.linear_parts(self.down_proj, h)
        if self.tp is not None:  # down_proj is row-parallel: each rank holds a partial sum
            out = reduce_parts(self.tp, out)
        return out, residual


class DecoderLayer(nn.Module):
    """One block in the fused-residual form: the stream `residual` is carried beside `h`, the
    output of the last sublayer, and each norm first adds them (one kernel instead of an add and
    a norm). The first layer has no residual yet; the model's final norm takes the last one.
    The sublayers hand over their output as partial results (QuantLinear.forward_parts), which
    that same norm sums: a GEMM split along K costs no reduce kernel of its own."""

    def __init__(
        self,
        cfg: dict[str, Any],
        layer: int,
        rotary: RotaryEmbedding,
        arch: type[LlamaForCausalLM],
        ctx: BuildContext,
    ) -> None:
        super().__init__()
        hidden = _dims(cfg)[0]
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps, ctx)
        self.self_attn = arch.build_attention(cfg, layer, rotary, ctx)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ctx)
        self.mlp = arch.build_mlp(cfg, layer, ctx)

    def forward(
        self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output as parts, the residual stream before it was added)."""
        if residual is None:
            residual = h
            quant = getattr(self.self_attn, "input_quant", None)
            h = self.self_attn(positions, self.input_layernorm(h, quant=quant), parts=True)
        else:
            h, residual = self.self_attn.forward_normed(
                positions, h, residual, self.input_layernorm
            )
        return self.mlp.forward_normed(h, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    """The decoder stack, named as in Hugging Face checkpoints (the "model." prefix)."""

    def __init__(
        self, cfg: dict[str, Any], arch: type[LlamaForCausalLM], ctx: BuildContext
    ) -> None:
        super().__init__()
        hidden, _, _, head_dim = _dims(cfg)
        self.embed_tokens = VocabEmbedding(cfg["vocab_size"], hidden, ctx)
        rotary = RotaryEmbedding(
            head_dim, cfg.get("max_position_embeddings", 2048), rope_parameters(cfg), ctx.device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, rotary, arch, ctx) for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6), ctx)
        self.ops = ctx.ops

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        if residual is None:
            return self.norm(h)  # a model with no layers
        return self.norm(h, residual, parts=True)[0]


class LlamaForCausalLM(ModelArch):
    """LlamaForCausalLM: Llama 1, 2, 3, 3.1 (llama3 rope scaling), 3.2, and look-alikes such as
    SmolLM2. `attention_bias` and `mlp_bias` from the config are honoured.

    Subclasses vary it through `biases`, `qk_norm`, `sinks`, `build_attention`, `fused` (how
    checkpoint projections map to fused layers) and `build_mlp` / `mlp_shapes` (a layer's MLP
    and its checkpoint tensors)."""

    # RMSNorm of each q and k head over head_dim before the rotary (Qwen3)
    qk_norm = False
    # a learned sink logit per query head in every softmax (gpt-oss)
    sinks = False
    # checkpoint projection -> (our linear layer, part of it)
    fused: dict[str, tuple[str, int]] = FUSED

    @classmethod
    def biases(cls, hf_config: dict[str, Any]) -> tuple[bool, bool, bool]:
        """Which projections carry a bias: (q/k/v, o, mlp)."""
        attn = bool(hf_config.get("attention_bias", False))
        return attn, attn, bool(hf_config.get("mlp_bias", False))

    @classmethod
    def build_attention(
        cls, hf_config: dict[str, Any], layer: int, rotary: RotaryEmbedding, ctx: BuildContext
    ) -> nn.Module:
        """Layer `layer`'s attention: a module with forward(positions, x, parts) and
        forward_normed(positions, x, residual, norm) (Attention's)."""
        _, heads, kv_heads, head_dim = _dims(hf_config)
        qkv_bias, o_bias, _ = cls.biases(hf_config)
        qk_norm_eps = hf_config.get("rms_norm_eps", 1e-6) if cls.qk_norm else None
        return Attention(
            layer,
            hf_config["hidden_size"],
            heads,
            kv_heads,
            head_dim,
            rotary,
            ctx,
            qkv_bias,
            o_bias,
            qk_norm_eps=qk_norm_eps,
            sinks=cls.sinks,
        )

    @classmethod
    def build_mlp(cls, hf_config: dict[str, Any], layer: int, ctx: BuildContext) -> nn.Module:
        """Layer `layer`'s MLP: a module with forward_normed(x, residual, norm) (MLP's)."""
        hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
        bias = cls.biases(hf_config)[2]
        return MLP(hidden, inter, bias, ctx, f"model.layers.{layer}.mlp")

    @classmethod
    def mlp_shapes(cls, hf_config: dict[str, Any], layer: int) -> list[tuple[str, int, int, bool]]:
        """Layer `layer`'s MLP projections in the checkpoint: (name below the layer, rows,
        columns, whether it has a bias)."""
        hidden, inter = hf_config["hidden_size"], hf_config["intermediate_size"]
        bias = cls.biases(hf_config)[2]
        return [
            ("mlp.gate_proj", inter, hidden, bias),
            ("mlp.up_proj", inter, hidden, bias),
            ("mlp.down_proj", hidden, inter, bias),
        ]

    @classmethod
    def kv_layout(
        cls, hf_config: dict[str, Any], parallel: ParallelContext = SINGLE, kv_dtype: str = "auto"
    ) -> list[KVLayerSpec]:
        _, heads, kv_heads, head_dim = _dims(hf_config)
        heads, kv_heads = heads_per_rank(heads, kv_heads, parallel)
        n = hf_config["num_hidden_layers"]
        window = hf_config.get("sliding_window")
        # Qwen2's optional sliding window applies from layer max_window_layers on; transformers 5
        # spells the result out as layer_types.
        types = hf_config.get("layer_types") or [
            "sliding_attention"
            if hf_config.get("use_sliding_window")
            and window
            and i >= hf_config["max_window_layers"]
            else "full_attention"
            for i in range(n)
        ]
        return [
            KVLayerSpec(heads, kv_heads, head_dim, kind="sliding", window=window, dtype=kv_dtype)
            if t == "sliding_attention"
            else KVLayerSpec(heads, kv_heads, head_dim, dtype=kv_dtype)
            for t in types
        ]

    @classmethod
    def checkpoint_shapes(cls, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        hidden, heads, kv_heads, head_dim = _dims(hf_config)
        vocab = hf_config["vocab_size"]
        qkv_bias, o_bias, _ = cls.biases(hf_config)
        attention = [
            ("self_attn.q_proj", heads * head_dim, hidden, qkv_bias),
            ("self_attn.k_proj", kv_heads * head_dim, hidden, qkv_bias),
            ("self_attn.v_proj", kv_heads * head_dim, hidden, qkv_bias),
            ("self_attn.o_proj", hidden, heads * head_dim, o_bias),
        ]
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(hf_config["num_hidden_layers"]):
            prefix = f"model.layers.{i}."
            shapes[prefix + "input_layernorm.weight"] = (hidden,)
            shapes[prefix + "post_attention_layernorm.weight"] = (hidden,)
            if cls.qk_norm:
                shapes[prefix + "self_attn.q_norm.weight"] = (head_dim,)
                shapes[prefix + "self_attn.k_norm.weight"] = (head_dim,)
            for name, rows, cols, bias in attention + cls.mlp_shapes(hf_config, i):
                shapes[f"{prefix}{name}.weight"] = (rows, cols)
                if bias:
                    shapes[f"{prefix}{name}.bias"] = (rows,)
        shapes["model.norm.weight"] = (hidden,)
        if not hf_config.get("tie_word_embeddings", False):
            shapes["lm_head.weight"] = (vocab, hidden)
        return shapes

    def __init__(self, hf_config: dict[str, Any], ctx: BuildContext) -> None:
        super().__init__()
        n = ctx.parallel.world_size
        heads_per_rank(_dims(hf_config)[1], _dims(hf_config)[2], ctx.parallel)  # checks n
        if hf_config["intermediate_size"] % n:
            raise ValueError(
                f"parallel.tensor = {n} does not divide intermediate_size "
                f"({hf_config['intermediate_size']})"
            )
        self.hf_config = hf_config
        self.tied = bool(hf_config.get("tie_word_embeddings", False))
        self.model = LlamaModel(hf_config, type(self), ctx)
        # The vocabulary projection stays in the serving dtype, like the embedding it is often
        # tied to (then it shares its weight); quantized checkpoints leave it unquantized too.
        tied = self.model.embed_tokens.weight if self.tied else None
        self.lm_head = ParallelHead(hf_config["vocab_size"], _dims(hf_config)[0], ctx, tied)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def compute_logits_into(self, hidden: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head.weight
        gathered = self.lm_head.tp is not None  # the ranks' logits are concatenated first
        if gathered or out.dtype != weight.dtype or hidden.dtype != weight.dtype:
            return super().compute_logits_into(hidden, out)
        return torch.mm(hidden, weight.t(), out=out)  # the GEMM F.linear runs, written in place

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        arch = type(self).__name__
        seen: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints saved the rotary buffer; we compute it
            if name == "lm_head.weight" and self.tied:
                continue  # some tied checkpoints store a copy of the embedding anyway
            if (kv := kv_scale_target(name)) is not None:
                # FP8 KV scales (older checkpoints name them k_proj/v_proj.output_scale):
                # read into an fp8 cache's layer, ignored by a cache in the model's dtype
                param = getattr(self._submodule(kv[0], name), kv[1], None)
                if param is not None:
                    param.copy_(tensor.float().reshape(1))
                continue
            path, _, kind = name.rpartition(".")
            parent, _, leaf = path.rpartition(".")
            if leaf in self.fused:
                fused, part = self.fused[leaf]
                self._submodule(f"{parent}.{fused}", name).load(kind, tensor, part)
            elif isinstance(module := self._submodule(path, name), VocabShard | QuantLinear):
                try:
                    module.load(kind, tensor)  # keeps this rank's share
                except ValueError as exc:
                    raise ValueError(f"{arch}: checkpoint tensor {name!r}: {exc}") from None
            else:
                param = getattr(module, kind, None)
                if not isinstance(param, nn.Parameter):
                    raise ValueError(f"{arch}: unexpected checkpoint tensor {name!r}")
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{arch}: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)}"
                    )
                param.copy_(tensor)
            seen.add(name)
        missing = sorted(self._expected_names() - seen)
        if missing:
            listed = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"{arch}: checkpoint lacks {len(missing)} tensors: {listed}")
        for module in self.modules():
            if isinstance(module, QuantLinear):
                try:
                    module.finish_loading()  # a quantized layer checks its scales here
                except ValueError as exc:
                    raise ValueError(f"{arch}: {exc}") from None

    def _expected_names(self) -> set[str]:
        """The checkpoint tensors load_weights requires by name: a linear layer's weight, or
        the tensors its quant method keeps instead (QuantLinear.checkpoint_kinds)."""
        names: set[str] = set()
        for name in self.checkpoint_shapes(self.hf_config):
            path, _, kind = name.rpartition(".")
            kinds = self._linear_kinds(path) if kind == "weight" else None
            names.update([name] if kinds is None else (f"{path}.{k}" for k in kinds))
        return names

    def _linear_kinds(self, path: str) -> tuple[str, ...] | None:
        """The checkpoint kinds of the linear layer (or fused part) at `path`, if it is one."""
        parent, _, leaf = path.rpartition(".")
        target = f"{parent}.{self.fused[leaf][0]}" if leaf in self.fused else path
        try:
            module = self._submodule(target, path)  # the model's own name mapping
        except ValueError:
            return None
        return module.checkpoint_kinds if isinstance(module, QuantLinear) else None

    def _submodule(self, path: str, name: str) -> nn.Module:
        try:
            return self.get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"{type(self).__name__}: unexpected checkpoint tensor {name!r}"
            ) from None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 and Qwen2.5: Llama with biases on q, k and v only."""

    @classmethod
    def biases(cls, hf_config: dict[str, Any]) -> tuple[bool, bool, bool]:
        return True, False, False
