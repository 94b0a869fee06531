"""What the GPU tests of the attention backends share: a decode step captured into a CUDA graph
as the runtime captures it, its replays, and an engine's greedy runs on the GPU with every
step's logits recorded for test_cuda_graphs.compare_runs."""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inferx_core.batch import make_attention_batch
from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.interfaces.kv import KVLayerSpec


def zero_decode_inputs(
    layers: list[KVLayerSpec], size: int, dtype: torch.dtype, device: torch.device
) -> list[list[torch.Tensor]]:
    """Each layer's q, k and v for `size` decode rows, zeros: the static inputs a graph reads."""
    return [
        [torch.zeros(size, h, s.head_dim, dtype=dtype, device=device) for h in heads]
        for s in layers
        for heads in [(s.num_q_heads, s.num_kv_heads, s.num_kv_heads)]
    ]


def capture(
    backend: Any, size: int, step: Callable[[], list[torch.Tensor]]
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """`step` captured for `size` rows through the backend's graph hooks, as the runtime does
    it: prepare_for_capture, one eager run first (it warms up and reads the scales), then the
    capture. Returns the graph and the outputs it writes on replay."""
    backend.prepare_for_capture(size)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    return graph, outs


def replay(
    graph: torch.cuda.CUDAGraph,
    inputs: list[list[torch.Tensor]],
    eager: list[Any],
    contexts: list[int],
    tables: list[list[int]],
    block_size: int,
    spread: float = 1.0,
) -> None:
    """Fresh random values times `spread` in every row of the graph's inputs (lists of tensors,
    as zero_decode_inputs gives them; padding rows get garbage too), the graph replayed, and the
    decode step over `contexts` begun on each of the `eager` backends that the graph's outputs
    are compared with."""
    device = inputs[0][0].device
    for x in (t for group in inputs for t in group):
        x.copy_((torch.randn(x.shape, device=device) * spread).to(x.dtype))
    graph.replay()
    batch = make_attention_batch([1] * len(contexts), contexts, tables, block_size, device)
    for backend in eager:
        backend.begin_step(batch)


def recorded_runs(
    path: Path,
    backend: str,
    graphs: bool,
    overrides: dict[str, Any],
    batches: list[tuple[list[list[int]], Any]],
    check: Callable[[LLM], None] = lambda llm: None,
) -> list[tuple[list, list]]:
    """An engine of the checkpoint at `path` in bf16 on the GPU, attention_backend `backend`,
    CUDA graphs captured or not as `graphs` says (and replayed when captured), generates each
    (prompts, sampling params) batch with every step's logits recorded; `check` asserts what
    it must of the engine after the runs. Returns (completions, steps) per batch; the engine
    is freed first, so that the next one has the GPU's memory."""
    from test_cuda_graphs import LogitsRecorder

    llm = LLM(
        load_config(
            None,
            {
                "model.path": str(path),
                "model.dtype": "bfloat16",
                "engine.device": "cuda",
                "engine.attention_backend": backend,
                "engine.cuda_graphs": graphs,
                **overrides,
            },
        )
    )
    ex = llm.engine.executor
    assert (ex.graphs is not None) == graphs, ex.eager_reason
    recorder = ex.sampler = LogitsRecorder(ex.sampler)
    runs = [(llm.generate(prompts, params), recorder.take()) for prompts, params in batches]
    if graphs:
        print(f"{path.name}/{backend}: graph replays by padded size {dict(ex.graphs.replays)}")
        assert sum(ex.graphs.replays.values()) > 0
    check(llm)
    del llm, ex, recorder
    gc.collect()
    torch.cuda.empty_cache()
    return runs
