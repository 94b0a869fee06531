"""tma_gemm (inferx_kernels_cuda.tma_gemm): the TMA GEMM for 65+ rows, as K-slice parts and
with SiLU-and-mul in its epilogue, one program a tile or a persistent grid; against float64 on
the CPU under the interpreter (small tiles, ragged M, N and K), bf16 at the real shapes on a
GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_kernels_cuda.tma_gemm import (  # noqa: E402
    TmaGemmConfig,
    tma_gemm,
    tma_gemm_silu_and_mul,
)

# 16-row tiles, groups of 2 row blocks; one program a tile, or 3 programs looping over them
# (with and without the flattened loop).
SMALL = [
    TmaGemmConfig(16, 32, 32, group_m=2, num_warps=4, num_stages=2),
    TmaGemmConfig(16, 16, 32, group_m=2, num_warps=4, num_stages=2, programs=3),
    TmaGemmConfig(32, 16, 16, group_m=1, num_warps=4, num_stages=2, programs=3, flatten=False),
]


def inputs(
    m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g).to(device, dtype),
        torch.randn(n, k, generator=g).to(device, dtype),
    )


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def silu_and_mul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


@interpreted
@pytest.mark.parametrize("cfg", SMALL, ids=str)
@pytest.mark.parametrize(
    ("m", "n", "k", "parts"), [(40, 48, 96, 1), (37, 70, 200, 3), (5, 33, 64, 2)]
)
def test_parts_sum_to_the_product(cfg: TmaGemmConfig, m: int, n: int, k: int, parts: int) -> None:
    """float16 and float32; ragged M, N and K (the descriptors zero-fill past the edges)."""
    for dtype, tol in ((torch.float16, parts * 2**-10), (torch.float32, 1e-5)):
        x, w = inputs(m, n, k, dtype, "cpu", seed=m * 7 + n)
        out = tma_gemm(x, w, parts, cfg)
        assert out.shape == (parts, m, n) and out.dtype == dtype
        assert rel_err(out.sum(0), x.double() @ w.double().T) < tol


@interpreted
def test_each_part_is_its_slice_of_k() -> None:
    x, w = inputs(20, 40, 128, torch.float32, "cpu", seed=1)
    out = tma_gemm(x, w, 4, SMALL[1])  # 32 columns of K a part
    for s in range(4):
        ks = slice(32 * s, 32 * (s + 1))
        assert rel_err(out[s], x[:, ks].double() @ w[:, ks].double().T) < 1e-5


@interpreted
@pytest.mark.parametrize("cfg", SMALL, ids=str)
@pytest.mark.parametrize("m", [3, 40])
def test_silu_and_mul_in_the_epilogue(cfg: TmaGemmConfig, m: int) -> None:
    """gate rows 0..49, up rows 50..99: the last gate tile reaches into the up rows, whose
    outputs are never stored; K ragged (80 over 32-column tiles)."""
    for dtype, tol in ((torch.float16, 2**-8), (torch.float32, 1e-5)):
        x, w = inputs(m, 100, 80, dtype, "cpu", seed=m)
        out = tma_gemm_silu_and_mul(x, w, cfg)
        assert out.shape == (m, 50) and out.dtype == dtype
        assert rel_err(out, silu_and_mul_reference(x, w)) < tol


def test_refuses_what_tma_cannot_read() -> None:
    x, w = inputs(1, 40, 64, torch.float16, "cpu", seed=3)
    with pytest.raises(ValueError, match="must agree on K"):
        tma_gemm(x, w[:, :32])
    with pytest.raises(ValueError, match="at least one row"):
        tma_gemm(x[:0], w)
    with pytest.raises(ValueError, match="must share float16, bfloat16 or float32"):
        tma_gemm(x.float(), w)
    with pytest.raises(ValueError, match="gate then up rows"):
        tma_gemm_silu_and_mul(x, w[:39])
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        odd = torch.zeros(40, 68, dtype=torch.float16)[:, :60]  # rows 136 bytes apart
        tma_gemm(torch.zeros(1, 60, dtype=torch.float16), odd)


GPU_CONFIGS = [
    TmaGemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    TmaGemmConfig(128, 256, 64, num_warps=8, num_stages=3, programs=132),
]


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("m", [65, 256, 1000])
@pytest.mark.parametrize(("n", "k", "parts"), [(4096, 4096, 4), (2560, 2048, 1), (4096, 14336, 2)])
def test_bf16_on_the_gpu(cfg: TmaGemmConfig, m: int, n: int, k: int, parts: int) -> None:
    """bf16 at 8B / 3B shapes: each part rounded once to bf16 (2**-8 of its size)."""
    x, w = inputs(m, n, k, torch.bfloat16, "cuda", seed=m + n)
    w = w * 0.02
    out = tma_gemm(x, w, parts, cfg)
    assert rel_err(out.sum(0), x.double() @ w.double().T) < parts * 2**-7


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [TmaGemmConfig(128, 128, 64, num_warps=8, num_stages=3)], ids=str)
@pytest.mark.parametrize("m", [65, 256, 1000])
def test_bf16_silu_and_mul_on_the_gpu(cfg: TmaGemmConfig, m: int) -> None:
    x, w = inputs(m, 2 * 5504, 2048, torch.bfloat16, "cuda", seed=m)
    w = w * 0.02
    out = tma_gemm_silu_and_mul(x, w, cfg)
    assert rel_err(out, silu_and_mul_reference(x, w)) < 2**-6
