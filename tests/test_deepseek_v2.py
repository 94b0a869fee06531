"""DeepSeek-V2 (MLA + MoE) against transformers on the CPU in fp32: logits, and greedy generation
token for token — batched, chunked, from the prefix cache and after preemption — with and
without q LoRA, YaRN, greedy and group-limited routing; the absorbed MLA decode against the
plain form; the latent cache's size; the presets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from test_engine import NEW_TOKENS, PROMPTS, generate, make_llm, reference  # noqa: E402
from test_models import (  # noqa: E402
    CHUNKED_PREFILL,
    PREEMPTING,
    Runner,
    check_preemption,
    check_prefix_hit,
    check_preset_command,
    check_stacked_experts,
    check_steps,
    rel_err,
    saved,
    spread_weights,
)

from inferx_core.attention_torch import TorchAttention, mla_absorbed, mla_plain  # noqa: E402
from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.executor import LoadError  # noqa: E402
from inferx_core.interfaces.attention import MLAWeights  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec, kv_groups  # noqa: E402
from inferx_core.interfaces.model import BuildContext  # noqa: E402
from inferx_core.interfaces.moe import RouterSpec  # noqa: E402
from inferx_core.moe import route  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.quant_none import Unquantized  # noqa: E402
from inferx_models.deepseek_v2 import (  # noqa: E402
    DeepseekV2ForCausalLM,
    MLAttention,
    SharedExperts,
    fuses_shared_experts,
    router_spec,
    softmax_scale,
    with_defaults,
)
from inferx_models.presets import preset  # noqa: E402
from inferx_models.qwen3 import SparseMoeBlock  # noqa: E402

RTOL = 1e-4
VOCAB = 256

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,  # not qk_nope_head_dim
    kv_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=2,
    first_k_dense_replace=1,  # layer 0 dense, 1 and 2 routed
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)
# YaRN over an original context of 64 (prompts run past it); V2-Lite's mscale pair (attention
# factor 1, the softmax scale times mscale(0.707)^2) and a pair that scales the rotary too.
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS: dict[str, dict[str, Any]] = {
    # V2-Lite's shape: no q LoRA, greedy routing
    "lite": dict(
        q_lora_rank=None,
        rope_scaling=YARN | {"mscale": 0.707, "mscale_all_dim": 0.707},
        topk_method="greedy",
        routed_scaling_factor=1.0,
    ),
    # V2's shape: q LoRA, group-limited routing, a routed scaling factor
    "v2": dict(
        q_lora_rank=24,
        rope_scaling=YARN | {"mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16},
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
    ),
}


def hf_config(variant: str) -> transformers.PretrainedConfig:
    config = transformers.DeepseekV2Config(**COMMON, **VARIANTS[variant])
    config.architectures = ["DeepseekV2ForCausalLM"]
    return config


def hf_model(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    # The latents' norms among the norms spread away from 1.
    return spread_weights(transformers.DeepseekV2ForCausalLM(hf_config(variant)).eval())


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return saved(hf_model(request.param), tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def expected(checkpoint):
    return reference(checkpoint[1], PROMPTS)


def test_published_layout_is_what_we_declare(checkpoint):
    """transformers writes the published layout (per-expert tensors, shared_experts, mlp.gate,
    q_proj or q_a/q_b): exactly the names and shapes checkpoint_shapes declares."""
    path, _ = checkpoint
    stored = {n: tuple(t.shape) for n, t in load_file(path / "model.safetensors").items()}
    config = json.loads((path / "config.json").read_text())
    assert stored == DeepseekV2ForCausalLM.checkpoint_shapes(config)
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in stored
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in stored
    assert ("model.layers.0.self_attn.q_a_proj.weight" in stored) == ("v2" in path.name)


def test_logits_packed_and_chunked_match_transformers(checkpoint):
    path, ref = checkpoint
    runner = Runner(path, 4)
    full = {"a": PROMPTS[0], "b": PROMPTS[3][:22], "c": PROMPTS[4]}
    schedule = [
        [("a", 0, 11), ("b", 0, 21)],
        [("a", 11, 30), ("c", 0, 6)],
        [("a", 30, 31), ("c", 6, 13)],  # a decode beside a chunk over a cached prefix
        [("a", 31, 32), ("b", 21, 22)],  # decodes only
        [("a", 32, 37)],
    ]
    check_steps(runner, ref, full, schedule, RTOL)


def test_batched_greedy_equals_transformers(checkpoint, expected):
    llm = make_llm(checkpoint[0])
    layers = llm.engine.executor.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True, True]
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    out = generate(llm)
    assert out == expected and all(len(tokens) == NEW_TOKENS for tokens in out)


def test_chunked_prefill_equals_transformers(checkpoint, expected):
    assert generate(make_llm(checkpoint[0], **CHUNKED_PREFILL)) == expected


def test_prefix_cache_hit_equals_transformers(checkpoint):
    """Two prompts sharing a 40-token prefix, one after the other: the second reads the
    first's cached latents."""
    path, model = checkpoint
    llm = make_llm(path, **{"kv_cache.block_size": 4})
    assert [g.kind for g in llm.engine.kv.groups] == ["mla"]
    check_prefix_hit(llm, model, generate, reference)


def test_preemption_equals_transformers(checkpoint, expected):
    check_preemption(make_llm(checkpoint[0], **PREEMPTING), generate, expected)


@pytest.mark.slow  # a rank process over gloo: seconds
def test_two_ranks_give_the_greedy_tokens_of_one(checkpoint):
    """Query heads split (q_proj or q_b_proj, kv_b_proj's per-head slices, o_proj row-parallel),
    the latent computed and cached whole on each rank, the dense MLP, shared and routed experts
    split along their intermediate sizes, the vocabulary split: one rank's greedy tokens, fp32."""
    path, _ = checkpoint
    cache = {"kv_cache.num_blocks": 64}
    expected = generate(make_llm(path, **cache))
    llm = make_llm(path, **cache, **{"parallel.tensor": 2})
    try:
        assert generate(llm) == expected
    finally:
        llm.engine.executor.close()


def test_stacked_expert_layout_and_default_rope(tmp_path: Path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj
    [E, H, I]) as checkpoint names gives the per-expert checkpoint's logits exactly; and a
    config without rope scaling (plain rotary, the plain softmax scale) matches transformers."""
    config = transformers.DeepseekV2Config(**COMMON | {"q_lora_rank": 24})
    config.architectures = ["DeepseekV2ForCausalLM"]
    torch.manual_seed(1)
    model = spread_weights(transformers.DeepseekV2ForCausalLM(config).eval())
    stacked = "model.layers.1.mlp.experts.gate_up_proj"
    check_stacked_experts(model, tmp_path, stacked, PROMPTS[3], RTOL)


def test_missing_and_unexpected_tensors_are_named():
    from inferx_core.attention_torch import TorchAttention as Backend
    from inferx_core.interfaces.model import BuildContext
    from inferx_core.quant_none import Unquantized

    cfg = preset("tiny-deepseek-v2")
    cpu = torch.device("cpu")

    def model() -> DeepseekV2ForCausalLM:
        backend = Backend(DeepseekV2ForCausalLM.kv_layout(cfg), 4, torch.float32, cpu)
        return DeepseekV2ForCausalLM(cfg, BuildContext(torch.float32, cpu, backend, Unquantized()))

    weights = {n: torch.zeros(s) for n, s in DeepseekV2ForCausalLM.checkpoint_shapes(cfg).items()}
    for dropped in (
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.shared_experts.down_proj.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
    ):
        with pytest.raises(ValueError, match=f"lacks 1 tensors: {dropped}"):
            model().load_weights((n, t) for n, t in weights.items() if n != dropped)
    dropped = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=f"checkpoint lacks {dropped}"):
        model().load_weights((n, t) for n, t in weights.items() if n != dropped)
    extra = "model.layers.0.mlp.experts.0.up_proj.weight"  # layer 0 is dense
    with pytest.raises(ValueError, match=f"unexpected checkpoint tensor '{extra}'"):
        model().load_weights([*weights.items(), (extra, torch.zeros(32, 64))])
    model().load_weights(weights.items())


def test_a_quant_methods_own_tensors_are_expected_under_fused_and_mapped_names():
    """A scheme whose layers keep tensors besides "weight" (QuantLinear.checkpoint_kinds): the
    model requires them for q_proj and kv_a_proj_with_mqa (fused into qkv_a_proj) and for the
    shared experts (FusedMoE's "shared"), and names a missing one."""
    from inferx_core.attention_torch import TorchAttention as Backend
    from inferx_core.interfaces.model import BuildContext
    from inferx_core.interfaces.quant import QuantScheme
    from inferx_core.quant_none import DenseLinear, Unquantized

    class ScaledLinear(DenseLinear):
        checkpoint_kinds = ("weight", "weight_scale")

        def load(self, kind: str, tensor: torch.Tensor, part: int = 0) -> None:
            if kind != "weight_scale":
                super().load(kind, tensor, part)

    class Scaled(Unquantized):
        def linear(self, spec, dtype, device, parallel):  # type: ignore[override]
            return ScaledLinear(spec, dtype, device, parallel)

    assert issubclass(Scaled, QuantScheme)
    cfg = preset("tiny-deepseek-v2-lite")
    cpu = torch.device("cpu")
    backend = Backend(DeepseekV2ForCausalLM.kv_layout(cfg), 4, torch.float32, cpu)
    model = DeepseekV2ForCausalLM(cfg, BuildContext(torch.float32, cpu, backend, Scaled()))
    expected = model._expected_names()
    for name in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.kv_a_proj_with_mqa",
        "model.layers.1.mlp.shared_experts.gate_proj",
        "model.layers.1.mlp.gate",
    ):
        assert {f"{name}.weight", f"{name}.weight_scale"} <= expected, name
    weights = {n: torch.zeros(s) for n, s in DeepseekV2ForCausalLM.checkpoint_shapes(cfg).items()}
    scales = {n.replace(".weight", ".weight_scale"): torch.ones(1) for n in weights}
    scales = {n: t for n, t in scales.items() if n in expected}
    dropped = "model.layers.1.mlp.shared_experts.down_proj.weight_scale"
    with pytest.raises(ValueError, match=f"lacks 1 tensors: {dropped}"):
        model.load_weights((n, t) for n, t in (weights | scales).items() if n != dropped)


# --- shared experts as slots of the routed experts (KernelOps.fuse_shared_experts) ------------


class FusingOps(TorchOps):
    """The torch reference with MoE shared experts built as expert slots, as the triton ops
    ask for them."""

    fuse_shared_experts = True


def fused_layers(model: DeepseekV2ForCausalLM) -> list[SparseMoeBlock]:
    """The model's MoE layers, checked to hold their 2 shared experts as expert slots."""
    moe = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert moe
    for mlp in moe:
        assert mlp.shared is None and mlp.router.shared == 2
        assert mlp.experts.spec.shared == 2 and mlp.experts.gate_up.shape[0] == 8 + 2
    return moe


def test_fused_shared_experts_equal_transformers(checkpoint, expected, monkeypatch):
    """Shared experts as slots 8 and 9 of the routed experts (loaded from the published
    shared_experts tensors): transformers' logits over packed and chunked steps, and its greedy
    tokens."""
    monkeypatch.setattr(TorchOps, "fuse_shared_experts", True)
    path, ref = checkpoint
    runner = Runner(path, 4)
    fused_layers(runner.model)
    full = {"a": PROMPTS[0], "b": PROMPTS[3][:22]}
    check_steps(runner, ref, full, [[("a", 0, 11), ("b", 0, 21)], [("a", 11, 12)]], RTOL)
    llm = make_llm(path)
    fused_layers(llm.engine.executor.model)
    assert generate(llm) == expected


def tiny_model(cfg: dict[str, Any], ops: TorchOps) -> DeepseekV2ForCausalLM:
    cpu = torch.device("cpu")
    backend = TorchAttention(DeepseekV2ForCausalLM.kv_layout(cfg), 4, torch.float32, cpu)
    return DeepseekV2ForCausalLM(cfg, BuildContext(torch.float32, cpu, backend, Unquantized(), ops))


def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = DeepseekV2ForCausalLM.checkpoint_shapes(cfg)
    return {n: torch.randn(s, generator=g) * 0.3 for n, s in shapes.items()}


# Largest |fused - unfused| over the largest |unfused| of a layer's output, fp32: the routed and
# shared outputs summed in another order (one sum of k + 2 experts against the routed sum plus
# the shared MLP), rounding only.
LAYER_RTOL = 1e-5


@pytest.mark.parametrize(
    "variant",
    [
        "lite",  # greedy, routed_scaling_factor 1
        "lite-scaled",  # greedy, routed_scaling_factor 2.5
        "v2",  # group-limited, routed_scaling_factor 1.5
    ],
)
def test_fused_shared_experts_layer_equals_the_unfused_one(variant: str):
    """Each MoE layer built both ways from the same checkpoint tensors: shared experts apart
    (SharedExperts, the torch reference) and as expert slots. On fresh random inputs the
    outputs agree to LAYER_RTOL; a shared slot scaled by routed_scaling_factor, or a slice
    taken from the wrong rows or columns, would miss by far more."""
    extra = {"routed_scaling_factor": 2.5} if variant == "lite-scaled" else {}
    cfg = hf_config(variant.removesuffix("-scaled")).to_dict() | extra
    weights = random_weights(cfg, seed=7)
    apart, fused = tiny_model(cfg, TorchOps()), tiny_model(cfg, FusingOps())
    for model in (apart, fused):
        model.load_weights(weights.items())
    g = torch.Generator().manual_seed(8)
    for layer_apart, layer_fused in zip(
        [layer.mlp for layer in apart.model.layers], fused.model.layers, strict=True
    ):
        if not isinstance(layer_apart, SparseMoeBlock):
            continue
        assert isinstance(layer_apart.shared, SharedExperts)
        assert layer_fused.mlp in fused_layers(fused)
        assert layer_fused.mlp.router.scaling == layer_apart.router.scaling
        x = torch.randn(29, cfg["hidden_size"], generator=g)
        with torch.no_grad():
            want, got = layer_apart(x), layer_fused.mlp(x)
            shared = layer_apart.shared(x)
        assert rel_err(got, want) <= LAYER_RTOL
        assert (shared.abs().max() / want.abs().max()).item() > 0.1  # the shared part matters


def test_fusion_needs_the_ops_to_ask_and_unquantized_weights():
    cfg = with_defaults(preset("tiny-deepseek-v2-lite"))
    cpu = torch.device("cpu")

    def ctx(ops, quant=None) -> BuildContext:
        return BuildContext(torch.float32, cpu, None, quant or Unquantized(), ops)

    class Quantized(Unquantized):
        name = "fp8"

    assert fuses_shared_experts(cfg, ctx(FusingOps()))
    assert not fuses_shared_experts(cfg, ctx(TorchOps()))
    assert not fuses_shared_experts(cfg, ctx(FusingOps(), Quantized()))
    assert not fuses_shared_experts(cfg | {"n_shared_experts": 0}, ctx(FusingOps()))
    assert not fuses_shared_experts(cfg | {"n_shared_experts": None}, ctx(FusingOps()))
    mlp = DeepseekV2ForCausalLM.build_mlp(cfg, 1, ctx(FusingOps(), Quantized()))
    assert isinstance(mlp.shared, SharedExperts) and mlp.experts.spec.shared == 0


def test_fused_shared_experts_missing_and_wrong_tensors_are_named():
    """A fused layer's shared tensors are required (by the experts' slots), shapes and kinds
    checked against the published layout."""
    cfg = with_defaults(preset("tiny-deepseek-v2-lite"))
    weights = random_weights(cfg, seed=9)
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    with pytest.raises(ValueError, match=r"lacks shared expert 0's down_proj\.weight"):
        tiny_model(cfg, FusingOps()).load_weights((n, t) for n, t in weights.items() if n != name)
    wrong = weights | {name: weights[name][:, :-8]}  # [H, 2 I] short of 8 columns
    with pytest.raises(ValueError, match=f"'{name}' has shape"):
        tiny_model(cfg, FusingOps()).load_weights(wrong.items())
    extra = "model.layers.1.mlp.shared_experts.down_proj.bias"
    with pytest.raises(ValueError, match=f"unexpected checkpoint tensor '{extra}'"):
        tiny_model(cfg, FusingOps()).load_weights([*weights.items(), (extra, torch.zeros(8))])
    tiny_model(cfg, FusingOps()).load_weights(weights.items())


def test_decodes_in_the_plain_form_give_the_same_tokens(checkpoint, expected, monkeypatch):
    """The absorbed decode and the plain form agree closely enough that greedy tokens are the
    same whichever form decodes."""
    monkeypatch.setattr(TorchAttention, "absorbed_decode", False)
    assert generate(make_llm(checkpoint[0])) == expected


def _random_mla(
    heads: int, nope: int, rope: int, v: int, rank: int, dtype: torch.dtype, seed: int
) -> tuple[MLAWeights, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv_b = torch.randn(heads * (nope + v), rank, generator=g, dtype=dtype) / rank**0.5
    w = kv_b.view(heads, nope + v, rank)
    mla = MLAWeights(nope, v, lambda latent: (latent @ kv_b.t()).view(-1, heads, nope + v))
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    return mla, kv_b


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("context", [1, 37, 300])
def test_absorbed_form_equals_plain_form(dtype: torch.dtype, tol: float, context: int):
    """Random queries (one and several rows that see the whole context) over random latent
    rows with V2-Lite's widths: the absorbed form (scores against the latent, W_UV after)
    equals the plain form (latents expanded to per-head keys and values) to `tol` relative to
    the output's largest element: rounding only (fp64 1e-12, fp32 2e-6)."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    mla, _ = _random_mla(heads, nope, rope, v, rank, dtype, seed=context)
    g = torch.Generator().manual_seed(100 + context)
    scale = softmax_scale(preset("deepseek-v2-lite"))
    for rows in (1, 3):
        q = torch.randn(rows, heads, nope + rope, generator=g, dtype=dtype)
        cache_rows = torch.randn(context, rank + rope, generator=g, dtype=dtype)
        plain = mla_plain(q, cache_rows, mla, scale)
        absorbed = mla_absorbed(q, cache_rows, mla, scale)
        assert plain.shape == absorbed.shape == (rows, heads, v)
        assert rel_err(absorbed, plain) <= tol


def test_plain_form_is_causal_attention_over_expanded_keys():
    """mla_plain with a causal mask against attention written out in float64: keys = the
    expanded nope key beside the shared rope key, values = the expanded values."""
    heads, nope, rope, v, rank = 3, 8, 4, 6, 10
    mla, kv_b = _random_mla(heads, nope, rope, v, rank, torch.float64, seed=1)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, heads, nope + rope, generator=g, dtype=torch.float64)
    rows = torch.randn(9, rank + rope, generator=g, dtype=torch.float64)
    mask = torch.arange(9)[None, :] <= torch.arange(4, 9)[:, None]  # the last 5 of 9 tokens
    out = mla_plain(q, rows, mla, 0.3, mask=mask)
    kv = (rows[:, :rank] @ kv_b.t()).view(9, heads, nope + v)
    keys = torch.cat([kv[..., :nope], rows[:, None, rank:].expand(-1, heads, -1)], -1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * 0.3
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    want = torch.einsum("hqk,khv->qhv", probs, kv[..., nope:])
    assert rel_err(out, want) <= 1e-12


def test_latent_cache_bytes_per_token():
    """One row of kv_lora_rank + qk_rope_head_dim = 576 values a token a layer, one KV group
    of its own: 576 * 2 B * 27 layers for V2-Lite in bf16."""
    layers = DeepseekV2ForCausalLM.kv_layout(preset("deepseek-v2-lite"))
    assert len(layers) == 27
    assert layers[0] == KVLayerSpec(16, 1, 576, kind="mla", v_head_dim=512, rope_dim=64)
    assert [(g.kind, len(g.layers)) for g in kv_groups(layers)] == [("mla", 27)]
    block = 16
    backend = TorchAttention(layers, block, torch.bfloat16, torch.device("cpu"))
    assert backend.bytes_per_block() == 576 * 2 * 27 * block
    backend = TorchAttention(layers[:2], block, torch.float32, torch.device("cpu"))
    backend.allocate(3)
    allocated = sum(c.numel() * c.element_size() for c in backend.caches)
    assert allocated == 3 * backend.bytes_per_block() == 3 * block * 576 * 4 * 2


def test_flashinfer_refuses_mla_widths_it_lacks_at_start_up(checkpoint):
    """FlashInfer's MLA kernels take DeepSeek's widths (latent 512, rope 64) only: the tiny
    checkpoint's 32 and 8 are a start-up error naming them (tests/test_flashinfer_mla.py)."""
    pytest.importorskip("inferx_kernels_cuda")
    pytest.importorskip("triton")
    with pytest.raises(LoadError, match="kv_lora_rank 512 .*layer 0 has 32 and 8"):
        make_llm(checkpoint[0], **{"engine.attention_backend": "flashinfer"})


def test_routing_rules():
    """greedy / group-limited picks, routed_scaling_factor, and DeepSeek's norm_topk_prob
    (renormalized weights, then no scaling)."""
    cfg = {"n_routed_experts": 8, "num_experts_per_tok": 2, "routed_scaling_factor": 16.0}
    assert router_spec(cfg) == RouterSpec(8, 2, scaling=16.0)
    assert router_spec(cfg | {"norm_topk_prob": True}) == RouterSpec(8, 2, renormalize=True)
    grouped = cfg | {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1}
    spec = router_spec(grouped)
    assert (spec.num_groups, spec.topk_groups, spec.group_score) == (4, 1, "max")
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 2.95, 0.0, 0.0, 0.0]])
    weights, ids = route(logits, spec)
    assert sorted(ids[0].tolist()) == [0, 1]  # group 0 holds the best; 2.95 is in group 2
    probs = logits.softmax(-1)[0]
    assert torch.allclose(weights[0].sort().values, 16 * probs[[0, 1]].sort().values)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("topk_method", "noaux_tc"),
        ("scoring_func", "sigmoid"),
        ("attention_bias", True),
        ("rope_interleave", False),
        ("hidden_act", "gelu"),
    ],
)
def test_unsupported_config_keys_are_named(key: str, value: Any):
    cfg = preset("tiny-deepseek-v2") | {key: value}
    with pytest.raises(NotImplementedError, match=f"{key} = {value!r}"):
        with_defaults(cfg)


def test_softmax_scale_follows_mscale_all_dim():
    lite = preset("deepseek-v2-lite")
    m = 0.1 * 0.707 * math.log(40) + 1
    assert softmax_scale(lite) == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert softmax_scale(lite | {"rope_scaling": None}) == pytest.approx(192**-0.5, rel=1e-12)


@pytest.mark.parametrize("name", ["tiny-deepseek-v2", "tiny-deepseek-v2-lite"])
def test_checkpoint_command_writes_a_loadable_preset(tmp_path: Path, capsys, name: str):
    arch = check_preset_command(name, tmp_path, capsys, PROMPTS[4], RTOL)
    assert arch is DeepseekV2ForCausalLM


def test_v2_lite_preset_has_the_published_shapes():
    shapes = DeepseekV2ForCausalLM.checkpoint_shapes(preset("deepseek-v2-lite"))
    p = "model.layers."
    assert shapes[p + "0.self_attn.q_proj.weight"] == (16 * 192, 2048)
    assert shapes[p + "0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2048)
    assert shapes[p + "0.self_attn.kv_b_proj.weight"] == (16 * 256, 512)
    assert shapes[p + "0.self_attn.o_proj.weight"] == (2048, 16 * 128)
    assert shapes[p + "0.mlp.gate_proj.weight"] == (10944, 2048)
    assert shapes[p + "26.mlp.experts.63.down_proj.weight"] == (2048, 1408)
    assert shapes[p + "26.mlp.shared_experts.gate_proj.weight"] == (2816, 2048)
    assert shapes[p + "26.mlp.gate.weight"] == (64, 2048)
    assert "model.layers.0.mlp.experts.0.up_proj.weight" not in shapes
    assert shapes["lm_head.weight"] == (102400, 2048)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert 15.6e9 < total < 15.8e9  # "15.7B total parameters"


@pytest.mark.gpu
def test_dummy_v2_lite_matches_transformers_on_the_gpu(tmp_path: Path):
    """V2-Lite's shapes (4 of its 27 layers: the dense one and three MoE), random weights, bf16
    on the GPU with the torch backend, a batch of four prompts, 64 tokens each: equal to
    transformers until the first divergence, and there each side's token in the other's top-5
    (test_gpu_correctness's check; transformers keeps the router in float32, we in bf16)."""
    dummy_v2_lite_matches_transformers(tmp_path, "torch", cuda_graphs=False)


def dummy_v2_lite_matches_transformers(tmp_path: Path, backend: str, cuda_graphs: bool) -> LLM:
    """V2-Lite's shapes (4 layers) with random weights in bf16 on the GPU, on `backend`: four
    prompts (one of 300 tokens), 64 greedy tokens each, test_gpu_correctness's check against
    transformers. Returns the LLM, for what a caller checks of its executor."""
    from test_gpu_correctness import TOP, check_close, hf_greedy, ours_greedy

    from inferx_models.presets import write_checkpoint

    config = preset("deepseek-v2-lite") | {"num_hidden_layers": 4}
    path = write_checkpoint(config, tmp_path / "v2-lite", dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ref = ref.cuda().eval()
    overrides = {
        "model.path": str(path),
        "engine.device": "cuda",
        "model.dtype": "bfloat16",
        "engine.attention_backend": backend,
        "engine.cuda_graphs": cuda_graphs,
        "kv_cache.memory": "4GiB",
    }
    llm = LLM(load_config(None, overrides))
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3], [100 + 997 * i % 100000 for i in range(300)]]
    got = ours_greedy(llm, prompts)
    assert TOP == 5 and all(len(g) == 64 for g in got)
    for p, g in zip(prompts, got, strict=True):
        check_close(g, hf_greedy(ref, p), f"deepseek-v2-lite-dummy/{backend}")
    return llm
