"""One call's GPU time as a decode step sees it, for the kernel benchmarks (w4a16_gemm,
fp8_gemm): the calls captured in a CUDA graph (no launch gaps counted), cycling over copies of
the weights that together exceed the L2 cache twice over (cold weights, as in a forward pass)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

L2_BYTES = 50 << 20  # H100's L2


def copies_for(weight_bytes: int, cuda: bool) -> int:
    """How many copies of a weight of this many bytes exceed the L2 cache twice over."""
    return max(1, -(-2 * L2_BYTES // weight_bytes)) if cuda else 1


def time_calls(
    fns: list[Callable[[], object]], cuda: bool, calls: int = 20, reps: int = 20
) -> float:
    """µs a call: on CUDA a graph of `calls` calls (cycling over fns) replayed `reps` times; on
    the CPU a few calls by the wall clock."""
    if not cuda:
        start = time.perf_counter()
        for i in range(3):
            fns[i % len(fns)]()
        return (time.perf_counter() - start) / 3 * 1e6
    for fn in fns:
        fn()  # compile and warm up outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * calls)
