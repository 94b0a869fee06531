"""Shared test settings: where the fixtures live, and GPU tests skip without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before any test imports triton: @triton.jit picks the interpreter when a kernel is defined,
    # so without a GPU the Triton kernels run (slowly) on the CPU and CI checks them.
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(
    not INTERPRET, reason="CPU tests run the kernels under TRITON_INTERPRET=1; set it to run them"
)
on_gpu = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA and compiled Triton kernels"
)


@pytest.fixture(autouse=True)
def _no_heap_freeze(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines freeze the heap once started (engine.gc_freeze): in one test process of hundreds
    of engines that would keep every finished test's cyclic garbage to the end. Tests marked
    real_gc_freeze keep it."""
    if "real_gc_freeze" not in request.keywords:
        import inferx_core.engine

        monkeypatch.setattr(inferx_core.engine, "freeze_heap", lambda: None)
        monkeypatch.setattr(inferx_core.engine, "thaw_heap", lambda: None)


def _fixtures() -> Path:
    """The tokenizer fixtures: INFERX_FIXTURES, else the shared/ folder beside the checkout (a
    session's and CI's), else the copy vendored in tests/fixtures (MIT-licensed tokenizers,
    unpacked once into tests/fixtures/unpacked), so that a fresh clone alone runs every test."""
    if "INFERX_FIXTURES" in os.environ:
        return Path(os.environ["INFERX_FIXTURES"])
    shared = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
    if shared.is_dir():
        return shared
    here = Path(__file__).parent / "fixtures"
    unpacked = here / "unpacked"
    if not (unpacked / "tokenizers").is_dir():
        import tarfile

        with tarfile.open(here / "tokenizers.tar.xz") as tar:
            tar.extractall(unpacked, filter="data")
    return unpacked


FIXTURES = _fixtures()


def fused_views(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as strided views of one [T, (Hq + 2 Hkv) * D] tensor, as a fused QKV projection
    hands them to an attention backend."""
    t = q.shape[0]
    qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    parts = qkv.split([q[0].numel(), k[0].numel(), v[0].numel()], dim=1)
    return parts[0].view(q.shape), parts[1].view(k.shape), parts[2].view(v.shape)


def same_random_caches(backends: list, num_blocks: int, dtype: torch.dtype) -> None:
    """Allocate each backend's cache and fill every one with the same random values (seed 1,
    drawn on the cache's device), so backends run side by side start from equal caches."""
    for backend in backends:
        backend.allocate(num_blocks)
        for cache in backend.caches:
            torch.manual_seed(1)
            cache.copy_(torch.randn(cache.shape, device=cache.device).to(dtype))


def scattered_tables(totals: list[int], block_size: int, num_blocks: int) -> list[list[int]]:
    """Non-contiguous block ids, never block 0 (reserved), as a real block manager hands out."""
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()
    tables = []
    for t in totals:
        need = -(-t // block_size)
        tables.append(ids[:need])
        ids = ids[need:]
    return tables


def plan_steps(plan: list[tuple[int, int]]) -> tuple[list[int], list[list[tuple[int, int]]]]:
    """For (cached prefix, new tokens) per sequence: each sequence's total length and four
    steps of [a, b) spans (empty: sits the step out): the cached prefixes as one ragged
    prefill, the new chunks (with any decodes), two decodes."""
    totals = [p + n + 2 for p, n in plan]
    steps = [
        [(0, p) for p, _ in plan],
        [(p, p + n) for p, n in plan],
        [(t - 2, t - 1) for t in totals],
        [(t - 1, t) for t in totals],
    ]
    return totals, steps


def beside_reference(backend, against: type, plan: list[tuple[int, int]]) -> tuple:
    """For running `plan` (plan_steps) on `backend` and on `against`, built with the backend's
    layers, block size, dtype and device: both allocated for the plan's sequences (with 4 blocks
    to spare) and the sequences' scattered tables. Returns (reference, totals, steps, tables)."""
    bs = backend.block_size
    totals, steps = plan_steps(plan)
    num_blocks = sum(-(-t // bs) for t in totals) + 4
    reference = against(backend.layers, bs, backend.dtype, backend.device)
    for b in (backend, reference):
        b.allocate(num_blocks)
    return reference, totals, steps, scattered_tables(totals, bs, num_blocks)


def begin_spans(
    backends: list, spans: list[tuple[int, int]], tables: list[list[int]]
) -> tuple[list[int], list[int]]:
    """Begin one of plan_steps' steps on every backend: a batch of the sequences whose span
    [a, b) is not empty, of b - a new tokens each. Returns those sequences and their lengths."""
    from inferx_core.batch import make_attention_batch

    live = [i for i, (a, b) in enumerate(spans) if b > a]
    query_lens = [spans[i][1] - spans[i][0] for i in live]
    block_size, device = backends[0].block_size, backends[0].device
    batch = make_attention_batch(
        query_lens, [spans[i][1] for i in live], [tables[i] for i in live], block_size, device
    )
    for b in backends:
        b.begin_step(batch)
    return live, query_lens


def replay_decodes(static, eager: list, contexts: list[int], size: int, num_blocks: int):
    """A decode step over `contexts` (scattered tables): prepared for a graph's replay at `size`
    rows on `static` and begun on each of the `eager` backends. Returns its batch."""
    from inferx_core.batch import make_attention_batch

    tables = scattered_tables(contexts, static.block_size, num_blocks)
    batch = make_attention_batch([1] * len(contexts), contexts, tables, static.block_size)
    static.prepare_for_replay(batch, size)
    for b in eager:
        b.begin_step(batch)
    return batch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
