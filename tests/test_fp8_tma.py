"""The FP8 TMA decode GEMM (tma_gemv.tma_fp8_linear_parts, fp8_gemm.tma_fp8_gemm) against the
exact dequantized operands in float64: e4m3 activations quantized as the reference quantizes
them (per token, per tensor, static) or half-precision x (weight-only), per-channel and
per-tensor weight scales, bias, K-slice parts, the gated SiLU form; what TMA cannot read is
refused and auto falls back. On the CPU under the interpreter (tensor descriptors run there,
zero fill past the edges included); on a GPU at the 3B shapes in bf16; compiled for sm_90."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_core.quant_utils import quantize_fp8  # noqa: E402
from inferx_kernels_cuda import fp8_gemm as kern  # noqa: E402
from inferx_kernels_cuda.tma_gemv import (  # noqa: E402
    FP8,
    TmaGemvConfig,
    fp8_input_problem,
    fp8_parts,
    plain_config,
    tma_fp8_linear_parts,
)
from inferx_quant.fp8 import Fp8Format, quantize_activations, quantize_weight_rows  # noqa: E402

SMALL = TmaGemvConfig(block_n=32, block_k=32, num_stages=2)


def weights(n: int, k: int, seed: int, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 [n, k] and its float32 scales [n]: per channel, or one per-tensor scale repeated
    over the rows (as Fp8Linear stores it)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    if not per_tensor:
        return quantize_weight_rows(w)
    scale = (w.abs().amax() / 448.0).reshape(1)
    return quantize_fp8(w, scale), scale.expand(n).contiguous()


def activations(m: int, k: int, seed: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)


def quantized(x: torch.Tensor, how: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized as inferx_quant.fp8's reference does: per token, per tensor, or static."""
    static = torch.tensor([0.02]) if how == "static" else None
    return quantize_activations(x, Fp8Format(activations=how), static)


def reference(x, x_scale, w, w_scale, bias=None) -> torch.Tensor:  # noqa: ANN001
    """float64 product of the exact dequantized operands (+ bias)."""
    xd = x.double() * (x_scale.double() if x_scale is not None else 1.0)
    y = xd @ (w.double() * w_scale.double()[:, None]).T
    return y if bias is None else y + bias.double()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).abs().max() / ref.abs().max()).item()


@interpreted
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64])
@pytest.mark.parametrize(("n", "k", "parts"), [(70, 192, 3), (100, 96, 1), (48, 256, 2)])
@pytest.mark.parametrize("how", ["token", "tensor", "static"])
def test_e4m3_parts_sum_to_the_dequantized_product(m, n, k, parts, how) -> None:
    """Ragged N and K against the tiles (zero fill past both edges and past M); per-channel
    weights with x per token, per-tensor weights with x per tensor or static."""
    w, ws = weights(n, k, seed=n + k, per_tensor=how != "token")
    xq, xs = quantized(activations(m, k, seed=m * 7 + n), how)
    out = tma_fp8_linear_parts(xq, xs, w, ws, None, parts, SMALL, torch.float32)
    assert out.shape == (parts, m, n) and out.dtype == torch.float32
    # fp32 accumulation of exact products: only summation order differs
    assert rel_err(out.sum(0), reference(xq, xs, w, ws)) < 1e-5
    half = tma_fp8_linear_parts(xq, xs, w, ws, None, parts, SMALL, torch.float16)
    # each part rounded once to fp16 (2**-11 relative to its size, at most the total's)
    assert rel_err(half.sum(0), reference(xq, xs, w, ws)) < parts * 2**-10


@interpreted
def test_each_part_is_its_slice_of_k_and_the_bias_goes_into_part_0() -> None:
    w, ws = weights(40, 128, seed=1, per_tensor=False)
    xq, xs = quantized(activations(2, 128, seed=2), "token")
    bias = torch.randn(40).half()
    out = tma_fp8_linear_parts(xq, xs, w, ws, bias, 4, SMALL, torch.float32)  # 32 columns a part
    for s in range(4):
        ks = slice(32 * s, 32 * (s + 1))
        ref = reference(xq[:, ks], xs, w[:, ks], ws, bias if s == 0 else None)
        assert rel_err(out[s], ref) < 1e-5


@interpreted
@pytest.mark.parametrize("m", [1, 7, 40])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_weight_only_casts_the_weight_tile_to_x(m, per_tensor) -> None:
    w, ws = weights(90, 160, seed=m, per_tensor=per_tensor)
    x = activations(m, 160, seed=m + 1)
    bias = torch.randn(90).half()
    out = tma_fp8_linear_parts(x, None, w, ws, bias, 2, SMALL)
    assert out.dtype == torch.float16 and out.shape == (2, m, 90)
    assert rel_err(out.sum(0), reference(x, None, w, ws, bias)) < 2 * 2**-10


@interpreted
@pytest.mark.parametrize("m", [1, 9])
@pytest.mark.parametrize("how", ["token", "none"])
def test_gated_form_is_silu_and_mul_of_the_scaled_product(m, how) -> None:
    """gate rows then up rows, each with its own scales and bias, rounded to the output dtype
    before SiLU-and-mul as the unfused ops round them."""
    inter, k = 45, 96
    w, ws = weights(2 * inter, k, seed=m + 3, per_tensor=False)
    x = activations(m, k, seed=m + 4)
    xq, xs = (x, None) if how == "none" else quantized(x, "token")
    bias = torch.randn(2 * inter).half()
    out = tma_fp8_linear_parts(xq, xs, w, ws, bias, 1, SMALL, torch.float16, gated=True)
    assert out.shape == (m, inter)
    y = reference(xq, xs, w, ws, bias).half().double()
    ref = F.silu(y[:, :inter]) * y[:, inter:]
    assert rel_err(out, ref) < 2**-9


@interpreted
@pytest.mark.parametrize("how", ["token", "tensor", "static", "none"])
@pytest.mark.parametrize("m", [1, 20])
def test_fp8_linear_on_tma_matches_the_reference_layer(how, m) -> None:
    """fp8_linear(gemm="tma"): its own quantization, K split into fp32 parts summed with the
    bias by split_sum_kernel, against the reference's quantized x and dequantized weight."""
    n, k = 64, 512
    w, ws = weights(n, k, seed=11, per_tensor=how in ("tensor", "static"))
    x = activations(m, k, seed=12)
    bias = torch.randn(n).half()
    static = torch.tensor([0.02]) if how == "static" else None
    got = kern.fp8_linear(x, w, ws, bias, activations=how, input_scale=static, gemm="tma")
    assert got.shape == (m, n) and got.dtype == torch.float16
    xq, xs = (x, None) if how == "none" else quantized(x, how)
    ref = reference(xq, xs, w, ws, bias)
    assert rel_err(got, ref) < 2**-10
    parts = kern.fp8_linear(x, w, ws, bias, how, input_scale=static, gemm="tma", parts=True)
    slices = fp8_parts(n, k, m, 132)
    assert slices > 1 and parts.shape == (slices, m, n)
    assert rel_err(parts.sum(0), ref) < slices * 2**-10


@interpreted
def test_tma_fp8_gemm_splits_and_keeps_one_part_alike() -> None:
    w, ws = weights(64, 1024, seed=5, per_tensor=False)
    xq, xs = quantized(activations(3, 1024, seed=6), "token")
    ref = reference(xq, xs, w, ws)
    for slices in (1, 4):
        got = kern.tma_fp8_gemm(xq, xs, w, ws, None, torch.float16, slices=slices)
        assert got.shape == (3, 64) and rel_err(got, ref) < 2**-10
        parts = kern.tma_fp8_gemm(xq, xs, w, ws, None, torch.float16, slices=slices, parts=True)
        assert parts.shape == (slices, 3, 64) and rel_err(parts.sum(0), ref) < slices * 2**-10


def test_what_tma_cannot_read_is_refused_naming_it() -> None:
    w, ws = weights(32, 200, seed=1, per_tensor=False)  # 200 e4m3 bytes a row: not 16-aligned
    xq, xs = quantized(activations(2, 200, seed=2), "token")
    problem = fp8_input_problem(xq, xs, w, ws)
    assert problem is not None and "16-byte aligned rows" in problem
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        tma_fp8_linear_parts(xq, xs, w, ws, None, 1, SMALL, torch.float16)
    w, ws = weights(32, 128, seed=1, per_tensor=False)
    xq, xs = quantized(activations(2, 128, seed=2), "token")
    block_scales = torch.ones(1, 1)
    assert "scale per row" in fp8_input_problem(xq, xs, w, block_scales)
    assert "scale per row [M, 1]" in fp8_input_problem(xq, torch.ones(2, 4), w, ws)
    assert "1 to 128 rows" in fp8_input_problem(torch.zeros(129, 128, dtype=FP8), None, w, ws)
    assert "weight-only" in fp8_input_problem(xq.float(), None, w, ws)
    assert fp8_input_problem(xq, xs, w, ws) is None
    # no GPU here: auto keeps the pointer kernel
    assert not kern.tma_readable(xq, xs, w, ws)


def test_pick_gemm_takes_tma_at_decode_rows_where_it_can_read() -> None:
    assert kern.pick_gemm(1, 2048, 2048, tma=True) == "tma"
    assert kern.pick_gemm(kern.TMA_MAX_ROWS, 2048, 2048, tma=True) == "tma"
    assert kern.pick_gemm(kern.TMA_MAX_ROWS + 1, 2048, 2048, tma=True) == "cublas"
    assert kern.pick_gemm(1, 2048, 2048, tma=False) == "triton"
    assert kern.pick_gemm(32, 2048, 2048) == "cublas"


def test_parts_split_the_narrow_3b_projections_in_eight() -> None:
    """QKV, o_proj and down_proj in 8 K-slices, gate_up whole (two row blocks an SM already),
    at 1 and 64 rows on 132 SMs; a K too short for a 256-column tile a slice stays whole."""
    shapes = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048)}
    shapes["down"] = (2048, 11008)
    for rows in (1, 64):
        got = {name: fp8_parts(n, k, rows, 132) for name, (n, k) in shapes.items()}
        assert got == {"qkv": 8, "o": 8, "gate_up": 1, "down": 8}, (rows, got)
    assert fp8_parts(256, 256, 1, 132) == 1


# Shared memory a program may use on sm_90 (227 KB).
SM90_MAX_SHARED_PER_PROGRAM = 232_448


def test_default_tiles_compile_for_sm90_without_spills() -> None:
    """The tiles fp8_gemm.tma_fp8_gemm picks for Qwen2.5-3B's projections at 1, 16 and 64 rows
    (e4m3 x and weight-only bf16 x; the gated form too) compile for sm_90 with no register
    spills, within an SM's shared memory, with e4m3 x e4m3 (or bf16) wgmma that ptxas does not
    serialize and TMA bulk copies. Compiled by Triton without a GPU, in a process of its own
    (this one may run Triton under the interpreter)."""
    cases: list = []
    for n, k in ((2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)):
        for rows in (1, 16, 64):
            parts = fp8_parts(n, k, rows, 132)
            for x_dtype, elem in (("fp8e4nv", 1), ("bf16", 2)):
                cfg = plain_config(n, parts, 132, rows, False, elem)
                tiles = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
                cases.append([x_dtype, rows, tiles, False])
    gated = plain_config(11008, 1, 132, 1, True, 1)
    cases.append(["fp8e4nv", 1, [gated.block_n, gated.block_k, 4, gated.num_stages], True])
    cases = [c for i, c in enumerate(cases) if c not in cases[:i]]
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_fp8_tma.py"
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    for case, (shared, regs, spilled, wgmma, bulk, serialized) in zip(cases, got, strict=True):
        assert not serialized, case  # ptxas kept the wgmma asynchronous (C7515)
        assert 0 < shared <= SM90_MAX_SHARED_PER_PROGRAM, (case, shared)
        assert spilled == 0, (case, regs, spilled)
        assert wgmma == (["e4m3.e4m3"] if case[0] == "fp8e4nv" else ["bf16.bf16"]), case
        assert bulk, case


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64])
@pytest.mark.parametrize(("n", "k"), [(2560, 2048), (2048, 11008), (22016, 2048)])
@pytest.mark.parametrize("how", ["token", "none"])
def test_3b_shapes_on_the_gpu(m, n, k, how) -> None:
    """bf16 at the 3B projections through auto's pick (the TMA GEMM on Hopper, within the
    reference's tolerance) and against the pointer kernel."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA GEMM runs on Hopper or newer")
    w, ws = (t.cuda() for t in weights(n, k, seed=m, per_tensor=False))
    x = activations(m, k, seed=m + n, dtype=torch.bfloat16).cuda()
    bias = torch.randn(n, device="cuda").bfloat16()
    act = "token" if how == "token" else "none"
    xq, xs = kern.quantize_rows(x) if how == "token" else (x, None)
    assert kern.tma_readable(xq, xs, w, ws)
    ref = reference(xq.cpu(), None if xs is None else xs.cpu(), w.cpu(), ws.cpu(), bias.cpu())
    got = kern.fp8_linear(x, w, ws, bias, activations=act)
    assert rel_err(got.cpu(), ref) < 2**-7  # one bf16 rounding of the sum
    triton = kern.fp8_linear(x, w, ws, bias, activations=act, gemm="triton")
    assert rel_err(got.cpu(), triton.double().cpu()) < 2**-6


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    "name", ["channel-token", "tensor-static", "tensor-tensor", "channel-weight-only"]
)
@pytest.mark.parametrize("m", [1, 8])
def test_fp8_linear_layer_parts_on_the_gpu(name, m) -> None:
    """Fp8Linear on the GPU: forward_parts (K-slice parts from the TMA GEMM on Hopper, the bias
    in part 0) and forward_split (no bias left) sum to forward, which matches the CPU
    reference layer's output."""
    from test_fp8 import LAYOUTS, loaded_layer

    from inferx_core.interfaces.quant import LinearSpec

    spec = LinearSpec("model.layers.0.mlp.down_proj", 2048, (1024,), bias=True, parallel="row")
    layer, _, _, _ = loaded_layer(LAYOUTS[name], spec, dtype=torch.bfloat16, seed=m)
    x = activations(m, 2048, seed=m, dtype=torch.bfloat16)
    ref = layer(x).double()  # the CPU reference
    layer = layer.cuda()
    x = x.cuda()
    y = layer(x)
    parts = layer.forward_parts(x)
    split, bias = layer.forward_split(x)
    if torch.cuda.get_device_capability()[0] >= 9:
        assert parts.shape[0] > 1  # the TMA GEMM splits K at these rows
    assert bias is None and torch.equal(split, parts)
    assert rel_err(y.cpu(), ref) < 2**-6
    assert rel_err(parts.double().sum(0).cpu(), ref) < 2**-6
