"""The FP8 GPU kernels (inferx_kernels_cuda.fp8_gemm) against inferx_quant.fp8's reference:
activation quantization bit for bit, the GEMMs against the exact dequantized operands in fp32.
Runs on the CPU in Triton's interpreter at small sizes; on a GPU as they are."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
from inferx_kernels_cuda import fp8_gemm as kern  # noqa: E402
from inferx_quant.fp8 import (  # noqa: E402
    FP8,
    Fp8Format,
    _expand_cols,
    quantize_activations,
    quantize_weight_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)
HALF = torch.float16 if DEVICE == "cpu" else torch.bfloat16


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    return x.to(HALF).to(DEVICE)


@pytest.mark.parametrize("m,k", [(1, 96), (5, 300), (3, 1024)])
def test_per_token_quantization_is_the_references(m, k):
    x = _x(m, k, m + k)
    q, s = kern.quantize_rows(x)
    ref_q, ref_s = quantize_activations(x.cpu(), Fp8Format(activations="token"))
    assert torch.equal(s.cpu(), ref_s)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("m,k", [(2, 256), (4, 320)])
def test_group_quantization_is_the_references(m, k):
    x = _x(m, k, 7 * m + k)
    q, s = kern.quantize_rows(x, group=128)
    fmt = Fp8Format(weights="block", activations="group", block=(128, 128))
    ref_q, ref_s = quantize_activations(x.cpu(), fmt)
    assert torch.equal(s.cpu(), ref_s)
    assert torch.equal(q.cpu().view(torch.uint8), ref_q.view(torch.uint8))


def test_a_zero_row_keeps_a_finite_scale():
    x = torch.zeros(2, 64, dtype=HALF, device=DEVICE)
    q, s = kern.quantize_rows(x)
    assert torch.isfinite(s).all() and (q.float() == 0).all()


def _reference(xq, xs, w, ws, bias, block=None):
    """Both operands dequantized exactly, one fp32 GEMM."""
    k = xq.shape[1]
    xd = xq.float().cpu()
    if xs is not None:
        xs = xs.float().cpu()
        xd = xd * (_expand_cols(xs, block[1], k) if xs.shape[1] > 1 else xs)
    wd = w.float().cpu()
    if block is not None:
        bn, bk = block
        sc = ws.cpu().repeat_interleave(bn, 0)[: w.shape[0]]
        wd = wd * _expand_cols(sc, bk, k)
    else:
        wd = wd * ws.cpu()[:, None]
    y = xd @ wd.t()
    return y if bias is None else y + bias.float().cpu()


def _weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, s = quantize_weight_rows(torch.randn(n, k, generator=g) * 0.05)
    return w.to(DEVICE), s.to(DEVICE)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    # One rounding of the fp32 result to the output dtype, plus fp32 summation order.
    tol = 1e-2 if got.dtype == torch.bfloat16 else 2e-3
    err = (got.float().cpu() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), err


@pytest.mark.parametrize("m", [1, 7, 20, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_per_row_gemm_equals_the_dequantized_product(m, bias):
    n, k = 96, 512
    w, ws = _weights(n, k, m)
    x = _x(m, k, 100 + m)
    b = (torch.randn(n) * 0.1).to(HALF).to(DEVICE) if bias else None
    xq, xs = kern.quantize_rows(x)
    got = kern.triton_fp8_gemm(xq, xs, w, ws, b, HALF)
    assert got.shape == (m, n) and got.dtype == HALF
    _close(got, _reference(xq, xs, w, ws, b))


def test_split_k_partials_sum_to_the_product():
    m, n, k = 2, 64, 2048  # one output tile: K is split over programs
    assert kern._tiles(m, n, k, 0)[3] > 1
    w, ws = _weights(n, k, 3)
    xq, xs = kern.quantize_rows(_x(m, k, 4))
    _close(kern.triton_fp8_gemm(xq, xs, w, ws, None, HALF), _reference(xq, xs, w, ws, None))


@pytest.mark.parametrize("m,n,k", [(3, 200, 384), (33, 256, 640)])
def test_block_scaled_gemm_equals_the_dequantized_product(m, n, k):
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=g) * 0.3).to(FP8).to(DEVICE)
    ws = (torch.rand(-(-n // 128), -(-k // 128), generator=g) + 0.5).to(DEVICE) * 0.01
    x = _x(m, k, m * 3)
    xq, xs = kern.quantize_rows(x, group=128)
    got = kern.triton_fp8_gemm(xq, xs, w, ws, None, HALF, block=(128, 128))
    _close(got, _reference(xq, xs, w, ws, None, (128, 128)))


def test_weight_only_gemm_equals_the_dequantized_product():
    m, n, k = 4, 64, 256
    w, ws = _weights(n, k, 9)
    x = _x(m, k, 10)
    got = kern.fp8_linear(x, w, ws, activations="none")
    _close(got, x.float().cpu() @ (w.float().cpu() * ws.cpu()[:, None]).t())


@pytest.mark.parametrize("activations", ["token", "tensor", "static"])
def test_fp8_linear_matches_the_cpu_reference_layer(activations):
    m, n, k = 6, 128, 256
    w, ws = _weights(n, k, 11)
    x = _x(m, k, 12)
    fmt = Fp8Format(activations=activations)
    static = torch.tensor([0.02], device=DEVICE) if activations == "static" else None
    got = kern.fp8_linear(x, w, ws, activations=activations, input_scale=static, gemm="triton")
    xq, xs = quantize_activations(x.cpu(), fmt, static.cpu() if static is not None else None)
    _close(got, _reference(xq, xs, w, ws, None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 512])
def test_cublas_and_triton_agree_on_the_gpu(m):
    n, k = 2048, 2048
    w, ws = _weights(n, k, m)
    x = _x(m, k, m + 1)
    b = torch.randn(n, device=DEVICE).to(HALF)
    xq, xs = kern.quantize_rows(x)
    ref = _reference(xq, xs, w, ws, b)
    for gemm in ("triton", "cublas"):
        _close(kern.fp8_linear(x, w, ws, b, gemm=gemm), ref)
