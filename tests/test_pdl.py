"""Programmatic dependent launch (inferx_kernels_cuda.pdl): when it is on, and that a kernel
launched with it still reads what the kernel before it wrote, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from conftest import on_gpu

from inferx_core.ops_torch import TorchOps
from inferx_kernels_cuda import pdl
from inferx_kernels_cuda.ops import TritonOps


def test_off_for_the_cpu() -> None:
    assert not pdl.pdl_enabled("cpu")
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.gpu
@on_gpu
def test_on_for_hopper_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    pdl._enabled.cache_clear()
    monkeypatch.setenv("INFERX_PDL", "1")
    assert pdl.pdl_enabled("cuda") == hopper
    assert pdl.launch_options("cuda").get("launch_pdl", False) == hopper
    pdl._enabled.cache_clear()
    monkeypatch.setenv("INFERX_PDL", "0")
    assert not pdl.pdl_enabled("cuda")
    pdl._enabled.cache_clear()


@pytest.mark.gpu
@on_gpu
def test_kernels_wait_for_a_slow_producer_inside_a_graph() -> None:
    """A GEMM writes y; add + RMSNorm (PDL) reads y and the residual, SiLU-and-mul (PDL) reads
    the norm's output. Replayed on fresh inputs, every result must be this replay's: a kernel
    that ran ahead of its producer would read the last replay's values."""
    dev = torch.device("cuda")
    rows, k, n = 8, 8192, 4096
    a = torch.empty(rows, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16) / k**0.5
    residual = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
    weight = torch.rand(n, device=dev, dtype=torch.bfloat16) + 0.5
    ops, ref = TritonOps(), TorchOps()

    def step() -> tuple[torch.Tensor, ...]:
        y = a @ b
        normed, summed = ops.rms_norm(y, weight, 1e-6, residual)
        return y, normed, summed, ops.silu_and_mul(normed)

    a.normal_()
    residual.normal_()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(5):
        a.normal_()
        residual.normal_()
        graph.replay()
        torch.cuda.synchronize()
        y, normed, summed, act = outs
        torch.testing.assert_close(y, a @ b, rtol=0, atol=0)
        want_normed, want_summed = ref.rms_norm(y, weight, 1e-6, residual)
        torch.testing.assert_close(summed, want_summed, rtol=0, atol=0)
        torch.testing.assert_close(normed, want_normed, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(act, ref.silu_and_mul(normed), rtol=1.6e-2, atol=1e-2)
