"""QuantLinear.forward_parts for the unquantized scheme: a GEMM split along K into partial
results that the next add + RMSNorm sums (quant_none.split_k_bmm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import on_gpu

from inferx_core import quant_none
from inferx_core.interfaces.quant import LinearSpec
from inferx_core.quant_none import DenseLinear, split_k_bmm

CPU = torch.device("cpu")


@pytest.mark.parametrize("parts", [1, 2, 4, 8])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 64), (5, 40, 128), (64, 8, 32)])
def test_split_k_bmm_adds_up_to_the_linear(parts: int, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(parts * 100 + m)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    got = split_k_bmm(x, w, parts)
    assert got.shape == (parts, m, n)
    for p in range(parts):  # part p is the product over the p-th slice of K
        sl = slice(p * k // parts, (p + 1) * k // parts)
        torch.testing.assert_close(got[p], x[:, sl] @ w[:, sl].T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.sum(0), F.linear(x, w), rtol=1e-12, atol=1e-12)


def dense(n: int, k: int, bias: bool, device: torch.device, dtype: torch.dtype) -> DenseLinear:
    layer = DenseLinear(LinearSpec("t", k, (n,), bias), dtype, device)
    g = torch.Generator().manual_seed(n + k)
    layer.load("weight", (torch.randn(n, k, generator=g) * 0.05).to(dtype))
    if bias:
        layer.load("bias", torch.randn(n, generator=g).to(dtype))
    return layer


def test_on_the_cpu_forward_parts_is_one_part() -> None:
    """The split is a GPU measure (cuBLAS's tile choice); on the CPU it is the plain product."""
    layer = dense(16, 64, False, CPU, torch.float32)
    x = torch.randn(3, 64)
    got = layer.forward_parts(x)
    assert got.shape == (1, 3, 16)
    assert torch.equal(got[0], layer(x))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("m", [1, 7, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_forward_parts_splits_small_batches(m: int, bias: bool) -> None:
    """Up to SPLIT_MAX_ROWS rows and no bias: SPLIT_PARTS parts whose sum is the bf16 linear's
    (within bf16 rounding of each part); more rows or a bias: the product itself, one part."""
    gpu = torch.device("cuda")
    layer = dense(2048, 2048, bias, gpu, torch.bfloat16)
    x = torch.randn(m, 2048, device=gpu, dtype=torch.bfloat16)
    got = layer.forward_parts(x)
    ref = layer(x)
    split = not bias and m <= quant_none.SPLIT_MAX_ROWS
    assert got.shape == ((quant_none.SPLIT_PARTS if split else 1), m, 2048)
    total = got.float().sum(0)
    err = ((total - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= 1e-2, err
    if not split:
        assert torch.equal(got[0], ref)


@pytest.mark.parametrize("bias", [False, True])
def test_on_the_cpu_forward_split_is_the_product_with_its_bias(bias: bool) -> None:
    """forward_split off the GPU: one part, the bias already in it, none left to add."""
    layer = dense(16, 64, bias, CPU, torch.float32)
    x = torch.randn(3, 64)
    got, rest = layer.forward_split(x)
    assert got.shape == (1, 3, 16) and rest is None
    assert torch.equal(got[0], layer(x))


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(("n", "k"), [(2560, 2048), (6144, 4096)])
@pytest.mark.parametrize("m", [1, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_gpu_forward_split_leaves_the_bias_apart(m: int, bias: bool, n: int, k: int) -> None:
    """Up to SPLIT_MAX_ROWS rows and a weight of at most SPLIT_QKV_MAX_BYTES (3B's QKV, not
    8B's): SPLIT_PARTS parts without the bias, and the bias to add (even where forward_parts
    would not split, a layer with a bias); otherwise the product with its bias, one part,
    nothing left to add."""
    gpu = torch.device("cuda")
    layer = dense(n, k, bias, gpu, torch.bfloat16)
    x = torch.randn(m, k, device=gpu, dtype=torch.bfloat16)
    got, rest = layer.forward_split(x)
    ref = layer(x)
    split = m <= quant_none.SPLIT_MAX_ROWS and n * k * 2 <= quant_none.SPLIT_QKV_MAX_BYTES
    assert got.shape == ((quant_none.SPLIT_PARTS if split else 1), m, n)
    if not split:
        assert rest is None and torch.equal(got[0], ref)
        return
    assert (rest is None) == (not bias)
    total = got.float().sum(0) + (rest.float() if bias else 0.0)
    err = ((total - ref.float()).abs().max() / ref.float().abs().max()).item()
    assert err <= 1e-2, err
