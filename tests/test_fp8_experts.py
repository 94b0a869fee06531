"""FP8 MoE experts (inferx_quant.fp8_experts) on the CPU: the layer against float64 on its exact
dequantized weights, loading per expert and stacked, tensor-parallel shards, the scheme's
choices and refusals; tiny Qwen3-MoE models in llm-compressor's FP8_DYNAMIC layout and online
FP8 against references through the engine (greedy tokens agree in vLLM's top-5 sense); the
fused Triton kernels on the layer's ExpertWeights under the interpreter; and on a GPU the
quantized model against its dequantized weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from conftest import interpreted, on_gpu  # noqa: E402
from experts_reference import gen, moe_layers, reference, rel, routing, shapes  # noqa: E402
from test_fp8 import (  # noqa: E402
    FP8_DYNAMIC,
    agree_in_top5,
    block_scale_rows,
    fake_rank,
    make_llm,
    quantize_block,
    quantize_channel,
    quantize_tensor,
    run,
    write_quantized,
)
from test_qwen3 import hf_model  # noqa: E402

from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_core.interfaces.moe import ExpertsSpec, RouterSpec  # noqa: E402
from inferx_core.interfaces.quant import LinearSpec, QuantConfig  # noqa: E402
from inferx_core.moe import UnquantizedExperts, route  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.parallel import ParallelContext  # noqa: E402
from inferx_core.quant_none import DenseLinear  # noqa: E402
from inferx_quant.fp8 import FP8, Fp8, Fp8Format  # noqa: E402
from inferx_quant.fp8_experts import Fp8Experts  # noqa: E402

CPU = torch.device("cpu")
SPEC = ExpertsSpec("model.layers.0.mlp.experts", 4, 64, 48)
SWIGLU = ExpertsSpec("model.layers.0.mlp.experts", 4, 64, 48, "swiglu_oai", bias=True)
# blocks of 32 x 32 over hidden 80 and intermediate 64: partial blocks along H
BSPEC = ExpertsSpec("model.layers.0.mlp.experts", 4, 80, 64)
BLOCK = Fp8Format("block", "group", (32, 32), inverse_name=True)
PARTS = ("gate", "up", "down")
# llm-compressor's FP8_DYNAMIC for a MoE model: the routers left alone, as its recipes do
MOE_DYNAMIC = dict(json.loads(json.dumps(FP8_DYNAMIC)), ignore=["lm_head", "re:.*mlp.gate$"])


def quantize_block32(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_block(w, 32)


def random_experts(spec: ExpertsSpec, seed: int, quantize=quantize_channel):
    """Per expert and projection: (e4m3, its scale as the checkpoint stores it, the exact
    dequantized weight in float64), and biases where the spec has them."""
    g = gen(seed)
    weights = {}
    for e in range(spec.num_experts):
        for part, shape in shapes(spec).items():
            q, scale = quantize(torch.randn(shape, generator=g) * 0.2)
            if quantize is quantize_block32:
                full = block_scale_rows(scale.double(), *shape, 32)
            else:
                full = scale.double().reshape(-1, 1)
            weights[e, part] = (q, scale, q.double() * full)
    biases = {}
    if spec.bias:
        for e in range(spec.num_experts):
            for part, (rows, _) in shapes(spec).items():
                biases[e, part] = torch.randn(rows, generator=g)
    return weights, biases


def loaded(
    spec: ExpertsSpec, weights, biases, parallel=None, stacked=False, fmt=None
) -> Fp8Experts:
    experts = Fp8Experts(spec, torch.float32, CPU, parallel or ParallelContext(), fmt)
    kind = experts.fmt.scale_kind
    if stacked:  # one tensor over all experts, gate and up fused in the activation's layout
        for part in ("gate_up", "down"):
            names = ("gate", "up") if part == "gate_up" else ("down",)
            per_expert = []
            for what in (0, 1):  # weight, scale
                tensors = []
                for e in range(spec.num_experts):
                    rows = [shapes(spec)[p][0] for p in names]
                    pieces = [
                        weights[e, p][what].float().reshape(-1, 1) if what else weights[e, p][0]
                        for p, r in zip(names, rows, strict=True)
                    ]
                    if what and fmt is not None:  # block scales, stacked by their rows
                        pieces = [weights[e, p][1] for p in names]
                    elif what:  # a per-tensor scale written out per row
                        pieces = [t.expand(r, 1) for t, r in zip(pieces, rows, strict=True)]
                    tensors.append(fuse(spec, pieces) if part == "gate_up" else pieces[0])
                per_expert.append(torch.stack(tensors))
            experts.load(f"{part}.weight", per_expert[0])
            experts.load(f"{part}.{kind}", per_expert[1])
    else:
        for (e, part), (q, scale, _) in weights.items():
            experts.load(f"{part}.weight", q, e)
            experts.load(f"{part}.{kind}", scale, e)
    for (e, part), b in biases.items():
        experts.load(f"{part}.bias", b, e)
    experts.finish_loading()
    return experts


def fuse(spec: ExpertsSpec, pieces: list[torch.Tensor]) -> torch.Tensor:
    if spec.activation == "silu":
        return torch.cat(pieces)
    return torch.stack(pieces, 1).flatten(0, 1)  # interleaved rows


# --- the layer ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [SPEC, SWIGLU], ids=["silu", "swiglu_oai"])
@pytest.mark.parametrize("quantize", [quantize_channel, quantize_tensor], ids=["channel", "tensor"])
@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_forward_equals_float64_on_the_dequantized_weights(spec, quantize, stacked) -> None:
    """The reference path is exact up to float32 accumulation: 1e-5 of the output's scale."""
    weights, biases = random_experts(spec, seed=1, quantize=quantize)
    experts = loaded(spec, weights, biases, stacked=stacked)
    assert experts.gate_up.dtype == FP8 and experts.gate_up_scale.shape == (4, 96)
    check_forward(experts, spec, weights, biases)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_block_scales_equal_float64_on_the_dequantized_weights(stacked) -> None:
    """Hugging Face block scales (32 x 32 here, partial blocks at the edge of H), each
    block's scale kept for each of its rows."""
    weights, biases = random_experts(BSPEC, seed=12, quantize=quantize_block32)
    experts = loaded(BSPEC, weights, biases, stacked=stacked, fmt=BLOCK)
    assert experts.gate_up_scale.shape == (4, 128, 3) and experts.down_scale.shape == (4, 80, 2)
    w = check_forward(experts, BSPEC, weights, biases)
    assert w.scale_block_k == 32


def check_forward(experts, spec, weights, biases):
    x = torch.randn(9, spec.hidden_size, generator=gen(2))
    topk_weights, topk_ids = routing(9, spec, 2, seed=3)
    got = experts(x, topk_weights, topk_ids)
    want = reference(x, topk_weights, topk_ids, spec, weights, biases)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert rel(got, want) < 1e-5
    w = experts.expert_weights()
    assert w.format == "fp8" and w.gate_up_scales is experts.gate_up_scale
    return w


def test_block_scales_split_with_the_ranks_columns() -> None:
    """Rank 1 of 2 holds intermediate columns 32..63 of down, with its scale block; a share
    that does not start on a block is refused, naming weight_block_size."""
    weights, biases = random_experts(BSPEC, seed=13, quantize=quantize_block32)
    whole = loaded(BSPEC, weights, biases, fmt=BLOCK)
    rank = loaded(BSPEC, weights, biases, fake_rank(1), fmt=BLOCK)
    assert rank.down_scale.shape == (4, 80, 1)
    for e in range(BSPEC.num_experts):
        want = whole.weight("down", e)[:, 32:]
        torch.testing.assert_close(rank.weight("down", e), want, rtol=0, atol=0)
        torch.testing.assert_close(
            rank.weight("gate_up", e)[:32], whole.weight("gate_up", e)[32:64]
        )
    fmt = Fp8Format("block", "group", (64, 64), inverse_name=True)
    with pytest.raises(ValueError, match="starts at 32, not on a weight_block_size block of 64"):
        Fp8Experts(BSPEC, torch.float32, CPU, fake_rank(1), fmt)


def test_tensor_parallel_shards_hold_the_whole() -> None:
    """Two ranks' slices of each expert's gate / up rows and down columns are the whole
    layer's; the down scales (per row of H) are whole on each; the ranks' outputs sum to it."""
    weights, biases = random_experts(SWIGLU, seed=4)
    whole = loaded(SWIGLU, weights, biases)
    ranks = [loaded(SWIGLU, weights, biases, fake_rank(r)) for r in (0, 1)]
    n = SWIGLU.intermediate_size // 2
    for e in range(SWIGLU.num_experts):
        down = torch.cat([r.weight("down", e) for r in ranks], 1)
        torch.testing.assert_close(down, whole.weight("down", e), rtol=0, atol=0)
        gate = torch.cat([r.weight("gate_up", e)[0::2] for r in ranks])  # interleaved rows
        torch.testing.assert_close(gate, whole.weight("gate_up", e)[0::2], rtol=0, atol=0)
    assert ranks[0].gate_up.shape == (4, 2 * n, 64) and ranks[1].down_bias is None
    x = torch.randn(5, 64, generator=gen(5))
    topk_weights, topk_ids = routing(5, SWIGLU, 2, seed=6)
    summed = sum(r(x, topk_weights, topk_ids) for r in ranks)
    torch.testing.assert_close(summed, whole(x, topk_weights, topk_ids), rtol=1e-5, atol=1e-5)


def test_online_quantizes_whole_rows_at_load() -> None:
    """Unquantized weights, per expert or stacked: one scale per row of the whole projection
    (absmax / 448), so that rank 1's slice of down holds what one GPU would."""
    g = gen(7)
    w = {p: torch.randn(SPEC.num_experts, *s, generator=g) * 0.1 for p, s in shapes(SPEC).items()}
    stacked = Fp8Experts(SPEC, torch.float32, CPU, online=True)
    stacked.load("gate_up.weight", torch.cat([w["gate"], w["up"]], 1))
    stacked.load("down.weight", w["down"])
    stacked.finish_loading()
    per_expert = Fp8Experts(SPEC, torch.float32, CPU, fake_rank(1), online=True)
    for e in range(SPEC.num_experts):
        for p in PARTS:
            per_expert.load(f"{p}.weight", w[p][e], e)
    per_expert.finish_loading()
    scale = w["down"].abs().amax(-1) / 448
    torch.testing.assert_close(stacked.down_scale, scale)
    torch.testing.assert_close(per_expert.down_scale, scale)
    half = slice(24, 48)
    for e in range(SPEC.num_experts):
        want = stacked.weight("down", e)[:, half]
        torch.testing.assert_close(per_expert.weight("down", e), want, rtol=0, atol=0)
        # e4m3 keeps 3 mantissa bits: every weight within half a step (1/16) of its value
        err = (stacked.weight("down", e) - w["down"][e]).abs()
        assert (err <= w["down"][e].abs() / 16 + scale[e, :, None] * 2**-9).all()
    with pytest.raises(ValueError, match="online FP8 experts have no 'down.weight_scale'"):
        stacked.load("down.weight_scale", torch.ones(64, 1), 0)


def test_missing_and_wrong_tensors_are_named() -> None:
    weights, _ = random_experts(SPEC, seed=8)
    experts = Fp8Experts(SPEC, torch.float32, CPU)
    for (e, part), (q, scale, _) in weights.items():
        experts.load(f"{part}.weight", q, e)
        if (e, part) != (2, "up"):
            experts.load(f"{part}.weight_scale", scale, e)
    with pytest.raises(ValueError, match=r"lacks model\.layers\.0\.mlp\.experts\.2\.up_proj\.w"):
        experts.finish_loading()
    with pytest.raises(ValueError, match=r"down\.weight is torch.float32, expected float8"):
        experts.load("down.weight", torch.randn(64, 48), 0)
    with pytest.raises(ValueError, match=r"gate\.weight_scale of expert 1 has shape \(3, 1\)"):
        experts.load("gate.weight_scale", torch.ones(3, 1), 1)
    with pytest.raises(ValueError, match="FP8 experts have no 'gate.input_scale'"):
        experts.load("gate.input_scale", torch.ones(1), 1)


# --- the scheme -----------------------------------------------------------------------------------


def test_the_scheme_builds_fp8_experts_and_leaves_routers_alone() -> None:
    scheme = Fp8(QuantConfig(MOE_DYNAMIC))
    assert isinstance(scheme.experts(SPEC, torch.float32, CPU), Fp8Experts)
    gate = LinearSpec("model.layers.0.mlp.gate", 64, (4,))
    assert type(scheme.linear(gate, torch.float32, CPU)) is DenseLinear
    online = Fp8(QuantConfig({}))
    assert type(online.linear(gate, torch.float32, CPU)) is DenseLinear
    assert isinstance(online.experts(SPEC, torch.float32, CPU), Fp8Experts)
    ignored = dict(MOE_DYNAMIC, ignore=["re:.*mlp.gate$", "re:.*mlp\\.experts\\..*"])
    experts = Fp8(QuantConfig(ignored)).experts(SPEC, torch.float32, CPU)
    assert type(experts) is UnquantizedExperts
    block = Fp8(QuantConfig(hf_block(16))).experts(SPEC, torch.float32, CPU)
    assert isinstance(block, Fp8Experts) and block.block == (16, 16)
    assert block.fmt.scale_kind == "weight_scale_inv"


def hf_block(size: int) -> dict:
    """Hugging Face's fp8 config (Qwen3-FP8's) with blocks of size x size over the routed
    experts only: attention, the dense MLP and the routers left out (the tiny model's attention
    rows do not fall on blocks of 32; test_fp8 covers block-scaled linear layers)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [size, size],
        "modules_to_not_convert": ["lm_head", "re:.*self_attn\\..*", "re:.*\\.mlp\\.[a-z_]+"],
    }


def test_layouts_the_kernels_do_not_read_are_refused() -> None:
    half = dict(MOE_DYNAMIC, ignore=["re:.*mlp.gate$", "re:.*experts\\.3\\.down_proj"])
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj unquantized.*one layout"):
        Fp8(QuantConfig(half)).experts(SPEC, torch.float32, CPU)
    by_name = dict(MOE_DYNAMIC, ignore=["lm_head", "model.layers.0.mlp.experts.2.up_proj"])
    with pytest.raises(ValueError, match=r"experts\.2\.up_proj unquantized.*one layout"):
        Fp8(QuantConfig(by_name)).experts(SPEC, torch.float32, CPU)
    static = json.loads(json.dumps(MOE_DYNAMIC))
    static["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    static["config_groups"]["group_0"]["input_activations"].update(strategy="tensor", dynamic=False)
    with pytest.raises(ValueError, match="static activation scales"):
        Fp8(QuantConfig(static)).experts(SPEC, torch.float32, CPU)


# --- whole models through the engine --------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Qwen3-MoE of 3 layers (0 and 2 routed over 8 experts, top-2), per-expert tensors."""
    path = tmp_path_factory.mktemp("qwen3-moe")
    hf_model("qwen3-moe").save_pretrained(path)
    return path


def test_auto_attention_on_cuda_takes_torch_for_the_tiny_qwen3_moe(qwen3_moe) -> None:
    """The fixture's head_dim (24) is no power of two: engine.attention_backend auto on a GPU
    must not pick the triton backend, which refuses it (the GPU test below failed at start-up
    so); torch takes it. A power-of-two head_dim still gets triton. No GPU needed: the pick
    reads the layout only."""
    pytest.importorskip("triton")
    from inferx_core.executor import pick_attention_backend
    from inferx_core.plugins import plugins

    reg = plugins()
    arch = reg.get("model_arch", "Qwen3MoeForCausalLM")
    layers = arch.kv_layout(json.loads((qwen3_moe / "config.json").read_text()))
    assert {s.head_dim for s in layers} == {24}
    cuda = torch.device("cuda")
    assert pick_attention_backend("auto", cuda, reg, layers, "Qwen3MoeForCausalLM") == "torch"
    pow2 = [KVLayerSpec(s.num_q_heads, s.num_kv_heads, 32) for s in layers]
    assert pick_attention_backend("auto", cuda, reg, pow2) == "triton"
    assert pick_attention_backend("auto", CPU, reg, layers) == "torch"


def test_fp8_dynamic_moe_checkpoint_agrees_with_its_dequantized_weights(qwen3_moe, tmp_path):
    quant, ref = write_quantized(
        qwen3_moe, tmp_path / "fp8", MOE_DYNAMIC, quantize_channel, "weight_scale"
    )
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.2.mlp.experts.7.down_proj.weight"].dtype == FP8
    assert stored["model.layers.2.mlp.experts.7.down_proj.weight_scale"].shape == (64, 1)
    assert stored["model.layers.2.mlp.gate.weight"].dtype == torch.float32  # the router
    llm = make_llm(quant)
    for mlp in moe_layers(llm):
        assert isinstance(mlp.experts, Fp8Experts) and type(mlp.gate) is DenseLinear
    agree_in_top5(run(llm), run(make_llm(ref)))


def write_block32(src, dst):
    """src with the routed experts quantized in 32 x 32 blocks as Hugging Face's fp8 stores
    them; -> (dst, the reference with the dequantized weights)."""
    ref = dst.parent / f"{dst.name}-reference"
    for d in (dst, ref):
        shutil.copytree(src, d)
    quantized, dequantized = {}, {}
    for name, t in load_file(src / "model.safetensors").items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and ".mlp.experts." in name:
            q, scale = quantize_block(t, 32)
            quantized[name], quantized[f"{base}.weight_scale_inv"] = q, scale
            dequantized[name] = q.float() * block_scale_rows(scale, *t.shape, 32)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, dst / "model.safetensors")
    save_file(dequantized, ref / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = hf_block(32)
    (dst / "config.json").write_text(json.dumps(config))
    return dst, ref


def test_block_fp8_moe_checkpoint_agrees_with_its_dequantized_weights(qwen3_moe, tmp_path):
    quant, ref = write_block32(qwen3_moe, tmp_path / "block")
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.0.mlp.experts.1.down_proj.weight_scale_inv"].shape == (2, 1)
    assert stored["model.layers.0.mlp.experts.1.up_proj.weight_scale_inv"].shape == (1, 2)
    llm = make_llm(quant)
    for mlp in moe_layers(llm):
        assert isinstance(mlp.experts, Fp8Experts) and mlp.experts.block == (32, 32)
        assert type(mlp.gate) is DenseLinear
    agree_in_top5(run(llm), run(make_llm(ref)))


def test_online_fp8_moe_agrees_with_the_unquantized_model(qwen3_moe):
    llm = make_llm(qwen3_moe, **{"quantization.scheme": "fp8"})
    for mlp in moe_layers(llm):
        assert isinstance(mlp.experts, Fp8Experts) and type(mlp.gate) is DenseLinear
    agree_in_top5(run(llm), run(make_llm(qwen3_moe)))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """test_deepseek_v2's tiny V2-Lite (8 routed experts, top 3, 2 shared; layers 1, 2 MoE)."""
    from test_deepseek_v2 import hf_model as deepseek_model

    path = tmp_path_factory.mktemp("deepseek-v2-lite")
    deepseek_model("lite").save_pretrained(path)
    return path


def test_fp8_deepseek_keeps_its_shared_experts_apart(deepseek, tmp_path, monkeypatch):
    """Kernel ops that ask for shared experts as expert slots (fuse_shared_experts) get them
    only with unquantized weights: an FP8_DYNAMIC checkpoint (experts and shared MLP
    quantized per channel, attention left alone) and online FP8 keep the shared MLP a layer
    of its own, which loads its scales and agrees with the dequantized weights, whose model
    (unquantized) does hold the slots."""
    attention = {
        n.removesuffix(".weight")
        for n in load_file(deepseek / "model.safetensors")
        if ".self_attn." in n
    }
    config = dict(MOE_DYNAMIC, ignore=[*MOE_DYNAMIC["ignore"], "re:.*self_attn.*"])
    quant, ref = write_quantized(
        deepseek, tmp_path / "fp8", config, quantize_channel, "weight_scale", skip=attention
    )
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.1.mlp.shared_experts.down_proj.weight"].dtype == FP8
    assert stored["model.layers.1.mlp.shared_experts.down_proj.weight_scale"].shape == (64, 1)
    monkeypatch.setattr(TorchOps, "fuse_shared_experts", True)

    def moe(llm):
        return [layer.mlp for layer in llm.engine.executor.model.model.layers[1:]]

    llm, online, dequantized = (
        make_llm(quant),
        make_llm(deepseek, **{"quantization.scheme": "fp8"}),
        make_llm(ref),
    )
    for mlp in moe(llm) + moe(online):
        assert isinstance(mlp.experts, Fp8Experts) and mlp.experts.spec.shared == 0
        assert mlp.shared is not None and mlp.router.shared == 0
    assert type(moe(llm)[0].shared.down_proj).__name__ == "Fp8Linear"
    for mlp in moe(dequantized):
        assert isinstance(mlp.experts, UnquantizedExperts) and mlp.experts.spec.shared == 2
        assert mlp.shared is None
    agree_in_top5(run(llm), run(dequantized))
    agree_in_top5(run(online), run(make_llm(deepseek)))


# --- the fused kernels on the layer's ExpertWeights -----------------------------------------------


@interpreted
@pytest.mark.parametrize("spec", ["silu", "swiglu_oai", "block"])
@pytest.mark.parametrize("tokens", [1, 11])
def test_fused_kernels_equal_the_layers_reference(spec, tokens) -> None:
    """TritonOps.moe_experts (one token: a tile per pair; more: grouped by expert) on
    Fp8Experts' ExpertWeights (per row, or per row per 32 columns) against the layer's own
    forward, fp32 activations: summation order apart they compute the same products, within
    2e-5 of the output's scale."""
    from inferx_kernels_cuda.ops import TritonOps

    fmt = BLOCK if spec == "block" else None
    spec = {"silu": SPEC, "swiglu_oai": SWIGLU, "block": BSPEC}[spec]
    weights, biases = random_experts(spec, 9, quantize_block32 if fmt else quantize_channel)
    experts = loaded(spec, weights, biases, fmt=fmt)
    x = torch.randn(tokens, spec.hidden_size, generator=gen(10))
    topk_weights, topk_ids = routing(tokens, spec, 2, seed=11)
    want = experts(x, topk_weights, topk_ids)

    def no_fallback(*args):
        raise AssertionError("the fused kernels fell back to the layer's forward")

    experts.forward = no_fallback
    got = TritonOps().moe_experts(experts, x, topk_weights, topk_ids)
    assert got.dtype == torch.float32
    assert rel(got, want.double()) < 2e-5
    assert rel(got, reference(x, topk_weights, topk_ids, spec, weights, biases)) < 2e-5


# --- on a GPU -------------------------------------------------------------------------------------


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dynamic", "block", "online"])
def test_gpu_fp8_moe_agrees_with_the_dequantized_weights(kind, qwen3_moe, tmp_path) -> None:
    """The fused Triton MoE kernels' fp8 path (per-row and 32 x 32 block scales) in bfloat16
    with CUDA graphs, against the bfloat16 model holding the exact dequantized weights (online:
    the unquantized model)."""
    gpu = {"engine.device": "cuda", "model.dtype": "bfloat16", "kv_cache.memory": "1GiB"}
    if kind == "dynamic":
        quant, ref = write_quantized(
            qwen3_moe, tmp_path / "q", MOE_DYNAMIC, quantize_channel, "weight_scale"
        )
    elif kind == "block":
        quant, ref = write_block32(qwen3_moe, tmp_path / "q")
    else:
        quant, ref = qwen3_moe, qwen3_moe
        gpu["quantization.scheme"] = "fp8"
    llm = make_llm(quant, **gpu)
    for mlp in moe_layers(llm):
        assert isinstance(mlp.experts, Fp8Experts) and mlp.experts.gate_up.is_cuda
    reference_cfg = {k: v for k, v in gpu.items() if k != "quantization.scheme"}
    agree_in_top5(run(llm), run(make_llm(ref, **reference_cfg)))


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 2048])
@pytest.mark.parametrize("block", [False, True], ids=["per-row", "128-blocks"])
def test_gpu_fused_kernels_at_qwen3_30b_a3b_shapes(block, tokens) -> None:
    """Fp8Experts of Qwen3-30B-A3B's shape (128 experts of 2048 x 768, top-8) with random e4m3
    weights and scales, bf16 activations: the compiled kernels against the layer's float32
    reference; bf16 rounds the activation between the GEMMs and each expert's output (2e-2)."""
    from inferx_kernels_cuda.moe_kernels import fused_experts

    gpu = torch.device("cuda")
    spec = ExpertsSpec("mlp.experts", 128, 2048, 768)
    fmt = Fp8Format("block", "group", (128, 128), inverse_name=True) if block else None
    experts = Fp8Experts(spec, torch.bfloat16, gpu, fmt=fmt)
    g = torch.Generator(device=gpu).manual_seed(0)
    for name in ("gate_up", "down"):
        w = getattr(experts, name)
        w.data.copy_(torch.randn(w.shape, generator=g, device=gpu).mul_(64).to(FP8))
        s = getattr(experts, f"{name}_scale")
        s.data.uniform_(0.5e-3, 1.5e-3, generator=g)
    x = torch.randn(tokens, spec.hidden_size, device=gpu, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, spec.num_experts, device=gpu, generator=g)
    topk_weights, topk_ids = route(logits, RouterSpec(spec.num_experts, 8, renormalize=True))
    want = experts(x.float(), topk_weights, topk_ids)
    got = fused_experts(x, topk_weights, topk_ids, experts.expert_weights(), spec)
    torch.cuda.synchronize()
    assert got.dtype == torch.bfloat16
    assert rel(got, want.double()) < 2e-2
