"""tma_gated_phases (inferx_kernels_cuda.tma_gemm): gate_up and SiLU-and-mul in one launch, its
tiles in up to three phases of narrowing width; the plan (phases_for), and the product against
float64 on the CPU under the interpreter (ragged M, N and K) and in bf16 at Llama-3.1-8B's and
Qwen2.5-3B's shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_kernels_cuda.tma_gemm import phases_for, tma_gated_phases  # noqa: E402


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


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


def test_the_plan_balances_8b_gate_up_over_132_sms() -> None:
    """8B at 256 rows (2 row blocks): 66 column blocks a phase; 128, 64 and 32 columns cover
    14,336 as 66 + 66 + 52 blocks, so no program takes more than 1.75 wide tiles' work."""
    assert phases_for(256, 14336, 132) == [(128, 0, 66), (64, 8448, 66), (32, 12672, 52)]
    assert phases_for(256, 11008, 132) == [(128, 0, 66), (64, 8448, 40)]  # 3B: two phases
    assert phases_for(128, 14336, 132) == [(128, 0, 112)]  # one row block: all fit at once
    assert phases_for(256, 14336, 132, (128,)) == [(128, 0, 112)]  # the plain plan
    for m, n, p in ((200, 5000, 132), (1, 100, 3), (300, 14336, 132), (256, 96, 132)):
        plan = phases_for(m, n, p)
        col = 0
        for w, start, blocks in plan:  # contiguous, in order, the last covering n
            assert start == col
            col += w * blocks
        assert col >= n > col - plan[-1][0]


@interpreted
@pytest.mark.parametrize(
    ("m", "n", "k", "programs"),
    [(40, 48, 96, 2), (150, 100, 80, 4), (5, 24, 64, 1), (130, 56, 64, 100)],
)
def test_matches_float64(m: int, n: int, k: int, programs: int) -> None:
    """Small widths (16, 8, 8) so a few programs need all three phases; rows past a 128-row
    block and columns past the last tile (gate tiles reaching into the up rows) not stored."""
    for dtype, tol in ((torch.float16, 2**-8), (torch.float32, 1e-5)):
        x, w = inputs(m, 2 * n, k, dtype, "cpu", seed=m + n)
        out = tma_gated_phases(x, w, programs, widths=(16, 8, 8), num_warps=4, num_stages=2)
        assert out.shape == (m, n) and out.dtype == dtype
        assert rel_err(out, reference(x, w)) < tol, (dtype, phases_for(m, n, programs, (16, 8, 8)))


def test_refuses_what_tma_cannot_read() -> None:
    x, w = inputs(1, 40, 64, torch.float16, "cpu", seed=3)
    with pytest.raises(ValueError, match="must agree on K"):
        tma_gated_phases(x, w[:, :32], 132)
    with pytest.raises(ValueError, match="gate then up rows"):
        tma_gated_phases(x, w[:39], 132)
    with pytest.raises(ValueError, match="must share float16, bfloat16 or float32"):
        tma_gated_phases(x.float(), w, 132)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        odd = torch.zeros(40, 68, dtype=torch.float16)[:, :60]  # rows 136 bytes apart
        tma_gated_phases(torch.zeros(1, 60, dtype=torch.float16), odd, 132)
    with pytest.raises(ValueError, match="at most three phases"):
        tma_gated_phases(x, w, 1, widths=(8, 4, 2, 1))


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [65, 192, 256])
@pytest.mark.parametrize(("i", "k"), [(14336, 4096), (11008, 2048)])
def test_bf16_on_the_gpu(m: int, i: int, k: int) -> None:
    x, w = inputs(m, 2 * i, k, torch.bfloat16, "cuda", seed=m + i)
    w = w * 0.02
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for widths in ((128, 64, 32), (128,)):
        out = tma_gated_phases(x, w, sms, widths)
        assert rel_err(out, reference(x, w)) < 2**-6, widths
