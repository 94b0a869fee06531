"""FP8 W8A8 (inferx_quant.fp8) on the CPU: the reference path's numerics against float64, and
tiny random models quantized into the layouts people publish (compressed-tensors FP8_DYNAMIC,
Hugging Face block-wise fp8) and online, each against a reference engine holding the exact
dequantized weights: greedy tokens agree in vLLM's top-5 sense."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.executor import LoadError, pick_quant_scheme
from inferx_core.interfaces.quant import LinearSpec, QuantConfig
from inferx_core.parallel import ParallelContext
from inferx_core.plugins import plugins
from inferx_core.quant_none import DenseLinear
from inferx_core.sequence import SamplingParams
from inferx_quant.fp8 import FP8, Fp8, Fp8Format, Fp8Linear

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
FMAX = 448.0

# llm-compressor's FP8_DYNAMIC quantization_config, as it writes it into config.json
FP8_DYNAMIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "global_compression_ratio": None,
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "float-quantized",
            "output_activations": None,
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
                "group_size": None,
                "block_structure": None,
                "actorder": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
                "group_size": None,
                "block_structure": None,
                "actorder": None,
                "observer": None,
                "observer_kwargs": {},
            },
        }
    },
}
# Qwen3-FP8's and DeepSeek-V3's
HF_BLOCK = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


# --- the float64 reference: stored e4m3 values times their scales, activations quantized the
# documented way (scale = max(absmax / 448, 1 / (448 * 512)) in float32, x / scale rounded) ---


def ref_act(x: torch.Tensor, how: str, group: int = 128, static: float = 0.0) -> torch.Tensor:
    """x [M, K] quantized to e4m3 and back, in float64."""
    xf = x.float()
    if how == "none":
        return xf.double()
    if how == "static":
        scale = torch.full((1, 1), static)
    elif how == "tensor":
        scale = (xf.abs().max() / FMAX).clamp(min=1 / (FMAX * 512)).reshape(1, 1)
    elif how == "token":
        scale = (xf.abs().amax(1, keepdim=True) / FMAX).clamp(min=1 / (FMAX * 512))
    else:  # per token per group of columns
        cols = [
            (g.abs().amax(1, keepdim=True) / FMAX).clamp(min=1 / (FMAX * 512)).expand_as(g)
            for g in xf.split(group, 1)
        ]
        scale = torch.cat(cols, 1)
    q = (xf / scale).clamp(-FMAX, FMAX).to(FP8)
    return q.double() * scale.double()


def block_scale_rows(scale: torch.Tensor, rows: int, cols: int, b: int = 128) -> torch.Tensor:
    return scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:rows, :cols]


def quantize_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As llm-compressor's FP8_DYNAMIC: scale [out, 1] in the model's dtype (bfloat16)."""
    scale = (w.float().abs().amax(1, keepdim=True) / FMAX).to(torch.bfloat16)
    return (w.float() / scale.float()).clamp(-FMAX, FMAX).to(FP8), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().max() / FMAX).reshape(1)
    return (w.float() / scale).clamp(-FMAX, FMAX).to(FP8), scale


def quantize_block(w: torch.Tensor, b: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """As Qwen3-FP8: scale_inv float32 [ceil(out/b), ceil(in/b)], w ≈ q * scale_inv."""
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / b), math.ceil(cols / b))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * b : (i + 1) * b, j * b : (j + 1) * b].float().abs().max() / FMAX
    q = (w.float() / block_scale_rows(scale, rows, cols, b)).clamp(-FMAX, FMAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: bool) -> torch.Tensor:
    """The exact weight a quantized tensor stands for, float32 (e4m3 times a bfloat16 or
    float32 scale, rounded once to float32 as the layer rounds it)."""
    if block:
        scale = block_scale_rows(scale.float(), *q.shape)
    return q.float() * scale.float()


# --- (a) one layer against the reference ---

QKV = LinearSpec(
    "model.layers.0.self_attn.qkv_proj",
    320,  # two and a half blocks of columns
    (256, 128, 128),
    bias=True,
    parallel="column",
    part_names=("q_proj", "k_proj", "v_proj"),
)
LAYOUTS = {
    "channel-token": Fp8Format("channel", "token"),
    "tensor-static": Fp8Format("tensor", "static"),
    "tensor-tensor": Fp8Format("tensor", "tensor"),
    "channel-weight-only": Fp8Format("channel", "none"),
    "block-group": Fp8Format("block", "group", (128, 128), inverse_name=True),
}


def loaded_layer(fmt: Fp8Format, spec=QKV, parallel=None, dtype=torch.float32, seed: int = 0):
    """An Fp8Linear loaded with random parts; -> (layer, whole dequantized weight float64,
    whole bias, the static input scale)."""
    gen = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(spec, dtype, CPU, parallel or ParallelContext(), fmt)
    quant = {"channel": quantize_channel, "tensor": quantize_tensor, "block": quantize_block}
    weights, biases, input_scales = [], [], []
    for part, rows in enumerate(spec.output_sizes):
        w = torch.randn(rows, spec.in_features, generator=gen) * 0.05
        q, scale = quant[fmt.weights](w)
        layer.load("weight", q, part)
        layer.load(fmt.scale_kind, scale, part)
        weights.append(dequantize(q, scale, fmt.weights == "block").double())
        if fmt.activations == "static":
            input_scales.append(0.02 + 0.01 * part)
            layer.load("input_scale", torch.tensor([input_scales[-1]]), part)
        if spec.bias:
            biases.append(torch.randn(rows, generator=gen))
            layer.load("bias", biases[-1], part)
    layer.finish_loading()
    bias = torch.cat(biases) if spec.bias else None
    return layer, torch.cat(weights), bias, max(input_scales, default=0.0)


@pytest.mark.parametrize("name", LAYOUTS)
def test_forward_equals_the_float64_reference(name: str) -> None:
    """The reference path is exact up to float32 accumulation: 1e-5 of the output's scale."""
    fmt = LAYOUTS[name]
    layer, w, bias, static = loaded_layer(fmt)
    assert layer.dense_weight() is None
    assert layer.weight.dtype == FP8
    torch.testing.assert_close(layer.dequantized_weight().double(), w, rtol=1e-7, atol=0)
    x = torch.randn(2, 5, QKV.in_features) * 3
    x[0, 0] = 0  # an all-zero token keeps a finite scale
    got = layer(x)
    want = ref_act(x.reshape(-1, QKV.in_features), fmt.activations, static=static) @ w.t()
    want = (want + bias.double()).reshape(2, 5, -1)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())
    # the activations' quantization is modelled: a float64 GEMM without it differs visibly
    if fmt.activations != "none":
        plain = (x.reshape(-1, QKV.in_features).double() @ w.t() + bias.double()).reshape_as(want)
        assert (got.double() - plain).abs().max() > 1e-3 * plain.abs().max()


def test_bfloat16_activations_come_back_bfloat16() -> None:
    layer, w, bias, _ = loaded_layer(LAYOUTS["channel-token"], dtype=torch.bfloat16)
    x = torch.randn(3, QKV.in_features)
    got = layer(x.bfloat16())
    want = (ref_act(x.bfloat16(), "token") @ w.t()).bfloat16() + bias.bfloat16()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def fake_rank(rank: int) -> ParallelContext:
    return ParallelContext(rank, 2, group=object())  # sharding only: no collective runs


@pytest.mark.parametrize("name", ["channel-token", "tensor-static", "block-group"])
@pytest.mark.parametrize("style", ["column", "row"])
def test_tensor_parallel_shards_hold_the_whole(name: str, style: str) -> None:
    """Two ranks' shards of the weights and scales, put back together, are the whole layer's:
    per-channel scales split with the rows (column) or stay whole (row), blocks by blocks."""
    fmt = LAYOUTS[name]
    spec = LinearSpec("model.layers.0.mlp.gate_up_proj", 512, (256, 256), False, style, ("a", "b"))
    whole = loaded_layer(fmt, spec)[0].dequantized_weight()
    shards = [loaded_layer(fmt, spec, fake_rank(r))[0].dequantized_weight() for r in (0, 1)]
    if style == "row":
        torch.testing.assert_close(torch.cat(shards, 1), whole, rtol=0, atol=0)
    else:  # each rank holds its half of each part
        rows = [s.split(128) for s in shards]
        parts = torch.cat([rows[0][0], rows[1][0], rows[0][1], rows[1][1]])
        torch.testing.assert_close(parts, whole, rtol=0, atol=0)


def test_blocks_that_do_not_align_are_refused() -> None:
    fmt = LAYOUTS["block-group"]
    spec = LinearSpec(
        "model.layers.0.mlp.gate_up_proj", 256, (192, 192), False, "column", ("g", "u")
    )
    with pytest.raises(ValueError, match="model.layers.0.mlp.u: .*block of 128 rows"):
        Fp8Linear(spec, torch.float32, CPU, ParallelContext(), fmt)
    spec = LinearSpec("model.layers.0.mlp.down_proj", 384, (256,), False, "row")
    with pytest.raises(ValueError, match="input columns start at 192"):
        Fp8Linear(spec, torch.float32, CPU, fake_rank(1), fmt)


def test_a_missing_scale_is_named() -> None:
    layer = Fp8Linear(QKV, torch.float32, CPU, ParallelContext(), LAYOUTS["tensor-static"])
    for part, rows in enumerate(QKV.output_sizes):
        q, scale = quantize_tensor(torch.randn(rows, QKV.in_features))
        layer.load("weight", q, part)
        layer.load("bias", torch.zeros(rows), part)
        if part != 1:
            layer.load("weight_scale", scale, part)
        layer.load("input_scale", torch.tensor([0.1]), part)
    with pytest.raises(
        ValueError, match=r"lacks model\.layers\.0\.self_attn\.k_proj\.weight_scale"
    ):
        layer.finish_loading()


def test_wrong_payloads_are_refused() -> None:
    layer = Fp8Linear(QKV, torch.float32, CPU, ParallelContext(), LAYOUTS["channel-token"])
    with pytest.raises(ValueError, match=r"q_proj\.weight is torch.float32, expected float8"):
        layer.load("weight", torch.randn(256, 320), 0)
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale: checkpoint shape \(3, 1\)"):
        layer.load("weight_scale", torch.ones(3, 1), 1)
    with pytest.raises(ValueError, match="has no 'weight_scale_inv' tensor"):
        layer.load("weight_scale_inv", torch.ones(2, 3), 0)


def test_online_quantizes_per_channel_at_load() -> None:
    layer = Fp8Linear(QKV, torch.float32, CPU, ParallelContext(), online=True)
    w = torch.randn(512, 320) * 0.1
    w[3] = 0  # an all-zero row stays zero
    for part, chunk in enumerate(w.split(list(QKV.output_sizes))):
        layer.load("weight", chunk, part)
        layer.load("bias", torch.zeros(chunk.shape[0]), part)
    layer.finish_loading()
    q, scale = layer.weight, layer.weight_scale
    assert q.dtype == FP8 and scale.shape == (512,)
    torch.testing.assert_close(scale, w.abs().amax(1).clamp(min=torch.finfo().tiny) / FMAX)
    assert layer.dequantized_weight()[3].eq(0).all()
    # e4m3 keeps 3 mantissa bits: every weight within half a step (1/16) of its value
    err = (layer.dequantized_weight() - w).abs()
    assert (err <= w.abs() / 16 + scale[:, None] * 2**-9).all()


# --- the scheme: configs, ignore lists, refusals, GPU check ---


def spec_of(prefix: str) -> LinearSpec:
    return LinearSpec(prefix, 64, (64,))


def test_compressed_tensors_config_and_ignore_list() -> None:
    cfg = json.loads(json.dumps(FP8_DYNAMIC))
    cfg["ignore"] = ["lm_head", "re:.*mlp\\.down_proj"]
    scheme = Fp8(QuantConfig(cfg))
    layer = scheme.linear(spec_of("model.layers.0.self_attn.o_proj"), torch.float32, CPU)
    assert isinstance(layer, Fp8Linear) and layer.fmt == Fp8Format("channel", "token")
    dense = scheme.linear(spec_of("model.layers.1.mlp.down_proj"), torch.float32, CPU)
    assert type(dense) is DenseLinear


def test_config_groups_target_layers_by_name() -> None:
    cfg = json.loads(json.dumps(FP8_DYNAMIC))
    static = json.loads(json.dumps(cfg["config_groups"]["group_0"]))
    static["targets"] = ["re:.*self_attn.*"]
    static["weights"]["strategy"] = "tensor"
    static["input_activations"].update(strategy="tensor", dynamic=False)
    cfg["config_groups"]["group_1"] = static
    cfg["config_groups"]["group_0"]["targets"] = ["re:.*mlp.*"]
    scheme = Fp8(QuantConfig(cfg))
    attn = scheme.linear(spec_of("model.layers.0.self_attn.o_proj"), torch.float32, CPU)
    mlp = scheme.linear(spec_of("model.layers.0.mlp.down_proj"), torch.float32, CPU)
    other = scheme.linear(spec_of("model.layers.0.other"), torch.float32, CPU)
    assert attn.fmt == Fp8Format("tensor", "static") and mlp.fmt == Fp8Format("channel", "token")
    assert type(other) is DenseLinear  # no group targets it


def test_hf_fp8_configs() -> None:
    block = Fp8(QuantConfig(dict(HF_BLOCK, modules_to_not_convert=["model.layers.0.mlp.gate"])))
    layer = block.linear(spec_of("model.layers.0.mlp.down_proj"), torch.float32, CPU)
    assert layer.fmt == Fp8Format("block", "group", (128, 128), inverse_name=True)
    assert type(block.linear(spec_of("model.layers.0.mlp.gate"), torch.float32, CPU)) is DenseLinear
    static = Fp8(QuantConfig({"quant_method": "fp8", "activation_scheme": "static"}))
    assert static.linear(spec_of("x.y"), torch.float32, CPU).fmt == Fp8Format("tensor", "static")


def _edited(edit) -> dict:
    cfg = json.loads(json.dumps(FP8_DYNAMIC))
    edit(cfg, cfg["config_groups"]["group_0"])
    return cfg


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c, g: g["weights"].update(num_bits=4), "group_0.weights.num_bits/type"),
        (lambda c, g: g["weights"].update(strategy="group"), "group_0.weights.strategy"),
        (lambda c, g: g["weights"].update(symmetric=False), "group_0.weights.symmetric"),
        (
            lambda c, g: g["input_activations"].update(strategy="group", group_size=128),
            "group_0.input_activations.strategy",
        ),
        (lambda c, g: g["input_activations"].update(dynamic=False), "input_activations.strategy"),
        (lambda c, g: g.update(targets=["Embedding"]), "group_0.targets"),
        (lambda c, g: c.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (lambda c, g: c.update(format="int-quantized"), "group_0.format"),
    ],
)
def test_unsupported_compressed_tensors_configs_are_refused(edit, key: str) -> None:
    cfg = _edited(edit)
    if key == "group_0.format":
        del cfg["config_groups"]["group_0"]["format"]
    with pytest.raises(ValueError, match=rf"quantization_config\.\S*{key} = .* is not supported"):
        Fp8(QuantConfig(cfg))


def test_unsupported_hf_fp8_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="quantization_config.fmt = 'e5m2'"):
        Fp8(QuantConfig(dict(HF_BLOCK, fmt="e5m2")))
    with pytest.raises(ValueError, match="activation_scheme = 'static'.*block-wise FP8 is dynamic"):
        Fp8(QuantConfig(dict(HF_BLOCK, activation_scheme="static")))


def test_an_unknown_quant_method_names_the_known_ones() -> None:
    with pytest.raises(LoadError, match=r"'bitsandbytes'.*fp8 \(float-quantized, fp8\)"):
        pick_quant_scheme("auto", {"quant_method": "bitsandbytes"}, plugins())
    assert pick_quant_scheme("auto", FP8_DYNAMIC, plugins()) == "fp8"
    assert pick_quant_scheme("auto", HF_BLOCK, plugins()) == "fp8"
    assert pick_quant_scheme("fp8", {}, plugins()) == "fp8"  # online


def test_gpus_without_fp8_tensor_cores_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"FP8 tensor cores \(sm_89\+\); this GPU .* is sm_80"):
        Fp8(QuantConfig(FP8_DYNAMIC)).linear(spec_of("a.b"), torch.bfloat16, torch.device("cuda"))


# --- (b, c, d) whole models through the engine, against the exact dequantized weights ---

NEW_TOKENS = 32
PROMPTS = [list(range(3, 40)), [5, 9, 17, 33, 65, 129, 200], list(range(100, 150))]
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(path, hidden: int, heads: int, kv_heads: int, inter: int, positions: int = 512):
    """A random Llama written by transformers in float32; its weights are spread wider than
    the default init so that greedy tokens are well apart."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return path


def write_projections(src, dst, quant_config: dict | None, quantize, skip=()) -> tuple:
    """dst: src with each projection's weight (a PROJ layer not named in `skip`) replaced by
    the tensors quantize(name, weight) gives, and quant_config in config.json; -> (dst, the
    reference: src with each such weight replaced by the exact dequantized weight that
    quantize gives beside them)."""
    ref = dst.parent / f"{dst.name}-reference"
    for d in (dst, ref):
        shutil.copytree(src, d)
    quantized_names = {}  # a sharded checkpoint's index: where each new tensor lies
    for shard in sorted(src.glob("*.safetensors")):
        quantized, dequantized = {}, {}
        for name, t in load_file(shard).items():
            base = name.removesuffix(".weight")
            if base.rpartition(".")[2] in PROJ and name.endswith(".weight") and base not in skip:
                tensors, dequantized[name] = quantize(name, t)
                quantized |= tensors
            else:
                quantized[name] = dequantized[name] = t
        save_file(quantized, dst / shard.name)
        save_file(dequantized, ref / shard.name)
        quantized_names |= dict.fromkeys(quantized, shard.name)
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        doc = json.loads(index.read_text())
        doc["weight_map"] = quantized_names
        index.write_text(json.dumps(doc))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst, ref


def write_quantized(src, dst, quant_config: dict | None, quantize, scale_name: str, skip=()):
    """write_projections with each projection's weight quantized (quantize(w) -> q, scale) and
    its scale beside it as `scale_name`."""

    def fp8(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q, scale = quantize(w)
        scales = {f"{name.removesuffix('.weight')}.{scale_name}": scale}
        return {name: q} | scales, dequantize(q, scale, quantize is quantize_block)

    return write_projections(src, dst, quant_config, fp8, skip)


def make_llm(path, **overrides) -> LLM:
    base = {"model.path": str(path), "model.dtype": "float32", "engine.device": "cpu"}
    return LLM(load_config(None, {**base, **overrides}))


def run(llm: LLM) -> list[tuple[list[int], list[list[int]]]]:
    """Per prompt: the greedy tokens and each step's top-5 token ids."""
    done = llm.generate(PROMPTS, PARAMS)
    return [(c.token_ids, [[t for t, _ in top] for _, top in c.logprobs]) for c in done]


def agree_in_top5(got, want) -> None:
    """vLLM's check: the tokens are identical up to the first divergence, and there each
    side's token is in the other's top 5; nothing after it is compared."""
    for (tokens_a, top_a), (tokens_b, top_b) in zip(got, want, strict=True):
        assert len(tokens_a) == len(tokens_b) == NEW_TOKENS
        for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=True)):
            if a != b:
                assert a in top_b[i] and b in top_a[i], (i, tokens_a, tokens_b)
                break


def layers_of(llm: LLM) -> dict[str, torch.nn.Module]:
    model = llm.engine.executor.model
    return {n: m for n, m in model.named_modules() if n.endswith("proj")}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"), 64, 4, 2, 128)


@pytest.fixture(scope="module")
def llama128(tmp_path_factory):
    """Dims in whole 128 blocks, as block-wise checkpoints have them: q 256 rows, k and v 128."""
    return tiny_llama(tmp_path_factory.mktemp("llama128"), 256, 2, 1, 384)


def test_fp8_dynamic_checkpoint_agrees_with_its_dequantized_weights(llama, tmp_path) -> None:
    cfg = json.loads(json.dumps(FP8_DYNAMIC))
    cfg["ignore"] = ["lm_head", "model.layers.1.mlp.down_proj"]
    skip = {"model.layers.1.mlp.down_proj"}
    quant, ref = write_quantized(
        llama, tmp_path / "fp8", cfg, quantize_channel, "weight_scale", skip
    )
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
    llm = make_llm(quant)
    layers = layers_of(llm)
    assert isinstance(layers["model.layers.0.self_attn.qkv_proj"], Fp8Linear)
    assert type(layers["model.layers.1.mlp.down_proj"]) is DenseLinear  # (f) ignored
    agree_in_top5(run(llm), run(make_llm(ref)))


def test_block_fp8_checkpoint_agrees_with_its_dequantized_weights(llama128, tmp_path) -> None:
    quant, ref = write_quantized(
        llama128, tmp_path / "block", HF_BLOCK, quantize_block, "weight_scale_inv"
    )
    stored = load_file(quant / "model.safetensors")
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    assert stored["model.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.float32
    llm = make_llm(quant)
    qkv = layers_of(llm)["model.layers.0.self_attn.qkv_proj"]
    assert qkv.fmt.weights == "block" and qkv.weight_scale.shape == (4, 2)
    agree_in_top5(run(llm), run(make_llm(ref)))


def test_online_fp8_agrees_with_the_unquantized_model(llama) -> None:
    llm = make_llm(llama, **{"quantization.scheme": "fp8"})
    assert isinstance(layers_of(llm)["model.layers.0.mlp.down_proj"], Fp8Linear)
    agree_in_top5(run(llm), run(make_llm(llama)))


def test_a_checkpoint_missing_a_scale_names_it(llama, tmp_path) -> None:
    quant, _ = write_quantized(
        llama, tmp_path / "fp8", FP8_DYNAMIC, quantize_channel, "weight_scale"
    )
    tensors = load_file(quant / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight_scale"]
    save_file(tensors, quant / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks model\.layers\.1\.self_attn\.v_proj\.weight_scale"
    ):
        make_llm(quant)


def test_scales_keep_their_stored_dtype_under_a_bfloat16_model(llama128, tmp_path) -> None:
    """The safetensors reader casts weights to the serving dtype but not a float32 scale, whose
    rounding to bfloat16 would move every weight of its block."""
    from inferx_models.formats import SafetensorsFormat

    quant, _ = write_quantized(
        llama128, tmp_path / "block", HF_BLOCK, quantize_block, "weight_scale_inv"
    )
    weights = dict(SafetensorsFormat().open(quant, torch.bfloat16).weights)
    assert weights["model.layers.0.mlp.up_proj.weight_scale_inv"].dtype == torch.float32
    assert weights["model.layers.0.mlp.up_proj.weight"].dtype == FP8
    assert weights["model.norm.weight"].dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["dynamic", "block", "online"])
def test_fp8_gemms_on_the_gpu_agree_with_the_dequantized_weights(
    kind, llama, llama128, tmp_path
) -> None:
    """The GPU path (inferx_kernels_cuda.fp8_gemm: cuBLASLt and Triton) in bfloat16, with CUDA
    graphs, against the bfloat16 model holding the exact dequantized weights."""
    gpu = {"engine.device": "cuda", "model.dtype": "bfloat16", "kv_cache.memory": "1GiB"}
    if kind == "dynamic":
        quant, ref = write_quantized(
            llama, tmp_path / "q", FP8_DYNAMIC, quantize_channel, "weight_scale"
        )
    elif kind == "block":
        quant, ref = write_quantized(
            llama128, tmp_path / "q", HF_BLOCK, quantize_block, "weight_scale_inv"
        )
    else:
        quant, ref = llama, llama
        gpu["quantization.scheme"] = "fp8"
    llm = make_llm(quant, **gpu)
    assert isinstance(layers_of(llm)["model.layers.0.mlp.down_proj"], Fp8Linear)
    reference = {k: v for k, v in gpu.items() if k != "quantization.scheme"}
    agree_in_top5(run(llm), run(make_llm(ref, **reference)))
