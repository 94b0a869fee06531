"""Activation quantization fused into RMSNorm and SiLU-and-mul (inferx_kernels_cuda.fp8_act,
TritonOps.rms_norm_quant / silu_and_mul_quant) for the FP8 layers after them (Fp8Linear's
input_quant): the fused kernels against the unfused pair (the op's kernel, then
fp8_gemm.quantize_rows, what the layer ran itself) bit for bit, against the torch reference
(TorchOps: the op, then quant_utils.quantize_e4m3), and tiny FP8 models generating the same
tokens with the fusion on and off. On the CPU in Triton's interpreter; on a GPU as they are."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from test_fp8 import (  # noqa: E402
    FP8_DYNAMIC,
    HF_BLOCK,
    PROMPTS,
    layers_of,
    loaded_layer,
    make_llm,
    quantize_block,
    quantize_channel,
    tiny_llama,
    write_quantized,
)
from test_fp8 import PARAMS as LONG_PARAMS  # noqa: E402

from inferx_core.interfaces.quant import (  # noqa: E402
    ActivationQuant,
    QuantizedActivation,
    input_quant,
)
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402
from inferx_kernels_cuda import fp8_act  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402
from inferx_quant.fp8 import Fp8Format, Fp8Linear  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# No bf16 under the interpreter: it rounds fp32 -> bf16 toward zero (test_kernel_ops).
DTYPES = [torch.float16, torch.float32] if DEVICE.type == "cpu" else [torch.bfloat16, torch.float16]


def reference_comparable(dtype: torch.dtype) -> bool:
    """Whether the torch reference's op agrees with the kernel's closely enough for
    assert_near_reference: not in bf16, where a one-ulp flip of a row's largest value moves
    its scale by 2**-8 and every code of the row with it."""
    return dtype != torch.bfloat16


def specs() -> list[ActivationQuant]:
    static = torch.tensor([0.004], device=DEVICE)  # small: many values saturate at +-448
    return [
        ActivationQuant("token"),
        ActivationQuant("group", 128),
        ActivationQuant("static", 0, static),
    ]


SPEC_IDS = ["token", "group", "static"]


def ops(fused: bool) -> TritonOps:
    out = TritonOps()
    out.fuse_act_quant = fused
    return out


def codes(q: QuantizedActivation) -> torch.Tensor:
    return q.data.view(torch.uint8).cpu()


def assert_same(got: QuantizedActivation, want: QuantizedActivation) -> None:
    """Bit for bit: the e4m3 bytes, the scales, the shape and the activations' dtype."""
    assert got.data.dtype == torch.float8_e4m3fn and got.shape == want.shape
    assert got.dtype == want.dtype and got.spec is want.spec
    assert torch.equal(codes(got), codes(want))
    assert torch.equal(got.scale.cpu(), want.scale.cpu())


def assert_near_reference(got: QuantizedActivation, ref: QuantizedActivation) -> None:
    """Against the torch reference, whose op rounds like the kernel's but computes rsqrt, exp
    and sums its own way: its scales within 2 ulps of float32, its e4m3 codes equal except
    for values the op put on the other side of a rounding boundary (one code apart, rare)."""
    assert got.shape == ref.shape and got.scale.shape == ref.scale.shape
    scale_err = ((got.scale.cpu() - ref.scale) / ref.scale).abs().max().item()
    assert scale_err <= 2 * 2**-23, scale_err
    a, b = codes(got).to(torch.int16), codes(ref).to(torch.int16)
    differ = a != b
    assert differ.float().mean().item() <= 0.01
    assert ((a - b).abs()[differ] == 1).all()  # same sign bit, neighbouring magnitudes


def norm_inputs(parts: int, rows: int, n: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(parts, rows, n, generator=g) * 3
    residual = torch.randn(rows, n, generator=g) * 5
    weight = 1 + 0.3 * torch.randn(n, generator=g)
    return (t.to(DEVICE, dtype) for t in (x, residual, weight))


# --- the kernels ---


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_index", range(3), ids=SPEC_IDS)
@pytest.mark.parametrize("n,parts", [(256, 1), (300, 3), (96, 2)])
def test_norm_quant_equals_the_norm_then_quantize_rows(dtype, spec_index, n, parts) -> None:
    """300 columns: the last group of 128 narrower; 96: one group narrower than 128; parts:
    down_proj's K-slices summed first, as rms_norm(parts=True)."""
    spec = specs()[spec_index]
    x, residual, weight = norm_inputs(parts, 5, n, dtype, n + parts)
    got, got_sum = ops(True).rms_norm_quant(x, weight, 1e-6, spec, residual, parts=True)
    want, want_sum = ops(False).rms_norm_quant(x, weight, 1e-6, spec, residual, parts=True)
    assert_same(got, want)
    assert torch.equal(got_sum, want_sum)  # the residual stream as rms_norm writes it
    if reference_comparable(dtype):
        ref, ref_sum = TorchOps().rms_norm_quant(
            x.cpu(), weight.cpu(), 1e-6, spec, residual.cpu(), True
        )
        assert_near_reference(got, ref)
        assert torch.equal(got_sum.cpu(), ref_sum)


@pytest.mark.parametrize("spec_index", range(3), ids=SPEC_IDS)
def test_norm_quant_without_a_residual(spec_index) -> None:
    """A model's first layer: the embeddings normed alone."""
    spec = specs()[spec_index]
    x, _, weight = norm_inputs(1, 3, 384, DTYPES[0], 5)
    got = ops(True).rms_norm_quant(x[0], weight, 1e-5, spec)
    assert isinstance(got, QuantizedActivation)
    assert_same(got, ops(False).rms_norm_quant(x[0], weight, 1e-5, spec))


def silu_input(rows: int, half: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * half, generator=g) * 3).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec_index", range(3), ids=SPEC_IDS)
@pytest.mark.parametrize("half", [384, 1100])
def test_silu_quant_equals_silu_then_quantize_rows(dtype, spec_index, half) -> None:
    """1100 columns: two column blocks per row (group, static), the last group narrower."""
    spec = specs()[spec_index]
    x = silu_input(4, half, dtype, half)
    got = ops(True).silu_and_mul_quant(x, spec)
    assert_same(got, ops(False).silu_and_mul_quant(x, spec))
    if reference_comparable(dtype):
        assert_near_reference(got, TorchOps().silu_and_mul_quant(x.cpu(), spec))


def test_silu_quant_per_token_in_two_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past SILU_ONE_TILE_MAX columns: the absmax pass, then the quantizing pass."""
    monkeypatch.setattr(fp8_act, "SILU_ONE_TILE_MAX", 256)
    monkeypatch.setattr(fp8_act, "SILU_LOOP_BLOCK", 128)
    x = silu_input(3, 600, DTYPES[0], 3)
    spec = ActivationQuant("token")
    assert_same(ops(True).silu_and_mul_quant(x, spec), ops(False).silu_and_mul_quant(x, spec))


def test_zero_rows_keep_a_finite_scale() -> None:
    weight = torch.ones(128, device=DEVICE, dtype=DTYPES[0])
    zeros = torch.zeros(2, 128, device=DEVICE, dtype=DTYPES[0])
    for spec in specs()[:2]:
        for q in (
            ops(True).rms_norm_quant(zeros, weight, 1e-6, spec),
            ops(True).silu_and_mul_quant(torch.zeros(2, 256, device=DEVICE, dtype=DTYPES[0]), spec),
        ):
            assert torch.isfinite(q.scale).all() and (q.data.float() == 0).all()


def test_a_group_that_is_no_power_of_two_takes_the_reference() -> None:
    """fp8_act reshapes a tile into groups: 96 columns a group falls back to the reference."""
    spec = ActivationQuant("group", 96)
    assert not fp8_act.fusable("group", 96)
    x, residual, weight = norm_inputs(1, 2, 192, DTYPES[0], 9)
    triton_ops = ops(True)
    got, _ = triton_ops.rms_norm_quant(x, weight, 1e-6, spec, residual, parts=True)
    normed, _ = triton_ops.rms_norm(x, weight, 1e-6, residual, parts=True)
    assert got.scale.shape == (2, 2)
    assert_same(got, spec.quantize(normed))


# --- the contract ---


def layer(fmt: Fp8Format, seed: int = 0) -> Fp8Linear:
    return loaded_layer(fmt, seed=seed)[0]


def test_layers_advertise_the_input_they_take() -> None:
    token = layer(Fp8Format("channel", "token"))
    assert token.input_quant is not None and token.input_quant.granularity == "token"
    block = layer(Fp8Format("block", "group", (128, 128)))
    assert block.input_quant.group == 128
    assert layer(Fp8Format("channel", "tensor")).input_quant is None  # needs every row first
    assert layer(Fp8Format("channel", "none")).input_quant is None  # weight-only
    static_a = layer(Fp8Format("tensor", "static"))
    static_b = layer(Fp8Format("tensor", "static"))
    assert static_a.input_quant.static_scale is static_a.input_scale
    assert input_quant(token, layer(Fp8Format("channel", "token"))) is token.input_quant
    assert input_quant(static_a, static_a) is static_a.input_quant
    assert input_quant(static_a, static_b) is None  # two scales: each quantizes its own
    assert input_quant(token, block) is None
    assert input_quant(token, torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize(
    "fmt",
    [
        Fp8Format("channel", "token"),
        Fp8Format("tensor", "static"),
        Fp8Format("block", "group", (128, 128), inverse_name=True),
    ],
    ids=["token", "static", "group"],
)
def test_a_layer_takes_its_quantized_input_as_the_plain_one(fmt: Fp8Format) -> None:
    """The CPU reference layer: pre-quantized rows give the very output of plain rows."""
    fp8 = layer(fmt, seed=3)
    x = torch.randn(2, 3, fp8.weight.shape[1]) * 2
    pre = fp8.input_quant.quantize(x)
    assert pre.data.shape == x.shape and pre.dtype == x.dtype
    assert torch.equal(fp8(pre), fp8(x))
    assert torch.equal(fp8.forward_parts(pre), fp8.forward_parts(x))


def test_a_layer_refuses_input_quantized_for_another() -> None:
    fp8 = layer(Fp8Format("channel", "token"))
    x = torch.randn(2, fp8.weight.shape[1])
    with pytest.raises(ValueError, match="quantized as 'group'"):
        fp8(ActivationQuant("group", 128).quantize(x))
    with pytest.raises(ValueError, match="static"):
        ActivationQuant("static")


# --- whole models: the fusion on and off, under the interpreter ---

# Few and short: every kernel runs in the interpreter.
MODEL_PROMPTS = PROMPTS[:2]
PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"), 64, 4, 2, 128)


@pytest.fixture(scope="module")
def llama128(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama128"), 256, 2, 1, 384)


def with_static_scales(path):
    """The FP8_DYNAMIC checkpoint at path made static per tensor: an input_scale per layer
    from the absmax of random activations of its width (not calibrated; what matters is
    that every norm's and activation's output is quantized by it)."""
    cfg = json.loads((path / "config.json").read_text())
    group = cfg["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"].update(strategy="tensor", dynamic=False)
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        base = name.removesuffix(".weight_scale")
        tensors[f"{base}.input_scale"] = torch.tensor([0.02 if "down" in base else 0.01])
    save_file(tensors, path / "model.safetensors")
    return path


def quantized_model(kind: str, llama, llama128, tmp_path):
    if kind == "block":
        path, _ = write_quantized(
            llama128, tmp_path / "q", HF_BLOCK, quantize_block, "weight_scale_inv"
        )
        return path
    path, _ = write_quantized(llama, tmp_path / "q", FP8_DYNAMIC, quantize_channel, "weight_scale")
    return with_static_scales(path) if kind == "static" else path


_TRITON_OPS_INIT = TritonOps.__init__


def fusion(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """Engines built after this get TritonOps with fuse_act_quant = on."""

    def init(self: TritonOps) -> None:
        _TRITON_OPS_INIT(self)
        self.fuse_act_quant = on

    monkeypatch.setattr(TritonOps, "__init__", init)


def count_quantized_inputs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records each Fp8Linear forward that received a QuantizedActivation, by layer."""
    seen: list[str] = []
    original = Fp8Linear._forward_quantized

    def spy(self, x):
        seen.append(self.spec.prefix)
        return original(self, x)

    monkeypatch.setattr(Fp8Linear, "_forward_quantized", spy)
    return seen


@interpreted
@pytest.mark.parametrize("kind", ["token", "block", "static"])
def test_fp8_model_generates_the_same_tokens_with_the_fusion(
    kind, llama, llama128, tmp_path, monkeypatch
) -> None:
    """A tiny FP8 Llama on TritonOps (float32, the torch attention): every qkv, gate_up and
    down_proj takes pre-quantized rows, and greedy tokens and top-5 logprobs equal those of
    the unfused kernels (the norm or SiLU-and-mul, then quantize_rows), bit for bit."""
    path = quantized_model(kind, llama, llama128, tmp_path)
    fused_calls = []
    original = fp8_act.rms_norm_quant_kernel.run

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8_act.rms_norm_quant_kernel, "run", counted)
    seen = count_quantized_inputs(monkeypatch)
    outputs = []
    for fused in (True, False):
        fusion(monkeypatch, fused)
        outputs.append(
            make_llm(path, **{"engine.kernels": "triton"}).generate(MODEL_PROMPTS, PARAMS)
        )
        assert bool(fused_calls) == fused
        layers = {p.rpartition(".")[2] for p in seen}
        assert layers == {"qkv_proj", "gate_up_proj", "down_proj"}, layers
        fused_calls.clear()
        seen.clear()
    got, want = outputs
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


@interpreted
def test_fp8_model_with_the_fusion_agrees_with_the_torch_reference(llama, tmp_path) -> None:
    """TritonOps' fused path against TorchOps' reference order: the tokens agree in the top-5
    sense (the ops differ by float32 summation order and rsqrt, so a near tie may turn)."""
    path = quantized_model("token", llama, None, tmp_path)
    ours = make_llm(path, **{"engine.kernels": "triton"}).generate(MODEL_PROMPTS, PARAMS)
    theirs = make_llm(path).generate(MODEL_PROMPTS, PARAMS)
    for a, b in zip(ours, theirs, strict=True):
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                assert x in dict(b.logprobs[i][1]) and y in dict(a.logprobs[i][1]), i
                break


@interpreted
@pytest.mark.parametrize("spec_index", range(3), ids=SPEC_IDS)
def test_pdl_variants_write_the_same(spec_index: int, monkeypatch) -> None:
    """The kernels as a decode chain launches them where PDL is on (rms_norm_quant_kernel
    waiting and triggering, silu_and_mul_quant_kernel and quant_rows_kernel triggering; the
    interpreter runs the grid-dependency calls as no-ops): the same bits as plain launches."""
    from inferx_kernels_cuda import ops as ops_module
    from inferx_kernels_cuda.fp8_gemm import quantize_rows

    spec = specs()[spec_index]
    x, residual, weight = norm_inputs(4, 3, 96, torch.float16, 5)
    h = silu_input(3, 200, torch.float16, 6)
    launched = []
    runs = {
        "norm": lambda: ops(True).rms_norm_quant(x, weight, 1e-6, spec, residual, parts=True),
        "silu": lambda: (ops(True).silu_and_mul_quant(h, spec), None),
    }
    want = {name: run() for name, run in runs.items()}

    def early(*args, **kwargs):
        launched.append(kwargs.get("norm", False))
        return {"PDL": True, "TRIGGER": True} if kwargs.get("norm") else {"TRIGGER": True}

    monkeypatch.setattr(ops_module, "between_launch", early)
    for name, run in runs.items():
        got_q, got_sum = run()
        assert_same(got_q, want[name][0])
        if got_sum is not None:
            assert torch.equal(got_sum, want[name][1])
    assert launched == [True, False]  # the norm waits too; SiLU-and-mul only triggers
    (q, scale), (plain_q, plain_scale) = (quantize_rows(h[:, :100], trigger=t) for t in (1, 0))
    assert torch.equal(q.view(torch.uint8), plain_q.view(torch.uint8))
    assert torch.equal(scale, plain_scale)


# --- on a GPU (compiled kernels, bf16) ---


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("spec_index", range(3), ids=SPEC_IDS)
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_gpu_kernels_at_3b_shapes(spec_index: int, rows: int) -> None:
    """Qwen2.5-3B's widths (hidden 2048, intermediate 11008) in bf16: fused equals unfused bit
    for bit, and the norm's residual stream too."""
    spec = specs()[spec_index]
    x, residual, weight = norm_inputs(4, rows, 2048, torch.bfloat16, rows)
    got, got_sum = ops(True).rms_norm_quant(x, weight, 1e-6, spec, residual, parts=True)
    want, want_sum = ops(False).rms_norm_quant(x, weight, 1e-6, spec, residual, parts=True)
    assert_same(got, want)
    assert torch.equal(got_sum, want_sum)
    h = silu_input(rows, 11008, torch.bfloat16, rows + 1)
    assert_same(ops(True).silu_and_mul_quant(h, spec), ops(False).silu_and_mul_quant(h, spec))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("kind", ["token", "block", "static"])
def test_gpu_fp8_model_same_tokens_with_the_fusion(
    kind, llama, llama128, tmp_path, monkeypatch
) -> None:
    """The tiny FP8 Llama in bf16 on the GPU with CUDA graphs: the same greedy tokens with
    the fusion on and off (the same e4m3 bytes reach the same GEMMs)."""
    path = quantized_model(kind, llama, llama128, tmp_path)
    gpu = {
        "engine.device": "cuda",
        "model.dtype": "bfloat16",
        "kv_cache.memory": "1GiB",
        "engine.attention_backend": "triton",
    }
    outputs = []
    for fused in (True, False):
        fusion(monkeypatch, fused)
        llm = make_llm(path, **gpu)
        assert isinstance(layers_of(llm)["model.layers.0.mlp.down_proj"], Fp8Linear)
        assert llm.engine.executor.graphs is not None
        outputs.append([c.token_ids for c in llm.generate(PROMPTS, LONG_PARAMS)])
        del llm
        torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]
