"""FlashInferAttention: listed without importing FlashInfer, its layout and errors, its plumbing
against a torch stand-in for FlashInfer on the CPU; on the GPU (pytest -m gpu) the conformance
suite against TorchAttention, captured decode graphs, and generation equal to the triton backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import (
    begin_spans,
    beside_reference,
    fused_views,
    interpreted,
    on_gpu,
    plan_steps,
    replay_decodes,
    same_random_caches,
    scattered_tables,
)
from gpu_attention import capture, recorded_runs, replay, zero_decode_inputs
from test_attention_torch import dense_reference, rel_err

from inferx_core.attention_torch import FP8, TorchAttention
from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.kv import KVLayerSpec

CPU = torch.device("cpu")
# Largest |a - b| over the largest |b|, as in test_triton_attention: fp16 rounds the softmax
# weights before P @ V (every flash kernel does); bf16 rounds those and the output to 8 bits.
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def flashinfer_module():
    """The backend's module; it imports Triton (its KV write kernel), never FlashInfer."""
    pytest.importorskip("triton", reason="the triton package is not installed")
    from inferx_kernels_cuda import flashinfer_attention

    return flashinfer_attention


# -- listing the plugin never imports FlashInfer ------------------------------------------------


def test_inferx_plugins_lists_flashinfer_without_importing_it() -> None:
    """`inferx plugins` in a fresh interpreter: flashinfer is listed from inferx-kernels-cuda,
    and neither FlashInfer nor the backend's module (nor Triton) was imported to list it."""
    code = (
        "import json, sys\n"
        "from inferx_core.cli import main\n"
        "main(['plugins', '--json'])\n"
        "names = ('flashinfer', 'triton', 'inferx_kernels_cuda.flashinfer_attention')\n"
        "seen = [m for m in sys.modules if m.split('.')[0] in names or m in names]\n"
        "print(json.dumps(sorted(seen)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "INFERX_PLUGINS"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    listing, imported = done.stdout.strip().splitlines()[-2:]
    rows = {(r["kind"], r["name"]): r for r in json.loads(listing)}
    row = rows.get(("attention_backend", "flashinfer"))
    assert row is not None, f"flashinfer is not listed: {sorted(rows)}"
    assert row["package"] == "inferx-kernels-cuda"
    assert row["target"] == "inferx_kernels_cuda.flashinfer_attention:FlashInferAttention"
    assert json.loads(imported) == [], f"listing plugins imported {imported}"


# -- the layout FlashInfer reads, and what the backend refuses ----------------------------------


def test_paged_layout() -> None:
    fa = flashinfer_module()
    # contexts of 1, 16, 17 and 33 tokens in blocks of 16; the last two have a chunk of 5 and 4
    # new tokens; tables may hold more blocks than the context needs (never read).
    layout = fa.paged_layout(
        [1, 1, 5, 4], [1, 16, 17, 33], [[7], [3, 9], [4, 5], [6, 8, 2]], 16, padding_rows=2
    )
    assert layout.qo_indptr.tolist() == [0, 1, 2, 7, 11, 12, 13]
    assert layout.kv_indptr.tolist() == [0, 1, 2, 4, 7, 8, 9]
    assert layout.kv_indices.tolist() == [7, 3, 4, 5, 6, 8, 2, 0, 0]
    assert layout.kv_last_page_len.tolist() == [1, 16, 1, 1, 1, 1]
    for t in (layout.qo_indptr, layout.kv_indptr, layout.kv_indices, layout.kv_last_page_len):
        assert t.dtype == torch.int32 and t.device == CPU
    only_padding = fa.paged_layout([], [], [], 32, padding_rows=3)
    assert only_padding.kv_indptr.tolist() == [0, 1, 2, 3]
    assert only_padding.kv_indices.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="block table of 1 blocks"):
        fa.paged_layout([1], [17], [[3]], 16)


@pytest.mark.parametrize(
    ("spec", "dtype", "device", "error", "match"),
    [
        (KVLayerSpec(4, 2, 64), torch.float32, "cuda", NotImplementedError, "float32"),
        (KVLayerSpec(4, 2, 64), torch.float64, "cuda", NotImplementedError, "float64"),
        (
            KVLayerSpec(4, 2, 64, kind="sliding", window=8),
            torch.bfloat16,
            "cuda",
            NotImplementedError,
            "sliding",
        ),
        (  # MLA layers of widths FlashInfer's MLA kernels lack (tests/test_flashinfer_mla.py)
            KVLayerSpec(1, 1, 576, kind="mla", v_head_dim=0),
            torch.bfloat16,
            "cuda",
            NotImplementedError,
            "kv_lora_rank 512",
        ),
        (KVLayerSpec(4, 2, 64, v_head_dim=128), torch.bfloat16, "cuda", NotImplementedError, "v_"),
        (KVLayerSpec(4, 2, 96), torch.bfloat16, "cuda", ValueError, "head_dim in"),
        (KVLayerSpec(6, 4, 64), torch.bfloat16, "cuda", ValueError, "multiple of num_kv_heads"),
        (KVLayerSpec(4, 2, 64), torch.bfloat16, "cpu", ValueError, "CUDA device"),
    ],
)
def test_unsupported_layouts_are_named(spec, dtype, device, error, match) -> None:
    """Refused before FlashInfer is imported or anything touches the device."""
    fa = flashinfer_module()
    with pytest.raises(error, match=match):
        fa.FlashInferAttention([spec], 16, dtype, torch.device(device))


# -- the plumbing on the CPU, with a torch stand-in for FlashInfer ------------------------------


class FakeWrapper:
    """FlashInfer 0.6's paged wrappers as their docs describe them, computed in torch: plan()
    keeps the layout (in CUDA-graph mode it copies it into the caller's buffers, and the batch
    size is fixed); run() attends from whatever those buffers hold when it runs, so a replay
    sees only what prepare_for_replay planned."""

    prefill = False

    def __init__(
        self,
        workspace: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.tensor_cores = use_tensor_cores
        self.backend = backend
        if use_cuda_graph:
            assert paged_kv_indptr_buffer is not None and paged_kv_indices_buffer is not None
            assert paged_kv_last_page_len_buffer is not None
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.kv_indptr = paged_kv_indptr_buffer
        self.kv_indices = paged_kv_indices_buffer
        self.kv_last = paged_kv_last_page_len_buffer
        self.scales: list[tuple[float | None, float | None]] = []  # run()'s k_scale, v_scale
        FakeFlashInfer.created.append(self)

    def _keep(self, qo_indptr, kv_indptr, kv_indices, kv_last, q_heads, kv_heads, dim, page_size):
        # plan() reads the offsets and lengths on the host; the indices it only copies.
        for t in (qo_indptr, kv_indptr, kv_last):
            if t is not None:
                assert t.dtype == torch.int32 and t.device == CPU, "int32 host tensors"
        assert kv_indices.dtype == torch.int32
        assert int(kv_indptr[-1]) == len(kv_indices)
        assert bool(((kv_last >= 1) & (kv_last <= page_size)).all())
        assert q_heads % kv_heads == 0
        if self.graph:
            assert len(kv_last) == len(self.kv_last), "CUDA-graph mode fixes the batch size"
            assert len(kv_indices) <= len(self.kv_indices)
            self.kv_indptr.copy_(kv_indptr)
            self.kv_indices[: len(kv_indices)].copy_(kv_indices)
            self.kv_last.copy_(kv_last)
        else:
            self.kv_indptr, self.kv_indices, self.kv_last = kv_indptr, kv_indices, kv_last
        self.qo_indptr = qo_indptr
        self.shape = (q_heads, kv_heads, dim)
        self.page_size = page_size

    def run(self, q, paged_kv_cache, *, q_scale=None, k_scale=None, v_scale=None, out=None):
        k_cache, v_cache = paged_kv_cache
        assert q.dtype == self.q_dtype and k_cache.dtype == v_cache.dtype == self.kv_dtype
        # Floats: FlashInfer's FA2 and CUDA-core kernels take the softmax scale as a double,
        # and run() multiplies k_scale into it on the host.
        for x in (q_scale, k_scale, v_scale):
            assert x is None or type(x) is float, f"a scale of {type(x).__name__}"
        self.scales.append((k_scale, v_scale))
        if k_cache.dtype == FP8:  # indexed as bytes: torch's CPU index ops take no float8
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        q_heads, kv_heads, dim = self.shape
        assert q.shape[1:] == (q_heads, dim) and k_cache.shape[1:] == (
            self.page_size,
            kv_heads,
            dim,
        )
        rows = len(self.kv_last)
        qo = self.qo_indptr.tolist() if self.prefill else list(range(rows + 1))
        assert q.shape[0] == qo[-1]
        assert out is not None and out.shape == q.shape and out.dtype == q.dtype
        sm_scale = dim**-0.5 * (1.0 if q_scale is None else q_scale)
        sm_scale *= 1.0 if k_scale is None else k_scale
        fp8 = self.kv_dtype == FP8
        as_float = (lambda x: x.view(FP8).float()) if fp8 else (lambda x: x.float())
        kv_indptr, kv_last = self.kv_indptr.tolist(), self.kv_last.tolist()
        for i in range(rows):
            pages = self.kv_indices[kv_indptr[i] : kv_indptr[i + 1]].long().to(q.device)
            kv_len = (len(pages) - 1) * self.page_size + kv_last[i]
            keys = as_float(k_cache[pages].reshape(-1, kv_heads, dim)[:kv_len])
            values = as_float(v_cache[pages].reshape(-1, kv_heads, dim)[:kv_len])
            keys = keys.repeat_interleave(q_heads // kv_heads, dim=1)
            values = values.repeat_interleave(q_heads // kv_heads, dim=1)
            queries = q[qo[i] : qo[i + 1]].float()
            scores = torch.einsum("qhd,khd->hqk", queries, keys) * sm_scale
            if self.prefill and self.causal:  # aligned to the end of the context
                n = len(queries)
                pos = torch.arange(kv_len - n, kv_len, device=q.device)
                visible = torch.arange(kv_len, device=q.device)[None, :] <= pos[:, None]
                scores = scores.masked_fill(~visible, float("-inf"))
            out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        if v_scale is not None and v_scale != 1.0:  # as FlashInfer: on the output, after
            out *= v_scale
        return out


class FakeDecode(FakeWrapper):
    def plan(self, indptr, indices, last_page_len, q_heads, kv_heads, dim, page_size, **kw):
        self.q_dtype, self.kv_dtype = kw["q_data_type"], kw["kv_data_type"]
        self._keep(None, indptr, indices, last_page_len, q_heads, kv_heads, dim, page_size)


class FakePrefill(FakeWrapper):
    prefill = True

    def plan(self, qo_indptr, indptr, indices, last, q_heads, kv_heads, dim, page_size, **kw):
        assert not self.graph
        self.q_dtype, self.kv_dtype = kw["q_data_type"], kw["kv_data_type"]
        self.causal = kw.get("causal", False)
        assert int(qo_indptr[-1]) >= len(last)
        self._keep(qo_indptr, indptr, indices, last, q_heads, kv_heads, dim, page_size)


class FakeFlashInfer:
    created: list[FakeWrapper] = []
    module = types.SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
        BatchPrefillWithPagedKVCacheWrapper=FakePrefill,
    )


def cpu_flashinfer(layers, block_size, dtype, **kwargs):
    """FlashInferAttention on the CPU with the stand-in; its KV writes run Triton's kernel
    under the interpreter."""
    fa = flashinfer_module()

    class CpuFlashInfer(fa.FlashInferAttention):
        workspace_bytes = 1024

        def _load_flashinfer(self):
            return FakeFlashInfer.module

    FakeFlashInfer.created.clear()
    return CpuFlashInfer(layers, block_size, dtype, CPU, **kwargs)


def check_steps(backend, plan: list[tuple[int, int]], scale_factor: float = 1.0) -> list[str]:
    """Run a plan's steps on `backend` and on TorchAttention (same device, same scattered
    tables) and check every layer against both and against dense float64 attention. Returns
    the kind of plan each step made ("prefill", "decode")."""
    layers, dtype, device = backend.layers, backend.dtype, backend.device
    tol = TOL[dtype]
    reference, totals, steps, tables = beside_reference(backend, TorchAttention, plan)
    hist = [
        [
            [
                torch.randn(t, h, s.head_dim).to(dtype)
                for h in (s.num_q_heads,) + (s.num_kv_heads,) * 2
            ]
            for t in totals
        ]
        for s in layers
    ]
    kinds = []
    for step, spans in enumerate(steps):
        live, query_lens = begin_spans([backend, reference], spans, tables)
        kinds.append(backend._plan.kind)
        for layer, spec in enumerate(layers):
            q, k, v = (
                torch.cat([hist[layer][i][j][slice(*spans[i])] for i in live]).to(device)
                for j in range(3)
            )
            scale = spec.head_dim**-0.5 * scale_factor
            got = backend.forward(backend.layer(layer, scale), *fused_views(q, k, v))
            want = reference.forward(reference.layer(layer, scale), q, k, v)
            assert got.shape == (sum(query_lens), spec.num_q_heads, spec.head_dim)
            assert got.dtype == dtype
            dense = torch.cat(
                [
                    dense_reference(
                        hist[layer][i][0][slice(*spans[i])],
                        hist[layer][i][1][: spans[i][1]],
                        hist[layer][i][2][: spans[i][1]],
                        scale,
                    )
                    for i in live
                ]
            )
            where = f"step {step} ({kinds[-1]}), layer {layer} {spec}, spans {spans}"
            for other, label in ((dense, "float64"), (want, "torch")):
                err = rel_err(got.cpu(), other.cpu())
                if err > tol:
                    worst = worst_sequence(got.cpu(), other.cpu(), query_lens, live)
                    raise AssertionError(
                        f"{where}: {err:.2e} against {label} (limit {tol:.0e}); worst: {worst}"
                    )
    for layer in range(len(layers)):
        assert torch.equal(backend.caches[layer].cpu(), reference.caches[layer].cpu()), layer
    return kinds


def worst_sequence(got, want, query_lens: list[int], live: list[int]) -> str:
    """Which sequence of a step differs most, for a failure message."""
    start, rows = 0, []
    for i, n in zip(live, query_lens, strict=True):
        diff = (got[start : start + n].double() - want[start : start + n].double()).abs().max()
        rows.append((float(diff), i, n))
        start += n
    diff, i, n = max(rows)
    return f"sequence {i} ({n} queries), max |diff| {diff:.3e}"


# (cached prefix, new tokens): a fresh prompt, a chunk over a cached prefix, decodes, a
# one-token prompt; then chunks over cached prefixes alone (a prefill-only step over a prefix).
SMALL_PLANS = [
    [(0, 13), (9, 7), (21, 1), (5, 1), (0, 1)],
    [(9, 7), (16, 16), (3, 2)],
]


@interpreted
@pytest.mark.parametrize(
    ("block_size", "group", "dtype"),
    [(4, 1, torch.float16), (16, 2, torch.bfloat16), (4, 6, torch.float16), (8, 8, torch.bfloat16)],
)
def test_steps_plan_what_flashinfer_reads(block_size: int, group: int, dtype: torch.dtype) -> None:
    """Prefill-only ragged, mixed, over cached prefixes, decode-only: outputs equal
    TorchAttention's when FlashInfer computes exactly what its docs say from the layout the
    backend plans; a decode-only step plans the decode wrapper, any other the causal prefill
    wrapper; two attention shapes get a wrapper each; groups above 4 decode on tensor cores."""
    torch.manual_seed(block_size * 10 + group)
    layers = [
        KVLayerSpec(2 * group, 2, 64),
        KVLayerSpec(group, 1, 128),
        KVLayerSpec(2 * group, 2, 64),
    ]
    backend = cpu_flashinfer(layers, block_size, dtype)
    assert [w.tensor_cores for w in FakeFlashInfer.created if isinstance(w, FakeDecode)] == [
        group >= 5
    ] * 2
    assert all(w.backend == "fa2" for w in FakeFlashInfer.created if isinstance(w, FakePrefill))
    for plan in SMALL_PLANS:
        assert check_steps(backend, plan) == ["prefill", "prefill", "decode", "decode"]
    # A scale other than 1/sqrt(head_dim) reaches FlashInfer through q_scale.
    check_steps(backend, SMALL_PLANS[1], scale_factor=0.5)


@interpreted
def test_prefill_module_argument() -> None:
    """prefill_backend picks the prefill wrappers' module (fa2 by default); anything but fa2,
    fa3 or auto is refused by name."""
    layers = [KVLayerSpec(4, 2, 64)]

    def prefill_modules(**kwargs: str) -> set[str]:
        FakeFlashInfer.created.clear()
        cpu_flashinfer(layers, 4, torch.float16, **kwargs)
        return {w.backend for w in FakeFlashInfer.created if isinstance(w, FakePrefill)}

    assert prefill_modules() == {"fa2"}
    for module in ("fa3", "auto"):
        assert prefill_modules(prefill_backend=module) == {module}
    with pytest.raises(ValueError, match="prefill_backend must be one of fa2, fa3"):
        cpu_flashinfer(layers, 4, torch.float16, prefill_backend="fa4")


@interpreted
def test_graph_life_cycle_replans_static_buffers() -> None:
    """prepare_for_capture builds one CUDA-graph decode wrapper per size and shape over the
    static buffers; each replay re-plans that size's wrappers, so the same forward() serves new
    contexts; padding rows (garbage inputs) write nothing, so caches end equal to eager ones."""
    torch.manual_seed(3)
    dtype, bs = torch.float16, 4
    layers = [KVLayerSpec(4, 2, 64), KVLayerSpec(6, 1, 128)]
    max_blocks = 64 // bs
    num_blocks = 4 * max_blocks + 1
    static = cpu_flashinfer(layers, bs, dtype)
    eager = cpu_flashinfer(layers, bs, dtype)
    reference = TorchAttention(layers, bs, dtype, CPU)
    same_random_caches([static, eager, reference], num_blocks, dtype)
    static.init_graph_buffers(8, max_blocks)
    for size in (4, 2):
        static.prepare_for_capture(size)
    graphs = [w for s in static._shapes for w in s.graphs.values()]
    assert len(graphs) == 4 and all(w.graph for w in graphs)
    assert [s.graphs[4].tensor_cores for s in static._shapes] == [False, True]

    for contexts, size in (([37, 5, 64, 20], 4), ([1, 50], 4), ([63], 2), ([9, 2], 2)):
        n = len(contexts)
        batch = replay_decodes(static, [eager, reference], contexts, size, num_blocks)
        assert static._plan.kind == "graph" and eager._plan.kind == "decode"
        assert static._plan.wrappers == [s.graphs[size] for s in static._shapes]
        g = static._graph
        assert g.slot_mapping[:size].tolist() == batch.slot_mapping.tolist() + [-1] * (size - n)
        for layer, spec in enumerate(layers):
            heads = (spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads)
            qkv = [torch.randn(size, h, spec.head_dim).to(dtype) for h in heads]
            scale = spec.head_dim**-0.5
            got = static.forward(static.layer(layer, scale), *fused_views(*qkv))[:n]
            want = eager.forward(eager.layer(layer, scale), *(x[:n] for x in qkv))
            ref = reference.forward(reference.layer(layer, scale), *(x[:n] for x in qkv))
            for other, label in ((want, "eager"), (ref, "torch")):
                err = rel_err(got, other)
                assert err <= TOL[dtype], (
                    f"contexts {contexts}, layer {layer}: {err:.2e} vs {label}"
                )
        for layer in range(len(layers)):
            assert torch.equal(static.caches[layer], eager.caches[layer]), (contexts, layer)


@interpreted
def test_graph_life_cycle_checks_its_inputs() -> None:
    backend = cpu_flashinfer([KVLayerSpec(4, 2, 64)], 4, torch.float16)
    backend.allocate(8)
    with pytest.raises(RuntimeError, match="init_graph_buffers"):
        backend.prepare_for_capture(1)
    backend.init_graph_buffers(4, 2)
    with pytest.raises(ValueError, match="outside the graph buffers"):
        backend.prepare_for_capture(5)
    decode = make_attention_batch([1], [3], [[1]], 4)
    with pytest.raises(RuntimeError, match=r"prepare_for_capture\(2\)"):
        backend.prepare_for_replay(decode, 2)
    backend.prepare_for_capture(2)
    with pytest.raises(ValueError, match="decode-only batch"):
        backend.prepare_for_replay(make_attention_batch([3], [3], [[1]], 4), 2)
    with pytest.raises(ValueError, match="2 blocks each"):
        backend.prepare_for_replay(make_attention_batch([1], [12], [[1, 2, 3]], 4), 2)
    fresh = cpu_flashinfer([KVLayerSpec(4, 2, 64)], 4, torch.float16)
    fresh.allocate(8)
    x = torch.zeros(1, 4, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="begin_step"):
        fresh.forward(fresh.layer(0, 0.125), x, x[:, :2], x[:, :2])
    fresh.begin_step(decode)
    with pytest.raises(ValueError, match="planned for 1"):
        fresh.forward(
            fresh.layer(0, 1), x.repeat(2, 1, 1), x[:, :2].repeat(2, 1, 1), x[:, :2].repeat(2, 1, 1)
        )


# -- on the GPU ---------------------------------------------------------------------------------


@pytest.fixture
def flashinfer():
    """FlashInfer itself; GPU tests skip (not fail) where it is not installed."""
    return pytest.importorskip("flashinfer", reason="FlashInfer is not installed")


def gpu_backend(layers, block_size, dtype, **kwargs):
    from inferx_kernels_cuda.flashinfer_attention import FlashInferAttention

    return FlashInferAttention(layers, block_size, dtype, torch.device("cuda"), **kwargs)


# The conformance sizes, as in test_triton_attention: contexts up to 2049 tokens, a
# ragged prefill of the prefixes, a mixed step (fresh prompts, chunks over cached prefixes,
# decodes, one-token prompts), two decode-only steps; then chunks over cached prefixes alone.
GPU_PLANS = [
    [(0, 300), (100, 37), (1000, 1), (2047, 1), (5, 1), (0, 1), (64, 64), (513, 200)],
    [(100, 37), (64, 64), (513, 200), (31, 2), (1500, 17)],
]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_conformance_bf16(flashinfer, block_size: int, group: int, head_dim: int) -> None:
    torch.manual_seed(block_size * 1000 + group * 10 + head_dim)
    layers = [KVLayerSpec(2 * group, 2, head_dim), KVLayerSpec(4 * group, 4, head_dim)]
    backend = gpu_backend(layers, block_size, torch.bfloat16)
    for plan in GPU_PLANS:
        assert check_steps(backend, plan) == ["prefill", "prefill", "decode", "decode"]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("module", ["fa2", "fa3"])
@pytest.mark.parametrize("group", [4, 8])
def test_gpu_conformance_prefill_modules(flashinfer, group: int, module: str) -> None:
    """The prefill wrappers on each of FlashInfer's modules (prefill_backend, fa2 by default),
    the shapes of Llama-3.1-8B (group 4) and Qwen2.5-3B (group 8), bf16."""
    torch.manual_seed(group)
    backend = gpu_backend(
        [KVLayerSpec(2 * group, 2, 128)], 16, torch.bfloat16, prefill_backend=module
    )
    for plan in GPU_PLANS:
        assert check_steps(backend, plan) == ["prefill", "prefill", "decode", "decode"]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("group", [4, 8])
def test_gpu_float16_and_other_scale(flashinfer, group: int) -> None:
    torch.manual_seed(group)
    backend = gpu_backend([KVLayerSpec(2 * group, 2, 128)], 16, torch.float16)
    check_steps(backend, GPU_PLANS[0])
    check_steps(backend, GPU_PLANS[1], scale_factor=0.7)


@pytest.mark.gpu
@on_gpu
def test_gpu_captured_decode_serves_new_contexts(flashinfer) -> None:
    """A decode step captured per batch size through the backend's graph hooks (three
    attention shapes: CUDA-core and tensor-core decode, two head dims), replayed for new
    contexts from 1 to 2048 tokens and fewer real rows than captured: outputs equal eager
    FlashInfer and TorchAttention, padding rows write nothing, and FlashInfer's plan (whose
    work split the graph baked in) is the same at every replay as at capture."""
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    bs, max_ctx = 16, 2048
    max_blocks = max_ctx // bs
    sizes = [1, 4, 16]
    num_blocks = sizes[-1] * max_blocks + 1
    layers = [KVLayerSpec(16, 2, 128), KVLayerSpec(4, 2, 64), KVLayerSpec(12, 2, 128)]
    graphed = gpu_backend(layers, bs, dtype)
    eager = gpu_backend(layers, bs, dtype)
    reference = TorchAttention(layers, bs, dtype, dev)
    assert [s.tensor_cores for s in graphed._shapes] == [True, False, True]
    same_random_caches([graphed, eager, reference], num_blocks, dtype)
    scales = [s.head_dim**-0.5 for s in layers]
    graphed.init_graph_buffers(sizes[-1], max_blocks)
    captured = {}
    for size in reversed(sizes):
        inputs = zero_decode_inputs(layers, size, dtype, dev)

        def step(inputs=inputs) -> list[torch.Tensor]:
            return [
                graphed.forward(graphed.layer(i, scales[i]), *fused_views(*inputs[i]))
                for i in range(3)
            ]

        graph, outs = capture(graphed, size, step)
        plans = [plan_info(s.graphs[size]) for s in graphed._shapes]
        captured[size] = (graph, inputs, outs, plans)
    print("captured sizes", sorted(captured), "plan info", {k: v[3] for k, v in captured.items()})

    cases = [([1, 1000, 2048], 4), ([64, 65, 2047, 7], 4), ([2048], 1), ([5], 4), ([1], 1)]
    cases.append(([int(x) for x in torch.randint(1, max_ctx + 1, (13,))], 16))
    for contexts, size in cases:
        graph, inputs, outs, plans = captured[size]
        n = len(contexts)
        tables = scattered_tables(contexts, bs, num_blocks)
        graphed.prepare_for_replay(make_attention_batch([1] * n, contexts, tables, bs), size)
        now = [plan_info(s.graphs[size]) for s in graphed._shapes]
        assert now == plans, f"size {size}, contexts {contexts}: plan {now}, captured {plans}"
        replay(graph, inputs, [eager, reference], contexts, tables, bs)
        for i in range(len(layers)):
            real = [x[:n] for x in inputs[i]]
            got = outs[i][:n]
            for other, label in (
                (eager.forward(eager.layer(i, scales[i]), *real), "eager flashinfer"),
                (reference.forward(reference.layer(i, scales[i]), *real), "torch"),
            ):
                err = rel_err(got, other)
                if err > TOL[dtype]:
                    worst = worst_sequence(got.cpu(), other.cpu(), [1] * n, list(range(n)))
                    raise AssertionError(
                        f"size {size}, contexts {contexts}, layer {i} {layers[i]}: {err:.2e} vs "
                        f"{label}; worst: {worst}"
                    )
        torch.cuda.synchronize()
        for i in range(len(layers)):
            assert torch.equal(graphed.caches[i], eager.caches[i]), (size, contexts, i)


def plan_info(wrapper) -> list[int]:
    """FlashInfer's plan of a wrapper (a private attribute: for diagnostics only)."""
    return [int(x) for x in (getattr(wrapper, "_plan_info", None) or [])]


def checkpoint_64(arch: str, tmp_path_factory) -> Path:
    """test_cuda_graphs' tiny random Llama or Qwen2, widened to head_dim 64 (FlashInfer's
    smallest): hidden 256, 4 query heads, 2 KV heads, 3 layers."""
    import transformers
    from test_engine import tiny_config

    torch.manual_seed(0)
    config = tiny_config(arch)
    config.hidden_size, config.intermediate_size = 256, 512
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = 64
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.04)
    path = tmp_path_factory.mktemp(f"{arch}-hd64")
    model.save_pretrained(path)
    return path


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_generates_like_triton(flashinfer, arch: str, tmp_path_factory) -> None:
    """Greedy generation, bf16, 32 tokens: attention_backend "flashinfer" equals "triton"
    token for token (a divergence only at a near tie, reported), with CUDA graphs and without:
    batches that hit and miss captured sizes, a batch that shrinks, prompts chunked over 64
    tokens beside decodes, and prompts that hit the prefix cache (prefill over a cached
    prefix). In compare_runs' messages "graphs" is flashinfer and "eager" triton."""
    from test_cuda_graphs import NEW, TOP, compare_runs, ragged_prompts

    from inferx_core.engine import LLM
    from inferx_core.sequence import SamplingParams

    path = checkpoint_64(arch, tmp_path_factory)
    common = ragged_prompts(1, 150, 150, seed=7)[0]
    scenarios = [(f"batch {n}", ragged_prompts(n, 3, 30, seed=n), [NEW] * n) for n in (1, 3, 8, 13)]
    scenarios += [
        ("shrinking", ragged_prompts(13, 3, 30, 13), [NEW - 2 * i for i in range(13)]),
        ("long, chunked", ragged_prompts(3, 100, 200, 99), [NEW] * 3),
        ("prefix, first", [common + [5, 6, 7]], [NEW]),
        ("prefix, cached", [common + [9] * k for k in (1, 20, 40)], [NEW] * 3),
    ]
    batches = [
        (
            prompts,
            [
                SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=TOP)
                for m in max_tokens
            ],
        )
        for _, prompts, max_tokens in scenarios
    ]
    overrides = {
        "kv_cache.memory": "512MiB",
        "scheduler.max_running": 16,
        "scheduler.prefill_chunk": 64,
        "scheduler.prefix_cache": True,
    }
    problems = []
    for graphs in (True, False):
        runs = {}
        for backend, attention in (
            ("flashinfer", "FlashInferAttention"),
            ("triton", "TritonAttention"),
        ):

            def check(llm: LLM, attention: str = attention) -> None:
                assert type(llm.engine.executor.attention).__name__ == attention

            runs[backend] = recorded_runs(path, backend, graphs, overrides, batches, check)
        for (label, _, _), (fi, fi_steps), (tr, tr_steps) in zip(
            scenarios, runs["flashinfer"], runs["triton"], strict=True
        ):
            name = f"{arch}/graphs {'on' if graphs else 'off'}/{label}"
            problems += compare_runs(name, fi, tr, fi_steps, tr_steps, "bfloat16")
    assert not problems, "\n".join(problems)


# -- an FP8 (e4m3) KV cache ----------------------------------------------------------------------
# test_fp8_kv_triton's helpers (imported in the tests: that module needs Triton to import):
# run_steps checks a backend against TorchAttention over e4m3 caches, the same bytes after every
# write and outputs within its TOL (fp16 2e-3, bf16 2e-2 of the largest |output|).

FP8_SCALES = [(1.0, 1.0), (0.013, 2.5)]  # test_fp8_kv_triton.SCALES: plain; clamped and subnormal


def as_floats(scales: tuple[float, float]) -> tuple[float, ...]:
    """The scales as float32 tensors hold them, as Python floats (what run() must get)."""
    return tuple(torch.tensor(scales, dtype=torch.float32).tolist())


@pytest.mark.parametrize("module", ["fa3"])
def test_fp8_cache_refuses_the_fa3_prefill_module(module: str) -> None:
    """Refused before FlashInfer is imported or anything touches the device, naming the
    module, the cache dtype and the layer."""
    fa = flashinfer_module()
    layers = [KVLayerSpec(4, 2, 64), KVLayerSpec(4, 2, 64, dtype="fp8_e4m3")]
    with pytest.raises(
        NotImplementedError,
        match=r"prefill_backend 'fa3' cannot read an fp8_e4m3 KV cache \(layer 1\)",
    ):
        fa.FlashInferAttention(
            layers, 16, torch.bfloat16, torch.device("cuda"), prefill_backend=module
        )
    # check_layers (engine.attention_backend auto) takes e4m3 layers, and refuses e4m3 MLA ones
    fa.FlashInferAttention.check_layers(layers)
    mla = KVLayerSpec(1, 1, 576, kind="mla", v_head_dim=512, rope_dim=64, dtype="fp8_e4m3")
    with pytest.raises(NotImplementedError, match="no fp8_e4m3 cache for MLA layers"):
        fa.FlashInferAttention.check_layers([mla])


@interpreted
def test_fp8_layers_plan_e4m3_wrappers_and_take_half_the_bytes() -> None:
    """An e4m3 layer and a bf16 layer of one head shape get wrappers of their own, planned with
    their cache's dtype (and auto, FlashInfer's choice, is accepted: FA2 for an e4m3 cache);
    an e4m3 block takes half the bytes of a bf16 one."""
    plain = KVLayerSpec(4, 2, 64)
    fp8 = KVLayerSpec(4, 2, 64, dtype="fp8_e4m3")
    half = cpu_flashinfer([fp8, fp8], 4, torch.bfloat16).bytes_per_block()
    assert 2 * half == cpu_flashinfer([plain, plain], 4, torch.bfloat16).bytes_per_block()
    backend = cpu_flashinfer([plain, fp8], 4, torch.bfloat16, prefill_backend="auto")
    assert [s.kv_dtype for s in backend._shapes] == [torch.bfloat16, FP8]
    assert backend._shape_of == [0, 1]
    backend.allocate(8)
    assert [c.dtype for c in backend.caches] == [torch.bfloat16, FP8]
    for query_lens in ([5], [1]):  # a prompt, then a decode
        batch = make_attention_batch(query_lens, [5 + len(query_lens) - 1], [[1, 2]], 4)
        backend.begin_step(batch)
        for i, wrapper in enumerate(backend._plan.wrappers):
            assert (wrapper.q_dtype, wrapper.kv_dtype) == (
                torch.bfloat16,
                backend._shapes[i].kv_dtype,
            )


@interpreted
@pytest.mark.parametrize("scales", FP8_SCALES)
@pytest.mark.parametrize(
    ("block_size", "group", "dtype"), [(4, 1, torch.float16), (16, 6, torch.bfloat16)]
)
def test_fp8_steps_match_torch_fp8(
    block_size: int, group: int, dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    """A ragged prefill, a mixed step (fresh prompt, chunk over a cached prefix, decodes), two
    decode steps (group 6: on tensor cores) over e4m3 caches: the write kernel stores the
    bytes torch's to_fp8 does, the wrappers are planned with e4m3 KV and queries in the
    model's dtype, run() gets the layer's scales as floats, and the outputs (the stand-in
    computing what FlashInfer's docs say) are TorchAttention's within run_steps' TOL."""
    from test_fp8_kv_triton import PLAN, fp8_layers, run_steps

    torch.manual_seed(block_size * 10 + group)
    backend = cpu_flashinfer(fp8_layers(group, 64), block_size, dtype)
    totals, steps = plan_steps(PLAN)
    assert run_steps(backend, steps, totals, scales) == [None] * 4
    planned = [w for w in FakeFlashInfer.created if w.scales]
    assert {type(w) for w in planned} == {FakeDecode, FakePrefill}
    assert {w.tensor_cores for w in planned if isinstance(w, FakeDecode)} == {group >= 5}
    assert all((w.q_dtype, w.kv_dtype) == (dtype, FP8) for w in planned)
    assert all(set(w.scales) == {as_floats(scales)} for w in planned)


@interpreted
def test_fp8_graph_life_cycle_matches_torch() -> None:
    """The CUDA-graph decode wrappers over e4m3 caches with scales (CUDA-core and tensor-core
    decode): planned with e4m3 KV; replays for new contexts, padding rows with garbage and a
    slot of -1, write the bytes torch writes and attend like it within TOL."""
    from test_fp8_kv_triton import TOL as FP8_TOL

    torch.manual_seed(9)
    dtype, bs, max_blocks = torch.float16, 4, 16
    num_blocks = 4 * max_blocks + 1
    layers = [KVLayerSpec(4, 2, 64, dtype="fp8_e4m3"), KVLayerSpec(6, 1, 64, dtype="fp8_e4m3")]
    static = cpu_flashinfer(layers, bs, dtype)
    reference = TorchAttention(layers, bs, dtype, CPU)
    for b in (static, reference):
        b.allocate(num_blocks)
    for mine, theirs in zip(static.caches, reference.caches, strict=True):
        mine.copy_(torch.randn(mine.shape).to(FP8))
        theirs.copy_(mine)
    k_scale, v_scale = (torch.tensor([s]) for s in FP8_SCALES[1])
    attn = [
        [
            b.layer(i, s.head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
            for i, s in enumerate(layers)
        ]
        for b in (static, reference)
    ]
    static.init_graph_buffers(8, max_blocks)
    for size in (4, 2):
        static.prepare_for_capture(size)
    graphs = [w for s in static._shapes for w in s.graphs.values()]
    assert len(graphs) == 4 and all(w.graph and w.kv_dtype == FP8 for w in graphs)
    assert [s.graphs[4].tensor_cores for s in static._shapes] == [False, True]
    for contexts, size in (([37, 5, 64, 20], 4), ([1, 50], 4), ([63], 2)):
        n = len(contexts)
        batch = make_attention_batch(
            [1] * n, contexts, scattered_tables(contexts, bs, num_blocks), bs
        )
        static.prepare_for_replay(batch, size)
        reference.begin_step(batch)
        for i, spec in enumerate(layers):
            heads = (spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads)
            qkv = [(torch.randn(size, h, spec.head_dim) * 3).to(dtype) for h in heads]
            got = static.forward(attn[0][i], *fused_views(*qkv))[:n]
            want = reference.forward(attn[1][i], *(x[:n] for x in qkv))
            err = rel_err(got.float(), want.float())
            assert err <= FP8_TOL[dtype], f"contexts {contexts}, layer {i}: {err:.2e}"
            assert torch.equal(
                static.caches[i].view(torch.uint8), reference.caches[i].view(torch.uint8)
            ), (contexts, i)
    assert {s for w in graphs for s in w.scales} == {as_floats(FP8_SCALES[1])}


@interpreted
def test_fp8_scales_are_read_once_per_tensor_and_never_while_capturing() -> None:
    """A layer's scales reach run() as floats (1.0 where a layer has none), read from their
    tensors once; a layer with other scale tensors is read anew; a layer whose scales were
    not read before a CUDA-graph capture is refused inside it, by name (a capture cannot read
    a device tensor on the host), while one read before runs."""
    fp8 = KVLayerSpec(4, 2, 64, dtype="fp8_e4m3")
    backend = cpu_flashinfer([fp8, fp8], 4, torch.float16)
    backend.allocate(8)
    x = torch.randn(1, 8, 64).to(torch.float16)
    q, k, v = x[:, :4], x[:, 4:6], x[:, 6:]

    def step(layer) -> tuple[float | None, float | None]:
        backend.begin_step(make_attention_batch([1], [1], [[1]], 4))
        backend.forward(layer, q, k, v)
        return backend._plan.wrappers[0].scales[-1]

    first = backend.layer(0, 0.125, k_scale=torch.tensor([0.5]), v_scale=torch.tensor([2.0]))
    assert step(first) == (0.5, 2.0) and step(first) == (0.5, 2.0)
    assert step(backend.layer(0, 0.125)) == (1.0, 1.0)
    other = backend.layer(1, 0.125, k_scale=torch.tensor([0.25]), v_scale=torch.tensor([4.0]))
    backend._capturing = lambda: True
    assert step(backend.layer(0, 0.125)) == (1.0, 1.0)  # read before the capture
    with pytest.raises(RuntimeError, match="layer 1's k_scale / v_scale were first seen while"):
        step(other)
    backend._capturing = lambda: False
    assert step(other) == (0.25, 4.0)


def llama_with_kv_scales(root: Path) -> Path:
    """test_fp8's tiny random Llama at head_dim 128 (2 query heads, 1 KV head), with FP8 KV
    scales in its checkpoint: k 0.5 / v 0.25 in layer 0, k 2 / v 4 in layer 1."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_fp8 import tiny_llama

    plain = tiny_llama(root / "plain", 256, 2, 1, 512)
    path = root / "scaled"
    shutil.copytree(plain, path)
    tensors = load_file(path / "model.safetensors")
    for layer, (k, v) in enumerate(KV_SCALES):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, path / "model.safetensors")
    return path


KV_SCALES = [(0.5, 0.25), (2.0, 4.0)]


@interpreted
def test_fp8_kv_engine_with_the_stand_in_agrees_with_torch(tmp_path, monkeypatch) -> None:
    """The engine on the CPU with engine.attention_backend flashinfer (FlashInfer's stand-in),
    bf16, an e4m3 cache and checkpoint scales: the checkpoint's scales reach run() as floats,
    and greedy tokens agree with the torch backend's in the top-5 sense, prompts then
    prompts over their cached prefixes."""
    from test_fp8_kv import PROMPTS, agree_in_top5, make_llm, run

    fa = flashinfer_module()
    monkeypatch.setattr(fa.FlashInferAttention, "workspace_bytes", 1024)
    monkeypatch.setattr(
        fa.FlashInferAttention, "_load_flashinfer", lambda self: FakeFlashInfer.module
    )
    path = llama_with_kv_scales(tmp_path)
    base = {"model.dtype": "bfloat16", "kv_cache.dtype": "fp8_e4m3", "kv_cache.memory": "4MiB"}
    FakeFlashInfer.created.clear()
    on_fi = make_llm(path, **base, **{"engine.attention_backend": "flashinfer"})
    backend = on_fi.engine.executor.attention
    assert isinstance(backend, fa.FlashInferAttention) and backend.caches[0].dtype == FP8
    on_torch = make_llm(path, **base)
    assert type(on_torch.engine.executor.attention) is TorchAttention
    again = [p[:40] + [9, 8, 7] for p in PROMPTS if len(p) > 40]  # prefix-cache hits
    for prompts in (PROMPTS, again):
        agree_in_top5(run(on_fi, prompts), run(on_torch, prompts))
    assert [backend._scales[i][1] for i in range(2)] == KV_SCALES
    assert {s for w in FakeFlashInfer.created for s in w.scales} == set(KV_SCALES)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("scales", FP8_SCALES)
def test_gpu_fp8_steps_match_torch_fp8(flashinfer, scales: tuple[float, float]) -> None:
    """run_steps on the GPU, bf16, head_dim 128, over e4m3 caches: FlashInfer's FA2 prefill
    (a ragged prefill, fresh prompts and chunks over cached prefixes beside decodes), its
    tensor-core decode (group 8) and CUDA-core decode (group 2) against TorchAttention over
    the same bytes, within 2e-2 of the largest |output|: FlashInfer folds k_scale into the
    softmax scale and rounds the output once more for v_scale, torch rounds k * k_scale and
    v * v_scale to bf16, and bf16 rounds the softmax weights before P @ V."""
    from test_fp8_kv_triton import run_steps

    torch.manual_seed(21)
    layers = [KVLayerSpec(16, 2, 128, dtype="fp8_e4m3"), KVLayerSpec(4, 2, 128, dtype="fp8_e4m3")]
    backend = gpu_backend(layers, 16, torch.bfloat16)
    assert [s.tensor_cores for s in backend._shapes] == [True, False]
    totals, steps = plan_steps([(0, 130), (200, 70), (300, 1), (65, 1), (0, 1), (1500, 1)])
    run_steps(backend, steps, totals, scales)


@pytest.mark.gpu
@on_gpu
def test_gpu_fp8_captured_decode_matches_torch(flashinfer) -> None:
    """Decode captured per batch size over e4m3 caches with scales (k 0.013: keys clamped; v
    2.5) through the backend's graph hooks, replayed for new contexts and fewer real rows than
    captured: the graph writes the bytes torch writes (padding rows nothing) and its outputs
    are TorchAttention's within 2e-2 (bf16)."""
    from test_fp8_kv_triton import TOL as FP8_TOL

    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(22)
    bs, max_ctx, sizes = 16, 1024, [1, 4]
    max_blocks = max_ctx // bs
    num_blocks = sizes[-1] * max_blocks + 1
    layers = [KVLayerSpec(16, 2, 128, dtype="fp8_e4m3"), KVLayerSpec(4, 2, 128, dtype="fp8_e4m3")]
    graphed = gpu_backend(layers, bs, dtype)
    reference = TorchAttention(layers, bs, dtype, dev)
    for b in (graphed, reference):
        b.allocate(num_blocks)
    for mine, theirs in zip(graphed.caches, reference.caches, strict=True):
        mine.copy_(torch.randn(mine.shape, device=dev).to(FP8))
        theirs.copy_(mine)
    k_scale, v_scale = (torch.tensor([s], device=dev) for s in FP8_SCALES[1])
    attn = [
        [
            b.layer(i, s.head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
            for i, s in enumerate(layers)
        ]
        for b in (graphed, reference)
    ]
    graphed.init_graph_buffers(sizes[-1], max_blocks)
    captured = {}
    for size in reversed(sizes):
        inputs = zero_decode_inputs(layers, size, dtype, dev)

        def step(inputs=inputs) -> list[torch.Tensor]:
            return [graphed.forward(attn[0][i], *fused_views(*inputs[i])) for i in range(2)]

        graph, outs = capture(graphed, size, step)  # its eager run reads the scales
        captured[size] = (graph, inputs, outs)
    for contexts, size in (([1, 700, 1024], 4), ([64, 65, 1023, 7], 4), ([1000], 1), ([5], 4)):
        graph, inputs, outs = captured[size]
        n = len(contexts)
        tables = scattered_tables(contexts, bs, num_blocks)
        graphed.prepare_for_replay(make_attention_batch([1] * n, contexts, tables, bs), size)
        replay(graph, inputs, [reference], contexts, tables, bs, spread=3)
        for i in range(len(layers)):
            want = reference.forward(attn[1][i], *(x[:n] for x in inputs[i]))
            err = rel_err(outs[i][:n].float(), want.float())
            assert err <= FP8_TOL[dtype], f"size {size}, contexts {contexts}, layer {i}: {err:.2e}"
            assert torch.equal(
                graphed.caches[i].view(torch.uint8), reference.caches[i].view(torch.uint8)
            ), (size, contexts, i)


@pytest.mark.gpu
@on_gpu
def test_gpu_fp8_kv_flashinfer_agrees_with_torch(flashinfer, tmp_path_factory) -> None:
    """A tiny Llama (head_dim 128, group 2) in bf16 with an e4m3 cache and checkpoint scales
    (k 0.5 / v 0.25 and k 2 / v 4 in its two layers): the flashinfer backend with CUDA graphs
    against the torch backend, greedy tokens in the top-5 sense (identical up to the first
    divergence, there each side's token in the other's top 5), prompts then prompts over
    their cached prefixes."""
    from test_fp8_kv import PROMPTS, agree_in_top5, make_llm, run

    path = llama_with_kv_scales(tmp_path_factory.mktemp("llama_fi_fp8"))
    base = {
        "model.dtype": "bfloat16",
        "engine.device": "cuda",
        "kv_cache.dtype": "fp8_e4m3",
        "kv_cache.memory": "256MiB",
        "scheduler.max_running": 8,  # few graph sizes to capture
    }
    on_fi = make_llm(path, **base, **{"engine.attention_backend": "flashinfer"})
    ex = on_fi.engine.executor
    assert type(ex.attention).__name__ == "FlashInferAttention"
    assert ex.graphs is not None, ex.eager_reason
    assert ex.attention.caches[0].dtype == FP8
    on_torch = make_llm(
        path, **base, **{"engine.attention_backend": "torch", "engine.cuda_graphs": False}
    )
    assert type(on_torch.engine.executor.attention) is TorchAttention
    again = [p[:40] + [9, 8, 7] for p in PROMPTS if len(p) > 40]  # prefix-cache hits
    for prompts in (PROMPTS + [list(range(3, 200)), [11] * 5], again):
        agree_in_top5(run(on_fi, prompts), run(on_torch, prompts))
    assert [ex.attention._scales[i][1] for i in range(2)] == KV_SCALES
    assert sum(ex.graphs.replays.values()) > 0
