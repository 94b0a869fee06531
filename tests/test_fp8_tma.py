"""The FP8 TMA decode GEMM (tma_gemv.tma_fp8_linear_parts, fp8_gemm.tma_fp8_gemm) against the
exact dequantized operands in float64: e4m3 activations quantized as the reference quantizes
them (per token, per tensor, static) or half-precision x (weight-only), per-channel and
per-tensor weight scales, bias, K-slice parts, the gated SiLU form; what TMA cannot read is
refused and auto falls back. The fused decode kernels' weight-only FP8 variants too (w_scale:
the norm inside QKV / gate_up, tma_norm_linear; the attention's split combine inside o_proj,
tma_reduce_linear). On the CPU under the interpreter (tensor descriptors run there,
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
from test_tma_gemv import decode_splits, norm_inputs, norm_then_product  # noqa: E402
from test_tma_gemv import reduced_reference as combined  # noqa: E402

from inferx_core.quant_utils import quantize_fp8  # noqa: E402
from inferx_kernels_cuda import fp8_gemm as kern  # noqa: E402
from inferx_kernels_cuda.tma_gemv import (  # noqa: E402
    FP8,
    TmaGemvConfig,
    TmaNormConfig,
    fp8_input_problem,
    fp8_parts,
    norm_config,
    plain_config,
    reduce_config,
    tma_fp8_linear_parts,
    tma_norm_linear,
    tma_reduce_linear,
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


def test_parts_split_the_narrow_3b_projections_in_four() -> None:
    """QKV, o_proj and down_proj in 4 K-slices, gate_up whole (enough row blocks), at 1 and 64
    rows on 132 SMs; a K too short for two tiles a slice stays whole."""
    shapes = {"qkv": (2560, 2048), "o": (2048, 2048), "gate_up": (22016, 2048)}
    shapes["down"] = (2048, 11008)
    for rows in (1, 64):
        got = {name: fp8_parts(n, k, rows, 132) for name, (n, k) in shapes.items()}
        assert got == {"qkv": 4, "o": 4, "gate_up": 1, "down": 4}, (rows, got)
    assert fp8_parts(256, 256, 1, 132) == 1


# --- weight-only FP8 inside the fused decode kernels (w_scale) ---------------------------------


def dequantized(w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The exact weight an e4m3 tensor and its row scales stand for, in float64."""
    return w.double() * ws.double()[:, None]


@interpreted
@pytest.mark.parametrize(
    ("s_in", "m", "k", "n", "parts", "gated"),
    [(4, 1, 128, 96, 4, False), (3, 5, 112, 70, 2, False), (1, 3, 96, 80, 1, True),
     (4, 17, 144, 64, 1, True)],
)  # fmt: skip
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2**-11), (torch.float32, 2e-6)])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_norm_linear_weight_only_fp8(s_in, m, k, n, parts, gated, dtype, tol, per_tensor) -> None:
    """The norm inside the GEMM with an e4m3 weight cast in registers and its row scales on the
    products (gate and up rows each their own, before SiLU-and-mul): against the unfused norm
    (TorchOps) and the float64 product with the exact dequantized weight. Ragged K and N
    against 32 x 32 tiles (e4m3 rows 16-byte aligned), rows past 16, K-slice parts; the new
    residual to the bit. fp16: the bf16 path's tolerance ((parts + 3) fp16 ulps); fp32
    against float64."""
    x, res, nw, _ = norm_inputs(s_in, m, k, 1, dtype, "cpu", seed=k + m)
    w, ws = weights(2 * n if gated else n, k, seed=n + m, per_tensor=per_tensor)
    cfg = TmaNormConfig(32, 32, 4, 2, select_own=gated)
    out, summed = tma_norm_linear(x, res, nw, 1e-6, w, parts, gated, cfg, w_scale=ws)
    ref, ref_summed = norm_then_product(x, res, nw, dequantized(w, ws), gated)
    assert torch.equal(summed, ref_summed)
    assert out.shape == ((m, n) if gated else (parts, m, n)) and out.dtype == dtype
    assert rel_err(out if gated else out.sum(0), ref) < (parts + 3) * tol
    # the scales matter: the same e4m3 values with every row scale doubled double the output
    twice, _ = tma_norm_linear(x, res, nw, 1e-6, w, parts, gated, cfg, w_scale=2 * ws)
    if not gated:
        assert rel_err(twice.sum(0), 2 * ref) < (parts + 3) * tol


@interpreted
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("seq_split", [True, False])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2**-8), (torch.float32, 1e-5)])
@pytest.mark.parametrize("block_k", [32, 64])
def test_reduce_linear_weight_only_fp8(m, seq_split, dtype, tol, block_k) -> None:
    """The split combine inside o_proj with an e4m3 weight: a K step a head (block_k 32) or
    the whole slice's tile before the wait (64), the combined rows rounded to out_dtype and
    each output row times its scale, against the float64 combine (rounded alike) and product
    with the exact dequantized weight; tolerances of the bf16 path's test."""
    sp = decode_splits(m, 4, 32, 8, seq_split, "cpu", seed=m + 10 * seq_split)
    w, ws = weights(40, 128, seed=m + block_k, per_tensor=False)
    cfg = TmaGemvConfig(32, block_k, 4, 2)
    out = tma_reduce_linear(sp, w, 2, cfg, split_chunk=2, w_scale=ws, out_dtype=dtype)
    assert out.shape == (2, m, 40) and out.dtype == dtype
    x = combined(sp).to(dtype)
    assert rel_err(out.sum(0), x.double() @ dequantized(w, ws).T) < tol


def test_fused_kernels_refuse_what_weight_only_fp8_cannot_take() -> None:
    x, res, nw, _ = norm_inputs(2, 2, 64, 1, torch.float16, "cpu", seed=1)
    w, ws = weights(40, 64, seed=2, per_tensor=False)
    with pytest.raises(ValueError, match="must share float16"):
        tma_norm_linear(x, res, nw, 1e-6, w)  # e4m3 without its scales
    with pytest.raises(ValueError, match="scale per row"):
        tma_norm_linear(x, res, nw, 1e-6, w, w_scale=torch.ones(1, 1))  # block scales
    with pytest.raises(ValueError, match="must share a dtype"):
        tma_norm_linear(x, res, nw.float(), 1e-6, w, w_scale=ws)
    sp = decode_splits(2, 4, 16, 8, True, "cpu", seed=1)
    with pytest.raises(ValueError, match="needs out_dtype"):
        tma_reduce_linear(sp, w, 2, w_scale=ws)
    with pytest.raises(ValueError, match="scale per row"):
        tma_reduce_linear(sp, w, 2, w_scale=ws[:20], out_dtype=torch.float16)
    # an e4m3 weight takes a head a K step (its whole slice cast in registers spills)
    w3 = torch.empty(2048, 2048, dtype=FP8)
    sp3 = decode_splits(1, 16, 128, 4, True, "cpu", 0)
    assert reduce_config(sp3, w3, 4) == TmaGemvConfig(64, 128, 4, 3)


# Shared memory a program may use on sm_90 (227 KB).
SM90_MAX_SHARED_PER_PROGRAM = 232_448


def test_default_tiles_compile_for_sm90_without_spills() -> None:
    """The tiles fp8_gemm.tma_fp8_gemm picks for Qwen2.5-3B's projections at 1, 16 and 64 rows
    (e4m3 x and weight-only bf16 x; the gated form too) compile for sm_90 with no register
    spills, within an SM's shared memory, with e4m3 x e4m3 (or bf16) wgmma and TMA bulk
    copies. Compiled by Triton without a GPU, in a process of its own (this one may run
    Triton under the interpreter)."""
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
    for case, (shared, regs, spilled, wgmma, bulk) in zip(cases, got, strict=True):
        assert 0 < shared <= SM90_MAX_SHARED_PER_PROGRAM, (case, shared)
        assert spilled == 0, (case, regs, spilled)
        assert wgmma == (["e4m3.e4m3"] if case[0] == "fp8e4nv" else ["bf16.bf16"]), case
        assert bulk, case


def test_fused_weight_only_variants_compile_for_sm90_without_spills() -> None:
    """The W_SCALED variants TritonOps runs at Qwen2.5-3B's decode shapes (hidden 2048,
    intermediate 11008, 16 heads of 128 over 2 KV heads): the norm inside gate_up (gated, 1-8
    rows) and inside QKV (4 K-slices, as tma_norm_qkv would), each after 4 parts of the GEMM
    before, at norm_config's tiles; the split combine inside o_proj (4 slices of 4 heads, a
    head a K step) at 1-8 rows with tma_reduce_linear's chunk. bf16 x bf16 wgmma on the cast
    e4m3 tiles, TMA bulk copies, no spills, within an SM's shared memory."""
    from inferx_kernels_cuda.tma_gemv import REDUCE_TILE

    cases: list = []
    for rows in (1, 4, 8):
        for gated, parts in ((True, 1), (False, 4)):
            cfg = norm_config(rows, parts, gated)
            tiles = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, cfg.select_own]
            cases.append(["norm", rows, tiles, gated, parts, 4])
    o_proj = torch.empty(2048, 2048, dtype=FP8)
    for rows in (1, 2, 4, 8):
        cfg = reduce_config(decode_splits(rows, 16, 128, 4, True, "cpu", 0), o_proj, 4)
        chunk = REDUCE_TILE // (rows * 4 * 128)
        tiles = [cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]
        cases.append(["reduce", rows, tiles, 16, 128, 4, chunk])
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_fp8_tma.py"
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    for case, (shared, regs, spilled, wgmma, bulk) in zip(cases, got, strict=True):
        assert 0 < shared <= SM90_MAX_SHARED_PER_PROGRAM, (case, shared)
        assert spilled == 0, (case, regs, spilled)
        assert wgmma == ["bf16.bf16"] and bulk, case


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


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_norm_linear_weight_only_fp8_3b_shapes(m, gated) -> None:
    """The norm inside Qwen2.5-3B's gate_up (gated) and QKV (4 K-slices) with per-channel e4m3
    weights, bf16, TritonOps' tiles (norm_config), against the unfused norm and the float64
    product with the dequantized weight: the bf16 path's tolerance."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels run on Hopper or newer")
    n, k = (22016, 2048) if gated else (2560, 2048)
    parts = 1 if gated else 4
    x, res, nw, _ = norm_inputs(4, m, k, 1, torch.bfloat16, "cuda", seed=m + n)
    w, ws = (t.cuda() for t in weights(n, k, seed=m, per_tensor=False))
    cfg = norm_config(m, parts, gated)
    out, summed = tma_norm_linear(x, res, nw, 1e-6, w, parts, gated, cfg, w_scale=ws)
    ref, ref_summed = norm_then_product(x, res, nw, dequantized(w, ws), gated)
    torch.testing.assert_close(summed, ref_summed, rtol=2**-8, atol=0)
    got = out if gated else out.float().sum(0)
    assert rel_err(got.cpu(), ref.cpu()) < (parts + 3) * 2**-8


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gpu_reduce_linear_weight_only_fp8_3b_shapes(m) -> None:
    """The split combine inside Qwen2.5-3B's o_proj (16 heads of 128, 4 K-slices, a head a K
    step) with per-channel e4m3 weights, 64 splits, bf16 out, against the float64 combine
    (rounded to bf16) and product with the dequantized weight."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels run on Hopper or newer")
    sp = decode_splits(m, 16, 128, 64, True, "cuda", seed=m)
    w, ws = (t.cuda() for t in weights(2048, 2048, seed=m + 1, per_tensor=False))
    out = tma_reduce_linear(sp, w, 4, w_scale=ws, out_dtype=torch.bfloat16)
    assert out.shape == (4, m, 2048) and out.dtype == torch.bfloat16
    x = combined(sp).to(torch.bfloat16).double()
    ref = x @ dequantized(w, ws).cpu().T
    assert rel_err(out.float().sum(0).cpu(), ref) < 6 * 2**-8
