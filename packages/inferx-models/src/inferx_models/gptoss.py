"""gpt-oss: a decoder of alternating sliding-window and full attention with a learned sink logit
per head, YaRN rotary positions, and routed experts (top-k softmax, clamped SwiGLU, biases) in
every layer, stored in bf16 or as MXFP4 blocks and scales."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from inferx_core.interfaces.kv import KVLayerSpec
from inferx_core.interfaces.model import BuildContext
from inferx_core.interfaces.moe import ExpertsSpec, QuantExperts, RouterSpec
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_models.layers import heads_per_rank
from inferx_models.llama import LlamaForCausalLM, _dims
from inferx_models.qwen3 import SparseMoeBlock, num_experts

# GptOssConfig's rotary when a config names none.
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# An expert tensor's suffix after "gate_up_proj" / "down_proj" -> the kind QuantExperts.load takes.
_EXPERT_KINDS = {"": "weight", "_bias": "bias", "_blocks": "blocks", "_scales": "scales"}
MXFP4_BLOCK = 32  # elements sharing one e8m0 scale; 16 bytes of e2m1 pairs


def with_defaults(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The config with GptOssConfig's defaults where it leaves a setting out (they differ from
    the Llama ones the shared layers assume: rotary, norm eps, biases, layer types)."""
    cfg = dict(hf_config)
    cfg.setdefault("head_dim", 64)
    cfg.setdefault("rope_theta", 150000.0)
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        cfg["rope_scaling"] = dict(DEFAULT_ROPE)
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg.setdefault("max_position_embeddings", 131072)
    cfg.setdefault("attention_bias", True)
    cfg.setdefault("sliding_window", 128)
    if "num_experts_per_tok" not in cfg:
        cfg["num_experts_per_tok"] = cfg.get("experts_per_token", 4)
    if not cfg.get("layer_types"):
        # sliding on even layers, full on odd ones
        n = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["full_attention" if i % 2 else "sliding_attention" for i in range(n)]
    return cfg


def is_mxfp4(hf_config: dict[str, Any]) -> bool:
    """Whether the checkpoint stores its experts as MXFP4 blocks and scales."""
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def expert_shapes(hf_config: dict[str, Any], layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's expert tensors as published: bf16 weights [E, in, out] (transposed against a
    linear layer's), or MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32] (in
    a linear layer's [out, in] order); biases [E, out] either way."""
    e, hidden, inter = (
        num_experts(hf_config),
        hf_config["hidden_size"],
        hf_config["intermediate_size"],
    )
    prefix = f"model.layers.{layer}.mlp.experts."
    shapes: dict[str, tuple[int, ...]] = {}
    for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        if is_mxfp4(hf_config):
            if cols % MXFP4_BLOCK:
                raise ValueError(f"{prefix}{proj}: {cols} inputs are not whole MXFP4 blocks of 32")
            groups = cols // MXFP4_BLOCK
            shapes[f"{prefix}{proj}_blocks"] = (e, rows, groups, MXFP4_BLOCK // 2)
            shapes[f"{prefix}{proj}_scales"] = (e, rows, groups)
        else:
            shapes[f"{prefix}{proj}"] = (e, cols, rows)
        shapes[f"{prefix}{proj}_bias"] = (e, rows)
    return shapes


class GptOssForCausalLM(LlamaForCausalLM):
    """GptOssForCausalLM (gpt-oss-20b, gpt-oss-120b): q/k/v/o biases, a sink logit per query
    head (`self_attn.sinks`), sliding-window attention on the layers layer_types names, YaRN
    rotary, and in every layer a FusedMoE whose router ("mlp.router", with bias) picks
    num_experts_per_tok experts by a softmax over the picked logits; the experts apply the
    clamped SwiGLU ("swiglu_oai") to interleaved gate/up rows, with biases.

    Expert weights are whatever the quant scheme makes of them: bf16 checkpoints load into the
    unquantized experts, MXFP4 ones (quantization_config quant_method "mxfp4") into
    inferx-quant's MXFP4 experts, which keep the blocks and scales as stored.

    Tensor parallel as Llama: query heads (with their sinks and q/k/v biases) split, KV heads
    replicated where fewer than the ranks, o_proj's bias added by rank 0; the router
    replicated and every expert split along its intermediate size (MXFP4 in whole scale
    groups).
    """

    sinks = True

    @classmethod
    def biases(cls, hf_config: dict[str, Any]) -> tuple[bool, bool, bool]:
        attn = bool(hf_config.get("attention_bias", True))
        return attn, attn, False

    @classmethod
    def build_mlp(cls, hf_config: dict[str, Any], layer: int, ctx: BuildContext) -> nn.Module:
        cfg = with_defaults(hf_config)
        hidden, n = cfg["hidden_size"], num_experts(cfg)
        prefix = f"model.layers.{layer}.mlp"
        router = RouterSpec(n, cfg["num_experts_per_tok"], softmax_after_topk=True)
        experts = ExpertsSpec(
            f"{prefix}.experts",
            n,
            hidden,
            cfg["intermediate_size"],
            activation="swiglu_oai",
            bias=True,
            alpha=cfg.get("swiglu_alpha", 1.702),
            limit=cfg.get("swiglu_limit", 7.0),
        )
        # The router is FusedMoE's "gate" (checkpoint "mlp.router": see _submodule).
        return SparseMoeBlock(ctx, prefix, hidden, router, experts, router_bias=True)

    @classmethod
    def mlp_shapes(cls, hf_config: dict[str, Any], layer: int) -> list[tuple[str, int, int, bool]]:
        return [("mlp.router", num_experts(hf_config), hf_config["hidden_size"], True)]

    @classmethod
    def kv_layout(
        cls, hf_config: dict[str, Any], parallel: ParallelContext = SINGLE, kv_dtype: str = "auto"
    ) -> list[KVLayerSpec]:
        cfg = with_defaults(hf_config)
        _, heads, kv_heads, head_dim = _dims(cfg)
        heads, kv_heads = heads_per_rank(heads, kv_heads, parallel)
        window = cfg["sliding_window"]
        return [
            KVLayerSpec(
                heads,
                kv_heads,
                head_dim,
                kind="sliding" if t == "sliding_attention" else "full",
                window=window if t == "sliding_attention" else None,
                dtype=kv_dtype,
                learned_sinks=True,
            )
            for t in cfg["layer_types"]
        ]

    @classmethod
    def checkpoint_shapes(cls, hf_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        cfg = with_defaults(hf_config)
        heads = cfg["num_attention_heads"]
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().checkpoint_shapes(cfg).items():
            shapes[name] = shape
            if name.endswith(".post_attention_layernorm.weight"):  # the layer's last from Llama
                layer = int(name.split(".")[2])
                shapes[f"model.layers.{layer}.self_attn.sinks"] = (heads,)
                shapes.update(expert_shapes(cfg, layer))
        return shapes

    @classmethod
    def checkpoint_dtypes(cls, hf_config: dict[str, Any]) -> dict[str, torch.dtype]:
        if not is_mxfp4(hf_config):
            return {}
        cfg = with_defaults(hf_config)
        return {
            name: torch.uint8
            for layer in range(cfg["num_hidden_layers"])
            for name in expert_shapes(cfg, layer)
            if name.endswith(("_blocks", "_scales"))
        }

    def __init__(self, hf_config: dict[str, Any], ctx: BuildContext) -> None:
        super().__init__(with_defaults(hf_config), ctx)
        self.rank = ctx.parallel.rank

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        seen: set[str] = set()
        super().load_weights(self._load_own(weights, seen))
        missing = sorted(self._own_names() - seen)
        arch = type(self).__name__
        if missing:
            listed = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"{arch}: checkpoint lacks {len(missing)} tensors: {listed}")
        for layer in self.model.layers:
            try:
                layer.mlp.experts.finish_loading()
            except ValueError as exc:
                raise ValueError(f"{arch}: {exc}") from None

    def _own_names(self) -> set[str]:
        """The tensors _load_own takes (experts and sinks): the rest go through Llama's loader."""
        return {
            n
            for n in self.checkpoint_shapes(self.hf_config)
            if ".mlp.experts." in n or n.endswith(".self_attn.sinks")
        }

    def _expected_names(self) -> set[str]:
        return super()._expected_names() - self._own_names()

    def _submodule(self, path: str, name: str) -> nn.Module:
        # The checkpoint's "mlp.router" is FusedMoE's router linear layer, "mlp.gate".
        if path.endswith(".mlp.router"):
            path = path.removesuffix("router") + "gate"
        return super()._submodule(path, name)

    def _load_own(
        self, weights: Iterable[tuple[str, torch.Tensor]], seen: set[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Load the expert and sink tensors (adding their names to `seen`); yield the others."""
        arch = type(self).__name__
        for name, tensor in weights:
            if name.endswith(".self_attn.sinks"):
                attn = self._submodule(name.removesuffix(".sinks"), name)
                whole = (self.hf_config["num_attention_heads"],)
                if tuple(tensor.shape) != whole:
                    raise ValueError(
                        f"{arch}: checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {whole}"
                    )
                # this rank's query heads
                attn.sinks.copy_(tensor.narrow(0, self.rank * attn.num_heads, attn.num_heads))
            elif ".mlp.experts." in name:
                self._load_expert(name, tensor)
            else:
                yield name, tensor
                continue
            seen.add(name)

    def _load_expert(self, name: str, tensor: torch.Tensor) -> None:
        """An expert tensor ("...mlp.experts.gate_up_proj_blocks") into its layer's experts."""
        arch = type(self).__name__
        layer, _, rest = name.partition(".mlp.experts.")
        experts = self._submodule(f"{layer}.mlp.experts", name)
        proj = "gate_up" if rest.startswith("gate_up_proj") else "down"
        kind = _EXPERT_KINDS.get(rest.removeprefix(f"{proj}_proj"))
        if not isinstance(experts, QuantExperts) or kind is None:
            raise ValueError(f"{arch}: unexpected checkpoint tensor {name!r}")
        if kind == "weight":
            tensor = tensor.transpose(-1, -2)  # stored [E, in, out]; load() takes [out, in]
        try:
            experts.load(f"{proj}.{kind}", tensor)
        except ValueError as exc:
            raise ValueError(f"{arch}: checkpoint tensor {name!r}: {exc}") from None
