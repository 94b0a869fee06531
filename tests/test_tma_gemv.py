"""tma_linear_parts (inferx_kernels_cuda.tma_gemv): partial products over K slices, read through
TMA tensor descriptors, against float64 and F.linear; on the CPU under the interpreter (which
runs tensor descriptors, zero fill past the edges included), bf16 at the real shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_kernels_cuda.tma_gemv import MAX_ROWS, TmaGemvConfig, tma_linear_parts  # noqa: E402

SMALL = TmaGemvConfig(block_n=32, block_k=32, num_stages=2)


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


@interpreted
@pytest.mark.parametrize("m", [1, 3, 16, 40])
@pytest.mark.parametrize(("n", "k", "parts"), [(100, 96, 1), (70, 200, 3), (33, 64, 2)])
def test_half_parts_sum_to_the_product(m: int, n: int, k: int, parts: int) -> None:
    """float16 (the interpreter rounds fp32 to bf16 by truncation; bf16 runs on the GPU below).
    Ragged N and K: the descriptors zero-fill past both edges, and rows past M."""
    x, w = inputs(m, n, k, torch.float16, "cpu", seed=m * 7 + n)
    out = tma_linear_parts(x, w, parts, SMALL)
    assert out.shape == (parts, m, n) and out.dtype == torch.float16
    ref = x.double() @ w.double().T
    # Each part is rounded once to fp16 (2**-11 relative to its own size, at most the total's).
    assert rel_err(out.sum(0), ref) < parts * 2**-10


@interpreted
def test_each_part_is_its_slice_of_k() -> None:
    x, w = inputs(2, 40, 128, torch.float16, "cpu", seed=1)
    out = tma_linear_parts(x, w, 4, SMALL)  # 32 columns of K a part
    for s in range(4):
        ks = slice(32 * s, 32 * (s + 1))
        assert rel_err(out[s], x[:, ks].double() @ w[:, ks].double().T) < 2**-10


@interpreted
def test_more_parts_than_k_blocks_gives_zero_parts() -> None:
    x, w = inputs(1, 40, 64, torch.float16, "cpu", seed=2)
    out = tma_linear_parts(x, w, 4, SMALL)  # 2 K blocks of 32 over 4 parts
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert rel_err(out.sum(0), x.double() @ w.double().T) < 2**-9


def test_refuses_what_tma_cannot_read() -> None:
    x, w = inputs(1, 40, 64, torch.float16, "cpu", seed=3)
    with pytest.raises(ValueError, match="must agree on K"):
        tma_linear_parts(x, w[:, :32])
    with pytest.raises(ValueError, match="1 to 64 rows"):
        tma_linear_parts(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="must share float16, bfloat16 or float32"):
        tma_linear_parts(x.float(), w)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        odd = torch.zeros(40, 68, dtype=torch.float16)[:, :60]  # rows 136 bytes apart
        tma_linear_parts(torch.zeros(1, 60, dtype=torch.float16), odd)


# (n, k) of the decode GEMMs: Qwen2.5-3B QKV, o_proj, gate_up, down_proj, then Llama-3.1-8B's.
REAL = {
    "3b-qkv": (2560, 2048), "3b-o": (2048, 2048), "3b-gate_up": (22016, 2048),
    "3b-down": (2048, 11008), "8b-qkv": (6144, 4096), "8b-o": (4096, 4096),
    "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
}  # fmt: skip


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("parts", [1, 4])
def test_gpu_bf16_real_shapes(shape: str, m: int, parts: int) -> None:
    n, k = REAL[shape]
    x, w = inputs(m, n, k, torch.bfloat16, "cuda", seed=m)
    out = tma_linear_parts(x, w * 0.02, parts)
    # F.linear rounds once; the parts' sum rounds each part (a bf16 ulp, 2**-8, each).
    assert rel_err(out.float().sum(0), F.linear(x, w * 0.02)) < parts * 2**-7


@on_gpu
@pytest.mark.gpu
def test_gpu_graph_replays_new_inputs() -> None:
    n, k = REAL["3b-down"]
    x, w = inputs(1, n, k, torch.bfloat16, "cuda", seed=5)
    static_x = x.clone()
    tma_linear_parts(static_x, w, 4)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tma_linear_parts(static_x, w, 4)
    for seed in range(3):
        static_x.copy_(inputs(1, n, k, torch.bfloat16, "cuda", seed=50 + seed)[0])
        graph.replay()
        assert rel_err(out.float().sum(0), F.linear(static_x, w)) < 4 * 2**-7


def test_bench_grid_and_gpu_check(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import bench_tma_gemv

    small, full = bench_tma_gemv.configs("small"), bench_tma_gemv.configs("full")
    assert len(set(small)) == len(small) == 8 and set(small) <= set(full)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["bench_tma_gemv.py"])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench_tma_gemv.main()
