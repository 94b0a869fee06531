"""TritonOps against TorchOps and float64, per op and in whole models, on the CPU and the GPU."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from test_models import CONFIGS, rel_err  # noqa: E402

from inferx_core import quant_none  # noqa: E402
from inferx_core.attention_torch import TorchAttention  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.interfaces.attention import AttentionBackend  # noqa: E402
from inferx_core.interfaces.model import BuildContext  # noqa: E402
from inferx_core.interfaces.ops import KernelOps  # noqa: E402
from inferx_core.interfaces.quant import LinearSpec  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_core.plugins import plugins  # noqa: E402
from inferx_core.quant_none import DenseLinear, Unquantized  # noqa: E402
from inferx_kernels_cuda import ops as triton_ops  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps, filled_slices  # noqa: E402
from inferx_kernels_cuda.triton_attention import TritonAttention  # noqa: E402
from inferx_models.layers import RotaryEmbedding, rope_parameters  # noqa: E402
from inferx_models.presets import preset  # noqa: E402

# Largest |ours - reference| over the largest |reference|. The kernels round where torch rounds,
# so in fp32 they differ from it by summation order and exp/rsqrt implementations (~1e-7 seen);
# in half precision by an occasional one-ulp flip of a rounding. Against float64, two roundings
# of half an ulp each bound the error by one ulp: 2**-10 of the row's max in fp16, 2**-7 in
# bf16. Seen on the CPU: fp16 <= 2.5e-4 against TorchOps and <= 6.8e-4 against float64.
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# No bf16 on the CPU: the interpreter rounds fp32 -> bf16 toward zero (triton 3.9), not to
# nearest as the GPU does, so its bf16 results are off by up to an ulp per rounding.
CPU = torch.device("cpu")
EPS = 1e-6


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float64 throughout: what the kernel approximates, without its roundings."""
    h = x.double()
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def norm_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual and weight; residual-stream-like magnitudes (well above 1) and a weight
    around 1, so neither the sum nor the scale is trivial."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    residual = torch.randn(shape, generator=g) * 5
    weight = 1 + 0.3 * torch.randn(shape[-1], generator=g)
    return tuple(t.to(device, dtype) for t in (x, residual, weight))  # type: ignore[return-value]


def check_rms_norm(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, with_residual: bool
) -> None:
    x, residual, weight = norm_inputs(shape, dtype, device, seed=shape[-1])
    x_before, residual_before = x.clone(), residual.clone()
    tol = TOL[dtype]
    ours: Any
    if with_residual:
        ours, summed = TritonOps().rms_norm(x, weight, EPS, residual)
        ref, ref_summed = TorchOps().rms_norm(x, weight, EPS, residual)
        # The sum is one rounding of the exact sum in x's dtype on both sides: equal bits.
        assert summed.dtype == dtype and torch.equal(summed, ref_summed)
        float64 = norm_reference(ref_summed, weight, EPS)
    else:
        ours = TritonOps().rms_norm(x, weight, EPS)
        ref = TorchOps().rms_norm(x, weight, EPS)
        float64 = norm_reference(x, weight, EPS)
    assert ours.shape == x.shape and ours.dtype == dtype
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    err = rel_err(ours, ref)
    assert err <= tol, f"{err:.2e} against TorchOps"
    err = rel_err(ours, float64)
    assert err <= tol, f"{err:.2e} against float64"


def check_silu_and_mul(rows: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 3).to(device, dtype)
    ours = TritonOps().silu_and_mul(x)
    assert ours.shape == (rows, inter) and ours.dtype == dtype
    err = rel_err(ours, TorchOps().silu_and_mul(x))
    assert err <= TOL[dtype], f"{err:.2e} against TorchOps"


def check_rotary(
    tokens: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int = 64,
) -> None:
    """q and k as the strided views a fused QKV projection gives, positions out of order and
    repeated (a batch of several sequences), cos/sin from a llama3-scaled table."""
    g = torch.Generator().manual_seed(tokens * 1000 + q_heads * 10 + head_dim)
    cfg = {
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    }
    cos_sin = RotaryEmbedding(head_dim, max_positions, rope_parameters(cfg), device).cos_sin
    positions = torch.randint(0, max_positions, (tokens,), generator=g).to(device)
    positions[-1] = max_positions - 1
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=g).to(device, dtype)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = buf.split([q_size, kv_size, kv_size], dim=-1)
        return (
            q.view(-1, q_heads, head_dim),
            k.view(-1, kv_heads, head_dim),
            v.view(-1, kv_heads, head_dim),
        )

    q_ref, k_ref = TorchOps().rotary(positions, *views(qkv)[:2], cos_sin)
    ours = qkv.clone()
    q, k, v = views(ours)
    q_out, k_out = TritonOps().rotary(positions, q, k, cos_sin)
    # In place: the results are the views passed in, and v is untouched.
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert q_out.stride() == q.stride() and k_out.stride() == k.stride()
    assert torch.equal(v, views(qkv)[2])
    for name, out, ref in (("q", q_out, q_ref), ("k", k_out, k_ref)):
        err = rel_err(out, ref)
        assert err <= TOL[dtype], f"{name}: {err:.2e} against TorchOps"


def check_rms_norm_parts(
    num_parts: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """x as partial results [S, *shape] (QuantLinear.forward_parts): both ops sum them in fp32,
    round once, then add the residual; TritonOps equals TorchOps (the sums bit for bit), and
    both equal float64 within the dtype's tolerance."""
    g = torch.Generator().manual_seed(num_parts * 1000 + shape[-1])
    parts = (torch.randn((num_parts, *shape), generator=g) * 3).to(device, dtype)
    _, residual, weight = norm_inputs(shape, dtype, device, seed=shape[-1] + 1)
    ours, summed = TritonOps().rms_norm(parts, weight, EPS, residual, parts=True)
    ref, ref_summed = TorchOps().rms_norm(parts, weight, EPS, residual, parts=True)
    assert ours.shape == shape and summed.shape == shape and ours.dtype == dtype
    assert torch.equal(summed, ref_summed)
    assert rel_err(ours, ref) <= TOL[dtype]
    exact = parts.double().sum(0) + residual.double()
    assert rel_err(summed, exact) <= TOL[dtype]
    assert rel_err(ours, norm_reference(exact, weight, EPS)) <= TOL[dtype]


# --- CPU, under the interpreter ---------------------------------------------------------------


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hidden", [576, 96, 17])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    check_rms_norm((5, hidden), dtype, CPU, with_residual)


@interpreted
def test_rms_norm_leading_dims_and_strided_rows() -> None:
    """Inputs of any leading shape, and rows that are a strided view (a slice of wider rows)."""
    check_rms_norm((2, 3, 40), torch.float32, CPU, with_residual=True)
    x, residual, weight = norm_inputs((4, 64), torch.float32, CPU, seed=1)
    x, residual = x[:, :40], residual[:, 8:48]
    assert x.stride(0) == 64 and not x.is_contiguous()
    ours, summed = TritonOps().rms_norm(x, weight[:40], EPS, residual)
    ref, ref_summed = TorchOps().rms_norm(x, weight[:40], EPS, residual)
    assert torch.equal(summed, ref_summed)
    assert rel_err(ours, ref) <= TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_parts", [1, 3, 4])
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 40), (1, 17)])
def test_rms_norm_sums_parts(dtype: torch.dtype, num_parts: int, shape: tuple[int, ...]) -> None:
    check_rms_norm_parts(num_parts, shape, dtype, CPU)


@interpreted
def test_rms_norm_parts_need_a_matching_residual() -> None:
    x, residual, weight = norm_inputs((3, 16), torch.float32, CPU, seed=3)
    for ops in (TritonOps(), TorchOps()):
        with pytest.raises(ValueError, match="parts of shape"):
            ops.rms_norm(x[None], weight, EPS, parts=True)
        with pytest.raises(ValueError, match="parts of shape"):
            ops.rms_norm(x, weight, EPS, residual, parts=True)  # no leading parts dim


@interpreted
def test_rms_norm_rejects_wrong_shapes() -> None:
    x, residual, weight = norm_inputs((3, 16), torch.float32, CPU, seed=2)
    with pytest.raises(ValueError, match=r"weight has shape \(15,\), expected \(16,\)"):
        TritonOps().rms_norm(x, weight[:15], EPS)
    with pytest.raises(ValueError, match="residual has shape"):
        TritonOps().rms_norm(x, weight, EPS, residual[:2])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("inter", [96, 17, 1500])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    """1500 spans two column blocks of 1024, the second partly masked."""
    check_silu_and_mul(3, inter, dtype, CPU)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"),
    [(4, 2, 24), (5, 1, 16), (8, 8, 32), (6, 2, 64)],
)
def test_rotary(dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int) -> None:
    """GQA ratios 1-5, a head dim whose half (12) is not a power of two."""
    check_rotary(7, q_heads, kv_heads, head_dim, dtype, CPU)


@interpreted
def test_rotary_loops_over_head_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tile of 2 heads at head dim 32: 5 query heads take three passes, the last one half
    masked."""
    monkeypatch.setattr(triton_ops, "_ROTARY_TILE", 32)
    check_rotary(4, 5, 1, 32, torch.float32, CPU)


@interpreted
def test_empty_batches() -> None:
    ops = TritonOps()
    weight = torch.ones(8)
    assert ops.rms_norm(torch.empty(0, 8), weight, EPS).shape == (0, 8)
    normed, summed = ops.rms_norm(torch.empty(0, 8), weight, EPS, torch.empty(0, 8))
    assert normed.shape == summed.shape == (0, 8)
    assert ops.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    q, k = ops.rotary(
        torch.empty(0, dtype=torch.int64),
        torch.empty(0, 2, 8),
        torch.empty(0, 1, 8),
        torch.zeros(4, 8),
    )
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


def check_argmax(ops: KernelOps, rows: int, vocab: int, dtype: torch.dtype, device) -> None:
    """ops.argmax against torch's on fresh logits, with ties planted: inside a segment of
    ops.argmax_segment columns, across two segments (the earlier wins), at the row's two ends,
    and in every row (cycling through those) when there are more."""
    x = torch.randn(rows, vocab, device=device).to(dtype)
    top = x.float().max() + 1
    seg = getattr(ops, "argmax_segment", vocab)
    edge = seg if seg < vocab else vocab // 2  # a segment boundary, or the middle
    pairs = [(7, 9), (edge - 1, edge), (edge + 5, vocab - 1), (0, vocab - 1)]
    for row in range(rows):
        a, b = pairs[row % len(pairs)]
        x[row, a] = x[row, b] = top
    got, want = ops.argmax(x), x.argmax(dim=1)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    assert want.tolist() == [pairs[r % len(pairs)][0] for r in range(rows)]


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 300), (5, 1000), (3, 64), (2, 40)])
def test_argmax_is_torchs_ties_included(rows: int, vocab: int, dtype: torch.dtype) -> None:
    """Segments of 64 columns: 300 is four and a masked tail, 64 exactly one, 40 one masked."""
    ops = TritonOps()
    ops.argmax_segment = 64
    check_argmax(ops, rows, vocab, dtype, CPU)
    check_argmax(TorchOps(), rows, vocab, dtype, CPU)  # the interface's default


def test_registered_as_triton() -> None:
    reg = plugins()
    assert reg.entry("kernel_ops", "triton").target == "inferx_kernels_cuda.ops:TritonOps"
    assert reg.get("kernel_ops", "triton") is TritonOps


def model_weights(cfg: dict[str, Any], seed: int, scale: float = 0.15) -> dict[str, torch.Tensor]:
    """Random checkpoint tensors, norm weights around 1; the default scale keeps activations
    of the tiny models well above rounding noise, so every op matters."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    arch = plugins().get("model_arch", cfg["architectures"][0])
    for name, shape in arch.checkpoint_shapes(cfg).items():
        t = torch.randn(shape, generator=g)
        weights[name] = 1 + 0.2 * t if name.endswith("norm.weight") else scale * t
    return weights


def run_model(
    cfg: dict[str, Any],
    ops: KernelOps,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    attention: Callable[..., AttentionBackend] = TorchAttention,
    steps: list[tuple[list[int], list[int], list[int]]] | None = None,
    tables: list[list[int]] | None = None,
) -> list[torch.Tensor]:
    """Logits of three steps: a packed prefill of three prompts, a step mixing a decode of
    each with a new prompt (positions out of order across sequences), then a decode of all
    four. `attention` builds the backend from (layer specs, block size, dtype, device).
    `steps` ((query lens, context lens, sequences) each) and their block `tables` (4 tokens a
    block, ids below 32) replace those."""
    arch = plugins().get("model_arch", cfg["architectures"][0])
    backend = attention(arch.kv_layout(cfg), 4, dtype, device)
    backend.allocate(32)
    model = arch(cfg, BuildContext(dtype, device, backend, Unquantized(), ops))
    model.load_weights((n, t.to(device, dtype)) for n, t in weights.items())
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, cfg["vocab_size"], (128,), generator=g).tolist()
    tables = tables or [[3, 7, 1], [9, 2], [12, 5, 4, 20], [30]]
    steps = steps or [
        # (query lens, context lens, sequences taking part)
        ([9, 5, 13], [9, 5, 13], [0, 1, 2]),
        ([1, 1, 1, 3], [10, 6, 14, 3], [0, 1, 2, 3]),
        ([1, 1, 1, 1], [11, 7, 15, 4], [0, 1, 2, 3]),
    ]
    out = []
    for query_lens, context_lens, seqs in steps:
        positions = [
            p for q, c in zip(query_lens, context_lens, strict=True) for p in range(c - q, c)
        ]
        batch = make_attention_batch(query_lens, context_lens, [tables[s] for s in seqs], 4, device)
        backend.begin_step(batch)
        tokens = ids[: len(positions)]
        with torch.no_grad():
            hidden = model(
                torch.tensor(tokens, device=device), torch.tensor(positions, device=device)
            )
            out.append(model.compute_logits(hidden))
    return out


def assert_steps_match_torch_ops(
    cfg: dict[str, Any], weights: dict[str, torch.Tensor], ours: list[torch.Tensor], **steps: Any
) -> None:
    """run_model's fp32 logits, step by step, against TorchOps' on the CPU (`steps`: run_model's
    steps and tables)."""
    ref = run_model(cfg, TorchOps(), weights, torch.float32, CPU, **steps)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        err = rel_err(a, b)
        assert err <= TOL[torch.float32], f"step {step}: {err:.2e}"


@interpreted
@pytest.mark.parametrize("name", ["llama3-scaled", "qwen2-tied"])
def test_tiny_model_logits_match_torch_ops(name: str) -> None:
    """Llama (head dim 24, llama3 rope) and Qwen2 (q/k/v biases, tied): the whole forward with
    TritonOps against TorchOps, fp32."""
    cfg = CONFIGS[name]
    weights = model_weights(cfg, seed=len(name))
    ours = run_model(cfg, TritonOps(), weights, torch.float32, CPU)
    assert_steps_match_torch_ops(cfg, weights, ours)


def triton_ops_with(**settings: Any) -> TritonOps:
    """TritonOps with these attributes set (its settings: tma_gemv, tma_norm, ...)."""
    ops = TritonOps()
    for name, value in settings.items():
        assert hasattr(ops, name), name
        setattr(ops, name, value)
    return ops


def cublas_ops() -> TritonOps:
    """TritonOps with the TMA GEMMs and the norm inside gate_up off (both on by default): the
    cuBLAS, torch.bmm and skinny_linear paths the tests below count."""
    ops = TritonOps()
    ops.tma_gemv = ops.tma_norm = False
    return ops


def triton_with_qkv_parts(*args: Any) -> TritonAttention:
    backend = TritonAttention(*args)
    backend.qkv_parts = True
    return backend


def count_forward_split(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of parts each DenseLinear.forward_split returns from now on."""
    calls: list[int] = []
    real = DenseLinear.forward_split

    def counted(self: DenseLinear, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out = real(self, x)
        calls.append(out[0].shape[0])
        return out

    monkeypatch.setattr(DenseLinear, "forward_split", counted)
    return calls


@interpreted
def test_tiny_model_logits_with_qkv_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2 (q/k/v biases) on the triton backend with qkv_parts, DenseLinear splitting on the
    CPU too (as it does on a GPU): the decode-only third step hands q, k, v to the decode kernel
    as SPLIT_PARTS partial sums and the bias; every step's logits stay the torch reference's.
    (The Llama config's head dim of 24 is not one the triton backend takes.)"""

    def splits(self: DenseLinear, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] <= quant_none.SPLIT_MAX_ROWS

    monkeypatch.setattr(DenseLinear, "_splits", splits)
    calls = count_forward_split(monkeypatch)
    cfg = CONFIGS["qwen2-tied"]
    weights = model_weights(cfg, seed=7)
    ours = run_model(cfg, cublas_ops(), weights, torch.float32, CPU, triton_with_qkv_parts)
    # the decode-only step's layers only
    assert calls == [quant_none.SPLIT_PARTS] * cfg["num_hidden_layers"]
    assert_steps_match_torch_ops(cfg, weights, ours)


# A prefill of 37-, 20- and 33-token prompts, then two decode-only steps: contexts long enough
# for the triton backend (16-token tiles under the interpreter) to split them in two.
LONG_STEPS = {
    "steps": [
        ([37, 20, 33], [37, 20, 33], [0, 1, 2]),
        ([1, 1, 1], [38, 21, 34], [0, 1, 2]),
        ([1, 1, 1], [39, 22, 35], [0, 1, 2]),
    ],
    "tables": [list(range(1, 11)), list(range(11, 17)), list(range(17, 26))],
}


@interpreted
@pytest.mark.parametrize("parts", [2, 4])
def test_tiny_model_logits_with_the_split_combine_in_o_proj(
    parts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The triton backend keeping its context splits (keeps_splits; 2 splits of the decode
    steps' 21-39 tokens) and TritonOps combining them inside o_proj (tma_reduce_linear, K-slices
    of 2 or 1 heads): every layer of both decode-only steps runs it, and the logits match the
    same backend combining them itself and TorchOps'. In 3 K-slices (not whole heads) the
    splits are combined first and the logits are the same. Qwen2 with 4 query heads over 2 KV
    heads."""
    cfg = CONFIGS["qwen2-tied"] | {"num_attention_heads": 4, "num_key_value_heads": 2}
    weights = model_weights(cfg, seed=19)
    calls = spy_calls(monkeypatch, "tma_reduce_linear", lambda sp, *_: (sp.rows, sp.splits))
    splits: list[int] = []

    def triton_backend(keep: bool) -> Callable[..., TritonAttention]:
        def build(*args: Any) -> TritonAttention:
            backend = TritonAttention(*args, min_split_len=16, target_programs=1024)
            backend.qkv_parts = True
            backend.keep_split_rows = ((1, 8),) if keep else ()
            real = backend.begin_step

            def begin_step(batch: Any) -> None:
                real(batch)
                splits.append(backend._plan.num_splits)

            backend.begin_step = begin_step
            return backend

        return build

    ops = TritonOps()
    ops.tma_parts = parts
    ours = run_model(cfg, ops, weights, torch.float32, CPU, triton_backend(True), **LONG_STEPS)
    assert splits == [1, 2, 2]
    assert calls == [(3, 2)] * 2 * cfg["num_hidden_layers"]
    # 3 slices of 4 heads cannot be whole heads: the splits are combined first (reduce())
    ops.tma_parts = 3
    calls.clear()
    uneven = run_model(cfg, ops, weights, torch.float32, CPU, triton_backend(True), **LONG_STEPS)
    assert not calls
    for step, (a, b) in enumerate(zip(uneven, ours, strict=True)):
        assert rel_err(a, b) < 1e-5, step
    combined = run_model(cfg, ops, weights, torch.float32, CPU, triton_backend(False), **LONG_STEPS)
    assert not calls  # the backend combined them
    for step, (a, b) in enumerate(zip(ours, combined, strict=True)):
        assert rel_err(a, b) < 1e-5, step
    assert_steps_match_torch_ops(cfg, weights, ours, **LONG_STEPS)


def count_skinny_linear(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of x that TritonOps hands skinny_linear from now on, one entry a call."""
    calls: list[tuple[int, ...]] = []
    real = triton_ops.skinny_linear

    def counted(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "skinny_linear", counted)
    return calls


@interpreted
@pytest.mark.parametrize("name", ["llama3-scaled", "qwen2-tied"])
def test_tiny_model_logits_with_the_gated_gemv(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonOps running gate_up and SiLU-and-mul as one skinny_linear(gated=True) in steps of
    up to 8 rows: the 6-row second step and the 4-row third do, the 27-row prefill does not;
    the logits stay TorchOps'."""
    calls = count_skinny_linear(monkeypatch)
    cfg = CONFIGS[name]
    weights = model_weights(cfg, seed=len(name))
    ops = cublas_ops()
    ops.gated_gemv_rows = (1, 8)
    ours = run_model(cfg, ops, weights, torch.float32, CPU)
    assert_steps_match_torch_ops(cfg, weights, ours)
    layers = cfg["num_hidden_layers"]
    assert calls == [(6, 64)] * layers + [(4, 64)] * layers


@interpreted
def test_gated_gemv_only_up_to_max_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused gate_up runs where the hidden size (K) is at most gated_gemv_max_k; past it,
    the GEMM and silu_and_mul as two, with the same result."""
    calls = count_skinny_linear(monkeypatch)
    torch.manual_seed(0)
    linear = DenseLinear(LinearSpec("t", 64, (48,)), torch.float32, CPU)
    linear.weight.data.normal_()
    x = torch.randn(6, 64)
    ops = TritonOps()
    ops.gated_gemv_rows, ops.tma_gated = (1, 8), False
    fused = ops.linear_silu_and_mul(linear, x)
    ops.gated_gemv_max_k = 32
    unfused = ops.linear_silu_and_mul(linear, x)
    assert calls == [(6, 64)]
    torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4 * unfused.abs().max().item())


def test_triton_ops_defaults() -> None:
    """TritonOps' settings and their defaults (attributes that tests and benchmarks may set)."""
    ops = TritonOps()
    assert ops.gated_gemv_rows == (5, 32)  # graphs pad these to 8, 16, 32
    assert ops.tma_gemv and ops.tma_gated and ops.tma_norm and not ops.tma_norm_qkv
    assert ops.tma_gemv_max_rows == 64 and ops.tma_norm_max_rows is None
    assert ops.tma_parts == quant_none.SPLIT_PARTS
    assert ops.qkv_half_rows == ((2, 64),) and ops.down_double_rows == ((4, 16),)
    assert ops.embed_triton


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embedding_kernel_gathers_the_rows(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """embedding_kernel (on by default: embed_triton): its rows equal
    F.embedding's (TorchOps), for repeated ids, a hidden size past one column block and not a
    power of two, and a weight whose rows are strided."""
    ops = TritonOps()
    assert ops.embed_triton
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(50, 2600, generator=gen).to(dtype)
    weight = wide[:, :2500]  # row stride 2600
    ids = torch.randint(0, 50, (7,), generator=gen)
    ids[3] = ids[0]
    got = ops.embedding(weight, ids)
    assert got.shape == (7, 2500) and got.dtype == dtype
    assert torch.equal(got, TorchOps().embedding(weight, ids))
    strided = torch.stack([ids, ids.flip(0)], dim=1)[:, 1]  # ids reversed, stride 2
    assert torch.equal(ops.embedding(weight, strided), got.flip(0))
    assert ops.embedding(weight, ids[:0]).shape == (0, 2500)


def test_tma_row_limits() -> None:
    ops = TritonOps()
    # The norm's limit by the hidden size: 3B's 2048 at one row, 8B's 4096 at 4.
    assert ops.tma_gemv_max_rows == 64 and ops.tma_norm_max_rows is None
    assert [ops.norm_max_rows(k) for k in (896, 2048, 3584, 4096, 8192)] == [1, 1, 4, 4, 4]
    ops.tma_norm_max_rows = 0  # one limit for every shape
    assert ops.norm_max_rows(2048) == ops.norm_max_rows(4096) == 0
    ops.tma_norm_max_rows = 8
    assert ops.norm_max_rows(2048) == 8


@interpreted
def test_tma_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """tma_parts: the K-slices of o_proj / down_proj / QKV on tma_linear_parts (an uneven 3
    too); the tiny model's logits stay TorchOps'."""
    assert TritonOps().tma_parts == quant_none.SPLIT_PARTS
    # down_double_rows: down_proj's own (test_slices_doubled); qkv_half_rows: QKV's own
    # (test_qkv_slices_halved_*)
    ops = triton_ops_with(tma_parts=3, tma_norm=False, down_double_rows=(), qkv_half_rows=())
    cfg = CONFIGS["qwen2-tied"]
    weights = model_weights(cfg, seed=17)
    calls = count_tma(monkeypatch)
    ours = run_model(cfg, ops, weights, torch.float32, CPU, triton_with_qkv_parts)
    assert {parts for _, parts in calls} == {3}  # gate_up: tma_linear_silu_and_mul
    assert_steps_match_torch_ops(cfg, weights, ours)


def test_tma_paths_only_on_hopper_or_newer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU before sm_90 (no TMA, no wgmma) keeps the cuBLAS paths with the switches on."""
    ops = TritonOps()
    ops._interpret = False
    x = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    try:
        for major, expected in ((8, False), (9, True), (10, True)):
            triton_ops._has_tma.cache_clear()
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d, v=major: (v, 0))
            assert ops._tma_device(x) is expected, major
    finally:
        triton_ops._has_tma.cache_clear()


def spy_calls(monkeypatch: pytest.MonkeyPatch, name: str, record: Callable[..., Any]) -> list[Any]:
    """record(*args) of every call TritonOps makes to triton_ops.<name> from now on; the calls
    still run the real function."""
    calls: list[Any] = []
    real = getattr(triton_ops, name)

    def counted(*args: Any) -> Any:
        calls.append(record(*args))
        return real(*args)

    monkeypatch.setattr(triton_ops, name, counted)
    return calls


def count_tma(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], int]]:
    """(x's shape, parts) of every tma_linear_parts call TritonOps makes from now on."""
    return spy_calls(
        monkeypatch, "tma_linear_parts", lambda x, w, parts=1, *_: (tuple(x.shape), parts)
    )


@interpreted
@pytest.mark.parametrize("name", ["llama3-scaled", "qwen2-tied"])
def test_tiny_model_logits_with_tma_gemv(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tma_gemv on, the norm fusion and the gated form off: o_proj and down_proj as
    SPLIT_PARTS parts for the norm, gate_up whole (outside the gated GEMV's rows), and (qwen2,
    on the triton backend with qkv_parts) the decode-only step's QKV as half as many parts plus
    the bias for the decode kernel, all by tma_linear_parts; logits stay the torch reference's."""
    ops = triton_ops_with(tma_gemv=True, tma_norm=False, tma_gated=False)
    cfg = CONFIGS[name]
    weights = model_weights(cfg, seed=11)
    calls = count_tma(monkeypatch)
    attention = triton_with_qkv_parts if name == "qwen2-tied" else TorchAttention
    ours = run_model(cfg, ops, weights, torch.float32, CPU, attention)
    layers = cfg["num_hidden_layers"]
    parted = [c for c in calls if c[1] == quant_none.SPLIT_PARTS]
    doubled = [c for c in calls if c[1] == 2 * quant_none.SPLIT_PARTS]
    whole = [c for c in calls if c[1] == 1]
    # The 27-row prefill, the 6- and 4-row steps: o_proj and down_proj in parts, but those whose
    # K exceeds N (down_proj; llama3-scaled's o_proj, 96 -> 64) in twice the parts at 6 and 4
    # rows (filled_slices: 4-16 rows, and the tiny N leaves most of 132 SMs idle); qwen2's decode
    # step: QKV in half the parts (qkv_half_rows: 2-64). gate_up whole in the 4-row step only:
    # the 27- and 6-row ones take the gated GEMV (5-32 rows) first.
    qkv = layers if name == "qwen2-tied" else 0
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    wide = 2 if heads * cfg.get("head_dim", hidden // heads) > hidden else 1  # o_proj's K > N
    assert len(parted) == (6 - 2 * wide) * layers
    assert len([c for c in calls if c[1] == quant_none.SPLIT_PARTS // 2]) == qkv
    assert whole == [((4, hidden), 1)] * layers
    assert {c[0][0] for c in parted} == ({27} if wide == 2 else {27, 6, 4})
    assert sorted(c[0][0] for c in doubled) == [4] * wide * layers + [6] * wide * layers
    assert_steps_match_torch_ops(cfg, weights, ours)


def spy_kwargs(monkeypatch: pytest.MonkeyPatch, name: str, record: Callable[..., Any]) -> list:
    """spy_calls for a function TritonOps calls with keyword arguments too."""
    calls: list[Any] = []
    real = getattr(triton_ops, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_ops, name, counted)
    return calls


@interpreted
def test_tiny_gptoss_biased_o_proj_on_tma_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's o_proj has a bias: tma_linear_parts takes it (into part 0), so the layer
    stays on the TMA GEMV instead of F.linear; logits stay the torch reference's."""
    from inferx_models.presets import preset

    cfg = {k: v for k, v in preset("tiny-gpt-oss").items() if k != "quantization_config"}
    ops = triton_ops_with(tma_gemv=True, tma_norm=False, tma_gated=False)
    weights = model_weights(cfg, seed=13)

    def record(x, w, parts=1, cfg=None, trigger=False, bias=None):
        return tuple(w.shape), bias is not None

    calls = spy_kwargs(monkeypatch, "tma_linear_parts", record)
    ours = run_model(cfg, ops, weights, torch.float32, CPU, TorchAttention)
    heads, head_dim = cfg["num_attention_heads"], cfg["head_dim"]
    o_proj = [c for c in calls if c[0] == (cfg["hidden_size"], heads * head_dim)]
    assert len(o_proj) == 3 * cfg["num_hidden_layers"] and all(b for _, b in o_proj)
    assert_steps_match_torch_ops(cfg, weights, ours)


@interpreted
@pytest.mark.parametrize("norm", ["off", "default"])
@pytest.mark.parametrize("name", ["llama3-scaled", "qwen2-tied"])
def test_tiny_model_logits_with_tma_gated(
    name: str, norm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tma_gated on, the norm fusion off, or on with its default row limit (one row at
    these hidden sizes): every gate_up of up to 64 rows (the 27-row prefill, the 6- and 4-row
    steps) with its SiLU-and-mul in one tma_linear_silu_and_mul launch, ahead of the gated
    GEMV, and no norm inside a GEMM; logits stay the torch reference's."""
    ops = triton_ops_with(tma_gated=True, tma_norm=norm != "off")
    cfg = CONFIGS[name]
    weights = model_weights(cfg, seed=17)
    calls = spy_calls(monkeypatch, "tma_linear_silu_and_mul", lambda x, *_: x.shape[0])
    fused = count_tma_norm(monkeypatch)
    ours = run_model(cfg, ops, weights, torch.float32, CPU, TorchAttention)
    assert sorted(calls) == sorted([27, 6, 4] * cfg["num_hidden_layers"])
    assert fused == []
    assert_steps_match_torch_ops(cfg, weights, ours)


def count_tma_norm(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, bool]]:
    """(rows, parts, gated) of every tma_norm_linear call TritonOps makes from now on."""
    return spy_calls(monkeypatch, "tma_norm_linear", lambda x, *a: (x.shape[1], a[4], a[5]))


@interpreted
@pytest.mark.parametrize("name", ["llama3-scaled", "qwen2-tied"])
def test_tiny_model_logits_with_tma_norm(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tma_norm and tma_norm_qkv on: in steps of up to tma_norm_max_rows rows
    (the 6-row second and the 4-row third, not the 27-row prefill) every post-attention norm
    runs inside gate_up (SiLU after), and (qwen2, on the triton backend with qkv_parts, in the
    decode-only step) every input norm but the first layer's inside the QKV GEMM; logits stay
    TorchOps'."""
    # tma_norm_max_rows 8: the tiny hidden size's default is 1
    ops = triton_ops_with(tma_norm=True, tma_norm_qkv=True, tma_norm_max_rows=8)
    cfg = CONFIGS[name]
    weights = model_weights(cfg, seed=13)
    calls = count_tma_norm(monkeypatch)
    attention = triton_with_qkv_parts if name == "qwen2-tied" else TorchAttention
    ours = run_model(cfg, ops, weights, torch.float32, CPU, attention)
    layers = cfg["num_hidden_layers"]
    qkv = [(4, quant_none.SPLIT_PARTS, False)] * (layers - 1) if name == "qwen2-tied" else []
    assert sorted(calls) == sorted([(6, 1, True)] * layers + [(4, 1, True)] * layers + qkv)
    assert_steps_match_torch_ops(cfg, weights, ours)


def test_down_proj_doubles_its_slices_where_they_leave_sms_idle() -> None:
    """filled_slices: Qwen2.5-3B's down_proj (N 2048, 128 programs in 4 slices on 132 SMs) in 8
    at 4-16 rows only; Llama-3.1-8B's (N 4096, 256 programs) stays in 4; no rows, no change."""
    rows_4_16 = ((4, 16),)
    assert [filled_slices(4, 2048, m, 132, rows_4_16) for m in (1, 2, 4, 8, 16, 32, 64)] == [
        4, 4, 8, 8, 8, 4, 4,
    ]  # fmt: skip
    assert filled_slices(4, 4096, 8, 132, rows_4_16) == 4
    assert filled_slices(4, 2048, 8, 132, ()) == 4
    assert filled_slices(4, 2048, 8, 100, rows_4_16) == 4  # 128 programs fill 100 SMs


@interpreted
def test_slices_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    """down_double_rows at every row count: the tiny Qwen2's down_proj (K past N) in twice
    tma_parts K-slices, the rest (o_proj, QKV) in tma_parts; logits stay TorchOps'; the
    default (4-16 rows)."""
    assert TritonOps().down_double_rows == ((4, 16),)
    # qkv_half_rows (): QKV in tma_parts at every row
    ops = triton_ops_with(down_double_rows=((1, 1 << 30),), qkv_half_rows=())
    cfg = CONFIGS["qwen2-tied"]
    weights = model_weights(cfg, seed=23)
    calls = spy_calls(
        monkeypatch, "tma_linear_parts", lambda x, w, parts=1, *_: (w.shape[1] > w.shape[0], parts)
    )
    ours = run_model(cfg, ops, weights, torch.float32, CPU, triton_with_qkv_parts)
    one, two = quant_none.SPLIT_PARTS, 2 * quant_none.SPLIT_PARTS
    assert {parts for wide, parts in calls if wide} == {two}
    assert {parts for wide, parts in calls if not wide} == {one}
    assert_steps_match_torch_ops(cfg, weights, ours)


@interpreted
def test_qkv_slices_halved_at_their_rows() -> None:
    """linear_split (the QKV GEMM) runs in half the tma_parts K-slices at qkv_half_rows
    (default 2-64), whatever its width, else in tma_parts; the parts sum to F.linear either
    way."""
    ops = TritonOps()
    assert ops.qkv_half_rows == ((2, 64),)
    torch.manual_seed(5)
    for k, rows, want in ((256, 1, ops.tma_parts), (256, 4, ops.tma_parts // 2),
                          (4096, 9, ops.tma_parts // 2)):  # fmt: skip
        linear = DenseLinear(LinearSpec("t", k, (48, 16, 16)), torch.float32, CPU)
        linear.weight.data.normal_()
        x = torch.randn(rows, k)
        parts, bias = ops.linear_split(linear, x)
        assert bias is None and parts.shape == (want, rows, 80), (k, rows)
        want_out = x.double() @ linear.weight.double().T
        torch.testing.assert_close(parts.double().sum(0), want_out, rtol=1e-4, atol=1e-3)


# --- GPU, compiled, bf16 at real sizes ---------------------------------------------------------

GPU = torch.device("cuda")


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [2048, 4096, 3584])
@pytest.mark.parametrize("rows", [1, 37, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_rms_norm(dtype: torch.dtype, hidden: int, rows: int, with_residual: bool) -> None:
    check_rms_norm((rows, hidden), dtype, GPU, with_residual)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_parts", [1, 4])
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_rms_norm_sums_parts(dtype: torch.dtype, num_parts: int, rows: int) -> None:
    check_rms_norm_parts(num_parts, (rows, 2048), dtype, GPU)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inter", [11008, 14336, 8960])
@pytest.mark.parametrize("rows", [1, 37, 2048])
def test_gpu_silu_and_mul(dtype: torch.dtype, inter: int, rows: int) -> None:
    check_silu_and_mul(rows, inter, dtype, GPU)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim"), [(16, 2, 128), (32, 8, 128), (32, 8, 64)]
)
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_gpu_rotary(
    dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int, tokens: int
) -> None:
    check_rotary(tokens, q_heads, kv_heads, head_dim, dtype, GPU, max_positions=32768)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [151_936, 128_256, 32_000])
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_argmax_is_torchs_ties_included(rows: int, vocab: int, dtype: torch.dtype) -> None:
    check_argmax(TritonOps(), rows, vocab, dtype, GPU)


@on_gpu
@pytest.mark.gpu
def test_gpu_ops_replay_in_a_cuda_graph() -> None:
    """All three kernels captured once (after a warm-up that compiles them) and replayed on new
    inputs written into the captured buffers: what the decode CUDA graphs will do."""
    ops = TritonOps()
    tokens, heads, kv_heads, dim, hidden, inter = 8, 16, 2, 128, 2048, 11008
    dtype = torch.bfloat16
    cos_sin = RotaryEmbedding(dim, 4096, {"rope_theta": 1e6, "rope_type": "default"}, GPU).cos_sin
    x = torch.randn(tokens, hidden, device=GPU, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=GPU, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=GPU, dtype=dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device=GPU, dtype=dtype)
    positions = torch.randint(0, 4096, (tokens,), device=GPU)

    def step() -> tuple[torch.Tensor, ...]:
        normed, summed = ops.rms_norm(x, weight, EPS, residual)
        q = qkv[:, : heads * dim].view(tokens, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        ops.rotary(positions, q, k, cos_sin)
        return normed, summed, ops.silu_and_mul(gate_up)

    step()  # compiles every kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(2):
        torch.manual_seed(seed)
        for buf in (x, residual, gate_up, qkv):
            buf.copy_(torch.randn_like(buf))
        positions.copy_(torch.randint(0, 4096, (tokens,), device=GPU))
        fresh = qkv.clone()
        graph.replay()
        # A new TorchOps each time: it caches cos/sin by the positions tensor, which this
        # test mutates in place.
        ref_ops = TorchOps()
        normed, summed = ref_ops.rms_norm(x, weight, EPS, residual)
        assert torch.equal(outs[1], summed)
        assert rel_err(outs[0], normed) <= TOL[dtype]
        assert rel_err(outs[2], ref_ops.silu_and_mul(gate_up)) <= TOL[dtype]
        q_ref, k_ref = ref_ops.rotary(
            positions,
            fresh[:, : heads * dim].view(tokens, heads, dim),
            fresh[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim),
            cos_sin,
        )
        assert rel_err(qkv[:, : heads * dim].view(tokens, heads, dim), q_ref) <= TOL[dtype]
        k_ours = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        assert rel_err(k_ours, k_ref) <= TOL[dtype]


def assert_two_layers_match_torch_ops(
    name: str, ops: KernelOps, attention: Callable[..., AttentionBackend] = TorchAttention
) -> None:
    """Two layers of a preset's real shapes (vocabulary cut to 4096) in bf16, `ops` and
    `attention` against TorchOps + TorchAttention. Roundings that flip by an ulp inside a layer
    pass through the GEMMs, hence 3e-2; greedy tokens must nearly all agree."""
    cfg = preset(name) | {"num_hidden_layers": 2, "vocab_size": 4096}
    weights = model_weights(cfg, seed=3, scale=0.02)
    ours = torch.cat(run_model(cfg, ops, weights, torch.bfloat16, GPU, attention))
    ref = torch.cat(run_model(cfg, TorchOps(), weights, torch.bfloat16, GPU))
    err = rel_err(ours, ref)
    assert err <= 3e-2, f"{err:.2e}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, f"greedy tokens agree on {agree:.0%} of {len(ours)} rows"


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gated_rows", [(1, 0), (1, 8)])
@pytest.mark.parametrize("name", ["qwen2.5-3b-instruct", "llama-3.1-8b-instruct"])
def test_gpu_model_logits_match_torch_ops(name: str, gated_rows: tuple[int, int]) -> None:
    """Two layers of the real shapes, bf16: TritonOps against TorchOps. gated_rows (1, 8): the
    6- and 4-row steps run gate_up and SiLU-and-mul as one skinny_linear(gated=True), for 8B's
    hidden size too. (The TMA paths, on by default: test_gpu_model_logits_with_tma_norm.)"""
    ops = cublas_ops()
    ops.gated_gemv_rows = gated_rows
    ops.gated_gemv_max_k = preset(name)["hidden_size"]
    assert_two_layers_match_torch_ops(name, ops)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-3b-instruct", "llama-3.1-8b-instruct"])
def test_gpu_model_logits_with_qkv_parts(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers of the real shapes, bf16, the triton backend with qkv_parts: in the
    decode-only step 3B's QKV GEMM runs as SPLIT_PARTS K-slices whose sum and bias the decode
    kernel adds (8B's weight is over SPLIT_QKV_MAX_BYTES: one part, bias included); the logits
    stay TorchOps + TorchAttention's as in the test above."""
    calls = count_forward_split(monkeypatch)
    assert_two_layers_match_torch_ops(name, cublas_ops(), triton_with_qkv_parts)
    # (the TorchAttention reference takes no parts: these are all the triton run's)
    assert calls == [quant_none.SPLIT_PARTS if "qwen" in name else 1] * 2


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-3b-instruct", "llama-3.1-8b-instruct"])
def test_gpu_model_logits_with_tma_gemv(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tma_gemv on (tma_norm off), two layers of the real shapes, bf16, the triton
    backend with qkv_parts: o_proj and down_proj (in the 27-row prefill and the 6- and 4-row
    steps) and the decode step's QKV (both models) on tma_linear_parts, gate_up on
    tma_linear_silu_and_mul; the logits stay TorchOps + TorchAttention's. 3B's down_proj runs
    in twice the slices at 6 and 4 rows (filled_slices: 4 slices are 128 programs); both
    models' QKV in half (qkv_half_rows)."""
    ops = triton_ops_with(tma_gemv=True, tma_norm=False)
    calls = count_tma(monkeypatch)
    assert_two_layers_match_torch_ops(name, ops, triton_with_qkv_parts)
    # (TorchOps never calls tma_linear_parts: these are all the triton run's)
    doubled = 2 * 2 if "qwen" in name else 0  # 2 layers x the 6- and 4-row steps
    halved = 2  # the decode step's QKV, 2 layers
    parts = [c[1] for c in calls]
    assert parts.count(quant_none.SPLIT_PARTS) == 3 * 2 * 2 + 2 - doubled - halved
    assert parts.count(2 * quant_none.SPLIT_PARTS) == doubled
    assert parts.count(quant_none.SPLIT_PARTS // 2) == halved


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen2.5-3b-instruct", "llama-3.1-8b-instruct"])
def test_gpu_model_logits_with_tma_norm(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """tma_norm, tma_norm_qkv and tma_gemv on, two layers of the real shapes, bf16, the triton
    backend with qkv_parts: the norms inside the GEMMs after them in the 6- and 4-row steps
    (tma_norm_max_rows 8: by default the fusion stops at 1 row for 3B, 4 for 8B); the logits
    stay TorchOps + TorchAttention's."""
    ops = triton_ops_with(tma_norm_max_rows=8, tma_norm=True, tma_norm_qkv=True, tma_gemv=True)
    calls = count_tma_norm(monkeypatch)
    assert_two_layers_match_torch_ops(name, ops, triton_with_qkv_parts)
    # post-attention norms: 2 layers x 2 steps; the input norm of layer 2 in the decode step
    assert (
        sorted(calls)
        == [(4, 1, True)] * 2 + [(4, quant_none.SPLIT_PARTS, False)] + [(6, 1, True)] * 2
    )
