"""CUDA graphs for decode: the ladder and padding, the eager fallback and its reasons, and the
Triton backend's static-buffer decode path. On the CPU that path runs eagerly under Triton's
interpreter; on a GPU (pytest -m gpu) captured graphs must generate what eager steps generate."""

from __future__ import annotations

import contextlib
import gc
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import interpreted, same_random_caches, scattered_tables  # noqa: E402
from gpu_attention import capture, replay, zero_decode_inputs  # noqa: E402
from test_attention_torch import rel_err  # noqa: E402
from test_engine import tiny_config  # noqa: E402

from inferx_core.attention_torch import TorchAttention  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_core.interfaces.scheduler import ScheduledChunk  # noqa: E402
from inferx_core.sequence import SamplingParams, Sequence  # noqa: E402
from inferx_kernels_cuda.cuda_graphs import (  # noqa: E402
    MAX_GRAPH_BATCH,
    DecodeGraphRunner,
    batch_ladder,
    eager_reason,
)
from inferx_kernels_cuda.runtime import CudaModelRunner  # noqa: E402

CPU = torch.device("cpu")
# Largest |a - b| over the largest |b|, as in test_triton_attention.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def triton_attention(*args, **kwargs):
    mod = pytest.importorskip(
        "inferx_kernels_cuda.triton_attention", reason="the triton package is not installed"
    )
    return mod.TritonAttention(*args, **kwargs)


def seeded_backends(
    layers: list[KVLayerSpec], block_size: int, dtype: torch.dtype, num_blocks: int, **kwargs
) -> tuple:
    """Two Triton backends (one to run from static buffers, one eagerly) and TorchAttention,
    their caches holding the same random values."""
    static = triton_attention(layers, block_size, dtype, CPU, **kwargs)
    eager = triton_attention(layers, block_size, dtype, CPU, **kwargs)
    reference = TorchAttention(layers, block_size, dtype, CPU)
    same_random_caches([static, eager, reference], num_blocks, dtype)
    return static, eager, reference


def check_static_step(static, eager, reference, batch, padded: int, dtype, label: str) -> None:
    """One step of every layer: `static` (its static layout already copied in) over `padded`
    rows of random q, k, v whose extra rows are garbage, against `eager` and `reference` on the
    real rows after begin_step(batch). Outputs agree to TOL; padding writes no cache slot, so
    the static and eager caches end equal."""
    real = int(batch.query_start[-1])
    eager.begin_step(batch)
    reference.begin_step(batch)
    for layer, spec in enumerate(static.layers):
        heads = (spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads)
        qkv = [torch.randn(padded, h, spec.head_dim).to(dtype) for h in heads]
        scale = spec.head_dim**-0.5
        got = static.forward(static.layer(layer, scale), *qkv)[:real]
        want = eager.forward(eager.layer(layer, scale), *(x[:real] for x in qkv))
        ref = reference.forward(reference.layer(layer, scale), *(x[:real] for x in qkv))
        assert got.shape == want.shape == (real, spec.num_q_heads, spec.head_dim)
        err = rel_err(got, want)
        assert err <= TOL[dtype], f"{label}, layer {layer}: {err:.2e} vs eager"
        err = rel_err(got, ref)
        assert err <= TOL[dtype], f"{label}, layer {layer}: {err:.2e} vs torch"
    for layer in range(len(static.layers)):
        assert torch.equal(static.caches[layer], eager.caches[layer]), (label, layer)


class GraphCapable(TorchAttention):
    """A backend that claims graph support and records how its buffers were sized."""

    supports_cuda_graphs = True

    def init_graph_buffers(self, max_batch: int, max_blocks_per_seq: int) -> None:
        self.graph_buffers = (max_batch, max_blocks_per_seq)


def checkpoint(arch: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama or Qwen2 saved the way test_engine saves it (weights large enough
    that greedy choices are far apart)."""
    torch.manual_seed(0)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    model = cls(tiny_config(arch)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path)
    return path


@dataclass
class Step:
    request_ids: list[str]  # the sampled rows' requests, in row order
    logits: torch.Tensor


class LogitsRecorder:
    """Stands in for a runner's sampler: keeps a host copy of every step's logits."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.steps: list[Step] = []

    def __call__(self, logits: torch.Tensor, seqs, *later):
        self.steps.append(Step([s.request_id for s in seqs], logits.float().cpu().clone()))
        return self.sampler(logits, seqs, *later)

    def take(self) -> list[Step]:
        steps, self.steps = self.steps, []
        return steps


def decode_chunks(n: int) -> list[ScheduledChunk]:
    seqs = [Sequence([1, 2, 3], SamplingParams()) for _ in range(n)]
    return [ScheduledChunk(s, 2, 1, True) for s in seqs]


# -- the ladder and padding ------------------------------------------------------------------


def test_ladder() -> None:
    assert batch_ladder(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert batch_ladder(13) == [1, 2, 4, 8, 13]
    assert batch_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_ladder(16) == [1, 2, 4, 8, 16]
    assert batch_ladder(2) == [1, 2]
    assert batch_ladder(1) == [1]
    with pytest.raises(ValueError, match="at least 1"):
        batch_ladder(0)


def test_padding_stays_small() -> None:
    """Any batch pads by less than 16 rows, and below 16 to less than twice its size."""
    sizes = batch_ladder(256)
    for n in range(1, 257):
        padded = min(s for s in sizes if s >= n)
        assert padded - n < 16 and (n >= 16 or padded < 2 * n), (n, padded)


def test_runner_pads_to_the_next_captured_size() -> None:
    backend = GraphCapable([KVLayerSpec(2, 1, 16)], 16, torch.float32, CPU)
    runner = DecodeGraphRunner(None, backend, CPU, 1000, 100, 16)  # type: ignore[arg-type]
    assert runner.max_batch == MAX_GRAPH_BATCH == runner.sizes[-1]
    assert backend.graph_buffers == (MAX_GRAPH_BATCH, 7)  # ceil(100 / 16) blocks per sequence
    padded = {n: runner.padded_size(n) for n in (1, 2, 3, 5, 8, 9, 13, 16, 17, 255, 256, 257)}
    assert padded == {
        1: 1,
        2: 2,
        3: 4,
        5: 8,
        8: 8,
        9: 16,
        13: 16,
        16: 16,
        17: 32,
        255: 256,
        256: 256,
        257: None,
    }
    assert runner.fits(decode_chunks(256))
    assert not runner.fits(decode_chunks(257))
    prompt_chunk = ScheduledChunk(Sequence([1, 2, 3], SamplingParams()), 0, 3, True)
    assert not runner.fits(decode_chunks(3) + [prompt_chunk])

    small = DecodeGraphRunner(None, backend, CPU, 13, 100, 16)  # type: ignore[arg-type]
    assert small.sizes == [1, 2, 4, 8, 13]
    assert [small.padded_size(n) for n in (9, 13, 14)] == [13, 13, None]


def test_runner_fills_pending_tokens_after_the_attention_copies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay writes the PENDING tokens (fill) after the attention backend's metadata copies
    (fewer switches of copy direction on the stream), into the static input ids the forward
    pass reads."""
    calls: list[str] = []

    class Recording(GraphCapable):
        def prepare_for_capture(self, batch_size: int) -> None:
            calls.append("capture-plan")

        def prepare_for_replay(self, batch, padded_batch_size: int) -> None:
            calls.append("attention")

    backend = Recording([KVLayerSpec(2, 1, 16)], 16, torch.float32, CPU)
    runner = DecodeGraphRunner(None, backend, CPU, 8, 64, 16)  # type: ignore[arg-type]
    seen: list[list[int]] = []

    def forward(size: int) -> None:
        calls.append("forward")
        seen.append(runner.input_ids[:size].tolist())
        runner.logits = torch.zeros(size, 5)

    def fill(input_ids: torch.Tensor) -> None:
        calls.append("fill")
        input_ids[1] = 42

    monkeypatch.setattr(runner, "_forward", forward)
    chunks = decode_chunks(3)
    for i, c in enumerate(chunks):
        c.seq.block_table = [i + 1]
    runner.run(chunks, fill)
    assert calls == ["capture-plan", "attention", "fill", "forward"]
    assert seen == [[3, 42, 3, 0]]  # token 2 of [1, 2, 3] is 3; row 1 filled; row 3 padding


# -- when decode runs eagerly, and why --------------------------------------------------------


def test_eager_reasons() -> None:
    cuda = torch.device("cuda")  # a device object only: nothing touches CUDA
    capable = GraphCapable([KVLayerSpec(2, 1, 16)], 16, torch.float32, CPU)
    plain = TorchAttention([KVLayerSpec(2, 1, 16)], 16, torch.float32, CPU)
    assert eager_reason(True, cuda, capable) is None
    assert eager_reason(False, cuda, capable) == "engine.cuda_graphs is false"
    assert eager_reason(True, CPU, capable) == "the device is cpu, not cuda"
    reason = eager_reason(True, cuda, plain)
    assert reason is not None and "TorchAttention" in reason and "does not support" in reason
    # Two KV groups: graphs where the backend's buffers hold every group's tables.
    sliding = KVLayerSpec(2, 1, 16, kind="sliding", window=32)
    two = GraphCapable([KVLayerSpec(2, 1, 16), sliding], 16, torch.float32, CPU)
    assert eager_reason(True, cuda, two) is None
    two.supports_kv_groups = False
    assert eager_reason(True, cuda, two) == (
        "the model has 2 KV cache groups, which the GraphCapable backend's graph buffers do "
        "not hold"
    )


def test_backends_without_graphs_refuse_the_life_cycle() -> None:
    backend = TorchAttention([KVLayerSpec(2, 1, 16)], 16, torch.float32, CPU)
    assert not backend.supports_cuda_graphs
    batch = make_attention_batch([1], [1], [[1]], 16)
    for call in (
        lambda: backend.init_graph_buffers(4, 4),
        lambda: backend.prepare_for_capture(4),
        lambda: backend.prepare_for_replay(batch, 4),
    ):
        with pytest.raises(NotImplementedError, match="TorchAttention does not support CUDA"):
            call()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({}, "the device is cpu, not cuda"),
        ({"engine.cuda_graphs": False}, "engine.cuda_graphs is false"),
    ],
)
def test_model_runner_on_cpu_runs_eagerly(tmp_path_factory, caplog, overrides, reason) -> None:
    path = checkpoint("llama", tmp_path_factory)
    config = load_config(
        None,
        {"model.path": str(path), "model.dtype": "float32", "engine.device": "cpu", **overrides},
    )
    with caplog.at_level(logging.INFO, logger="inferx.executor"):
        runner = CudaModelRunner(config)
    assert runner.graphs is None
    assert runner.eager_reason == reason
    assert "cuda_graphs" not in runner.report.seconds
    said = [r.getMessage() for r in caplog.records if "decode runs eagerly" in r.getMessage()]
    assert said == [f"decode runs eagerly: {reason}"]


# -- the Triton backend's static-buffer decode path, run eagerly on the CPU --------------------


@interpreted
@pytest.mark.parametrize(
    ("block_size", "group", "dtype"),
    [
        (4, 1, torch.float32),
        (16, 2, torch.float32),
        (4, 4, torch.float16),
        (16, 2, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("reduce_heads", [1, 2])
def test_static_decode_path_matches_eager(
    block_size: int, group: int, dtype: torch.dtype, reduce_heads: int
) -> None:
    """One plan prepared for 4 rows serves a batch of 4 and then of 2 (rows that held real
    sequences turn into padding); each sequence splits its own context over the plan's two
    splits, in pieces of 16 or 32 tokens. Outputs equal the eager step's and TorchAttention's;
    padding rows (fed garbage queries and keys) write nothing, so every cache ends equal to the
    eager backend's. reduce_heads 2: the static plan's reduce takes two query heads a program."""
    torch.manual_seed(block_size * 10 + group)
    layers = [KVLayerSpec(2 * group, 2, 16), KVLayerSpec(group, 1, 32)]
    max_ctx = 64
    max_blocks = max_ctx // block_size
    num_blocks = 4 * max_blocks + 1
    # Two splits for 4 rows: a context over 32 tokens takes splits longer than the shortest.
    split = {"min_split_len": 16, "target_programs": 12}
    static, eager, reference = seeded_backends(layers, block_size, dtype, num_blocks, **split)
    static.reduce_heads = reduce_heads
    static.init_graph_buffers(8, max_blocks)
    static.prepare_for_capture(4)
    assert static._plan is not None and static._plan.num_splits == 2

    for contexts in ([37, 5, 64, 20], [1, 50]):
        tables = scattered_tables(contexts, block_size, num_blocks)
        batch = make_attention_batch([1] * len(contexts), contexts, tables, block_size)
        static.prepare_for_replay(batch, 4)
        check_static_step(static, eager, reference, batch, 4, dtype, f"contexts {contexts}")


@interpreted
def test_static_plan_checks_its_inputs() -> None:
    backend = triton_attention([KVLayerSpec(2, 1, 16)], 4, torch.float32, CPU)
    with pytest.raises(RuntimeError, match="init_graph_buffers"):
        backend.prepare_for_capture(1)
    backend.init_graph_buffers(4, 2)
    with pytest.raises(ValueError, match="outside the graph buffers"):
        backend.prepare_for_capture(5)
    prefill = make_attention_batch([3], [3], [[1]], 4)
    with pytest.raises(ValueError, match="decode-only batch"):
        backend.prepare_for_replay(prefill, 4)
    too_wide = make_attention_batch([1], [12], [[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="2 blocks each"):
        backend.prepare_for_replay(too_wide, 4)


@interpreted
@pytest.mark.parametrize("prefill_chunk", [512, 1])
def test_runner_generates_like_eager_steps(tmp_path_factory, prefill_chunk: int) -> None:
    """The whole executor path on the CPU: DecodeGraphRunner.run (pinned-style staging, padding,
    the static plan; no graph to replay on the CPU, so the same pass runs eagerly) against
    ordinary eager steps, as the batch shrinks from 3 to 1. With prefill_chunk=1 every prompt
    token is a one-token chunk too, so steps that sample only some rows go through the runner."""
    llm = cpu_triton_llm(checkpoint("llama", tmp_path_factory), prefill_chunk)
    ex = llm.engine.executor
    assert ex.graphs is None
    ex.attention.min_split_len = 16  # split on the CPU: 4 splits of the graph plan's 64 tokens
    ex.attention.target_programs = 10**6

    def install() -> None:
        ex.graphs = DecodeGraphRunner(ex.model, ex.attention, ex.device, 4, ex.max_model_len, 16)

    generates_like_eager(llm, install)
    if prefill_chunk == 512:  # one prefill step, then decodes of 3, 3, 2, 2, 1, 1, 1 sequences
        assert ex.graphs.replays == Counter({4: 2, 2: 2, 1: 3})
    else:  # every step: the 3, 7 and 17 prompt tokens one at a time, then 2, 4 and 7 decodes
        assert ex.graphs.replays == Counter({4: 5, 2: 6, 1: 13})


@interpreted
def test_decode_rotary_generates_like_the_separate_kernel(tmp_path_factory) -> None:
    """decode_rotary (the default: the decode kernel rotates and writes the new tokens itself
    in decode-only steps) against decode_rotary off (rotary_kv_write_kernel first):
    eager steps give the same tokens and logits within 1e-4, and the graph runner's steps
    (split in 4) the same as eager ones."""
    path = checkpoint("llama", tmp_path_factory)
    prompts = [list(range(3, 40)), [5, 9, 17, 33, 65, 129, 200], [7] * 3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def eager_run(decode_rotary: bool = True) -> tuple[LLM, list[list[int]], list[Step]]:
        llm = cpu_triton_llm(path, 512)
        if not decode_rotary:
            llm.engine.executor.attention.decode_rotary = False
        recorder = llm.engine.executor.sampler = LogitsRecorder(llm.engine.executor.sampler)
        return llm, [c.token_ids for c in llm.generate(prompts, params)], recorder.take()

    separate, tokens, logits = eager_run(decode_rotary=False)
    assert not separate.engine.executor.attention.decode_rotary
    llm, variant_tokens, variant_logits = eager_run()
    ex = llm.engine.executor
    assert ex.attention.decode_rotary
    assert variant_tokens == tokens
    for step, (a, b) in enumerate(zip(variant_logits, logits, strict=True)):
        assert rel_err(a.logits, b.logits) <= 1e-4, f"step {step}"
    ex.attention.min_split_len = 16
    ex.attention.target_programs = 10**6
    ex.sampler = ex.sampler.sampler

    def install() -> None:
        ex.graphs = DecodeGraphRunner(ex.model, ex.attention, ex.device, 4, ex.max_model_len, 16)

    generates_like_eager(llm, install)
    assert ex.graphs.replays


def cpu_triton_llm(path: Path, prefill_chunk: int) -> LLM:
    """The tiny checkpoint on the CPU with the Triton backend (interpreted): 64-token context,
    4 sequences at a time, no prefix cache."""
    config = {
        "model.path": str(path),
        "model.dtype": "float32",
        "model.max_model_len": 64,
        "engine.device": "cpu",
        "engine.attention_backend": "triton",
        "engine.overlap": True,  # PENDING tokens beside the runners, as on a GPU
        "scheduler.max_running": 4,
        "scheduler.prefix_cache": False,
        "scheduler.prefill_chunk": prefill_chunk,
    }
    return LLM(load_config(None, config))


def generates_like_eager(llm: LLM, install: Callable[[], None]) -> list[Step]:
    """Three greedy requests of 8, 5 and 3 tokens (17-, 7- and 3-token prompts) generated
    eagerly, then again after install() puts a graph runner in: the same tokens, and every
    step's logits within 1e-4. Returns the second run's steps."""
    ex = llm.engine.executor
    recorder = ex.sampler = LogitsRecorder(ex.sampler)
    prompts = [list(range(3, 20)), [5, 9, 17, 33, 65, 129, 200], [7] * 3]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (8, 5, 3)]

    eager = [c.token_ids for c in llm.generate(prompts, params)]
    eager_logits = recorder.take()
    install()
    static = [c.token_ids for c in llm.generate(prompts, params)]
    static_logits = recorder.take()

    assert static == eager
    assert [s.logits.shape for s in static_logits] == [s.logits.shape for s in eager_logits]
    for step, (a, b) in enumerate(zip(static_logits, eager_logits, strict=True)):
        err = rel_err(a.logits, b.logits)
        assert err <= 1e-4, f"step {step}: logits differ by {err:.2e}"
    return static_logits


class FakeGraph:
    """torch.cuda.CUDAGraph's surface, on the CPU: records the pool it was captured into."""

    def __init__(self) -> None:
        self.captured_into: object = "not captured"
        self.replays = 0

    def pool(self) -> tuple[str, int]:
        return ("pool of", id(self))

    def replay(self) -> None:
        self.replays += 1


@interpreted
def test_capture_order_pool_and_replay_bookkeeping(tmp_path_factory, monkeypatch) -> None:
    """dry_run(), capture() and run() with torch.cuda's graph API faked on the CPU: the dry run
    walks every size once, largest first, and keeps no static output; capture largest size
    first, each after an eager warm-up, all into the first graph's pool; a step replays the
    graph of its padded size after copying its layout in; a failed capture names the size and
    the switch."""
    path = checkpoint("llama", tmp_path_factory)
    config = {
        "model.path": str(path),
        "model.dtype": "float32",
        "model.max_model_len": 64,
        "engine.device": "cpu",
        "engine.attention_backend": "triton",
    }
    ex = LLM(load_config(None, config)).engine.executor
    runner = DecodeGraphRunner(ex.model, ex.attention, ex.device, 13, ex.max_model_len, 16)
    forwards: list[int] = []
    model_forward = ex.model.forward
    monkeypatch.setattr(
        ex.model, "forward", lambda ids, pos: forwards.append(len(ids)) or model_forward(ids, pos)
    )
    captures: list[int] = []

    @contextlib.contextmanager
    def fake_capture(graph: FakeGraph, pool=None):
        graph.captured_into = pool
        captures.append(len(forwards))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    runner.dry_run()
    assert forwards == [13, 8, 4, 2, 1] and runner.logits is None and not runner.graphs
    forwards.clear()
    runner.capture()

    assert forwards == [13, 13, 8, 8, 4, 4, 2, 2, 1, 1]  # a warm-up, then the captured run
    assert captures == [1, 3, 5, 7, 9]  # each capture begins after its size's warm-up
    first = runner.graphs[13]
    assert first.captured_into is None
    assert all(runner.graphs[s].captured_into == first.pool() for s in (8, 4, 2, 1))
    assert runner.logits is not None and runner.logits.shape == (13, 256)
    assert gc.get_freeze_count() == 0

    g = ex.attention._graph
    g.block_table.fill_(9)  # a stale id everywhere: columns past the step's tables keep it
    chunks = []
    for n, table in ((3, [6]), (5, [3]), (20, [4, 5])):
        seq = Sequence(list(range(3, 3 + n)), SamplingParams())
        seq.block_table = table
        chunks.append(ScheduledChunk(seq, n - 1, 1, True))
    logits = runner.run(chunks)
    assert logits.shape == (3, 256) and logits.data_ptr() == runner.logits.data_ptr()
    assert runner.graphs[4].replays == 1 and runner.replays == Counter({4: 1})
    assert runner.input_ids[:4].tolist() == [5, 7, 22, 0]
    assert runner.positions[:4].tolist() == [2, 4, 19, 0]
    assert g.context_len[:4].tolist() == [3, 5, 20, 1]
    assert g.slot_mapping[:4].tolist() == [6 * 16 + 2, 3 * 16 + 4, 5 * 16 + 3, -1]
    # Only the 2 columns the widest table uses are copied, not all max_model_len / 16 (the
    # host table's unused entries, 0 here, come along within them: never read).
    assert g.block_table[:3, :3].tolist() == [[6, 0, 9], [3, 0, 9], [4, 5, 9]]

    @contextlib.contextmanager
    def failing_capture(graph: FakeGraph, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "graph", failing_capture)
    with pytest.raises(RuntimeError, match="batch size 13 failed .*engine.cuda_graphs = false"):
        runner.capture()
    assert gc.get_freeze_count() == 0


# -- on the GPU: captured graphs against eager steps ------------------------------------------

NEW = 32
# A divergence is tolerated only between two top tokens this close (nats) on both sides: in
# bf16 logits are rounded to ~0.03 and ties are common with a 256-token vocabulary; in fp32
# padded GEMMs may sum in another order (~1e-6), and gaps under 1e-4 occur.
TIE = {"float32": 1e-3, "bfloat16": 0.15}
TOP = 5  # logprobs asked per token: a divergence is judged against each side's top 5
LOGITS_TOL = {"float32": 1e-3, "bfloat16": 5e-2}


def ragged_prompts(n: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 256) for _ in range(rng.randint(shortest, longest))] for _ in range(n)
    ]


def step_of(steps: list[Step], request_id: str, token: int) -> int:
    """The index of the step that sampled a request's token-th output token."""
    seen = 0
    for k, step in enumerate(steps):
        if request_id in step.request_ids:
            if seen == token:
                return k
            seen += 1
    raise AssertionError(f"no step sampled token {token} of {request_id}")


def compare_runs(name: str, on, off, on_steps, off_steps, dtype: str) -> list[str]:
    """Problems between the graphs-on and graphs-off completions of one scenario: tokens must
    be equal, or diverge at a near tie (reported, not failed); logits must agree on every step
    before the first divergence."""
    problems = []
    cut = len(on_steps)
    for r, (a, b) in enumerate(zip(on, off, strict=True)):
        if a.token_ids == b.token_ids:
            continue
        common = min(len(a.token_ids), len(b.token_ids))
        i = next((j for j in range(common) if a.token_ids[j] != b.token_ids[j]), common)
        if i == common:
            problems.append(f"{name}: request {r}: {len(a.token_ids)} vs {len(b.token_ids)} tokens")
            continue
        ta, tb = a.token_ids[i], b.token_ids[i]
        top_on, top_off = dict(a.logprobs[i][1]), dict(b.logprobs[i][1])
        msg = (
            f"{name}: request {r} diverges at token {i}: graphs {ta}, eager {tb} "
            f"(graphs top-5 {top_on}, eager top-5 {top_off})"
        )
        # vLLM's check_logprobs_close rule: each side's token is in the other's top 5, and
        # here also within TIE of the other's pick (a near tie, not a different answer).
        tie = (
            ta in top_off
            and tb in top_on
            and abs(top_off[ta] - top_off[tb]) <= TIE[dtype]
            and abs(top_on[ta] - top_on[tb]) <= TIE[dtype]
        )
        if tie:
            print("tolerated, a near tie:", msg)
        else:
            problems.append(msg)
        cut = min(cut, step_of(on_steps, a.request_id, i))
    on_steps, off_steps = on_steps[:cut], off_steps[:cut]
    if [s.logits.shape for s in on_steps] != [s.logits.shape for s in off_steps]:
        return problems + [f"{name}: the runs took different steps"]
    worst = max(
        (rel_err(a.logits, b.logits) for a, b in zip(on_steps, off_steps, strict=True)),
        default=0.0,
    )
    print(f"{name}: {cut} steps compared, worst logits difference {worst:.2e}")
    if worst > LOGITS_TOL[dtype]:
        problems.append(f"{name}: logits differ by {worst:.2e} (limit {LOGITS_TOL[dtype]:.0e})")
    return problems


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gpu_graphs_generate_like_eager(arch: str, dtype: str, tmp_path_factory) -> None:
    """Greedy generation with CUDA graphs equals generation without, token for token (a
    divergence is allowed only at a near tie, and reported), logits within 1e-3 in fp32:
    batches that hit (1, 8) and miss (3, 13) a captured size, a batch that shrinks as requests
    finish, and contexts long enough to use several decode splits."""
    path = checkpoint(arch, tmp_path_factory)
    base = {
        "model.path": str(path),
        "model.dtype": dtype,
        "engine.device": "cuda",
        "engine.attention_backend": "triton",
        "kv_cache.memory": "512MiB",
        "scheduler.prefix_cache": False,
    }
    on = LLM(load_config(None, {**base, "engine.cuda_graphs": True}))
    off = LLM(load_config(None, {**base, "engine.cuda_graphs": False}))
    ex_on, ex_off = on.engine.executor, off.engine.executor
    assert ex_on.graphs is not None, f"graphs were not captured: {ex_on.eager_reason}"
    assert ex_off.graphs is None and ex_off.eager_reason == "engine.cuda_graphs is false"
    # The replays' copies go on their own stream behind the previous forward pass: what is
    # compared below covers that ordering.
    assert ex_on.graphs._input_stream is not None
    capture_s = ex_on.report.seconds.get("cuda_graphs", 0.0)
    print(
        f"{arch}/{dtype}: captured {len(ex_on.graphs.sizes)} sizes {ex_on.graphs.sizes} "
        f"in {capture_s:.3f} s"
    )
    assert capture_s > 0
    assert ex_on.graphs.sizes == batch_ladder(256)
    rec_on = ex_on.sampler = LogitsRecorder(ex_on.sampler)
    rec_off = ex_off.sampler = LogitsRecorder(ex_off.sampler)

    scenarios = [
        (f"{arch}/{dtype}/batch {n}", ragged_prompts(n, 3, 30, seed=n), [NEW] * n)
        for n in (1, 3, 8, 13)
    ]
    scenarios.append(
        (
            f"{arch}/{dtype}/shrinking",
            ragged_prompts(13, 3, 30, 13),
            [NEW - 2 * i for i in range(13)],
        )
    )
    scenarios.append((f"{arch}/{dtype}/long", ragged_prompts(3, 100, 200, 99), [NEW] * 3))
    problems = []
    for name, prompts, max_tokens in scenarios:
        params = [
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=TOP)
            for m in max_tokens
        ]
        before = Counter(ex_on.graphs.replays)
        got_on = on.generate(prompts, params)
        used = ex_on.graphs.replays - before
        got_off = off.generate(prompts, params)
        print(f"{name}: graph replays by padded size {dict(sorted(used.items()))}")
        if ex_on.graphs.padded_size(len(prompts)) not in used:
            problems.append(f"{name}: no replay at size {ex_on.graphs.padded_size(len(prompts))}")
        problems += compare_runs(name, got_on, got_off, rec_on.take(), rec_off.take(), dtype)
    del on, off, ex_on, ex_off
    gc.collect()
    torch.cuda.empty_cache()
    assert not problems, "\n".join(problems)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_captured_attention_serves_any_context(dtype: torch.dtype) -> None:
    """Attention alone, captured once for 4 rows, replayed for contexts from 1 to the 4096 the
    buffers hold (up to 64 splits per sequence) and for 3, 4 and 1 real rows: outputs match
    eager TritonAttention and TorchAttention, and padding rows write nothing."""
    from inferx_kernels_cuda.triton_attention import TritonAttention

    dev = torch.device("cuda")
    torch.manual_seed(0)
    bs, max_ctx, padded = 16, 4096, 4
    max_blocks = max_ctx // bs
    num_blocks = 4 * max_blocks + 1
    layers = [KVLayerSpec(16, 2, 128), KVLayerSpec(8, 1, 64)]
    graphed = TritonAttention(layers, bs, dtype, dev)
    eager = TritonAttention(layers, bs, dtype, dev)
    reference = TorchAttention(layers, bs, dtype, dev)
    same_random_caches([graphed, eager, reference], num_blocks, dtype)
    inputs = zero_decode_inputs(layers, padded, dtype, dev)
    scales = [s.head_dim**-0.5 for s in layers]

    def step() -> list[torch.Tensor]:
        return [
            graphed.forward(graphed.layer(i, scales[i]), *inputs[i]) for i in range(len(layers))
        ]

    graphed.init_graph_buffers(8, max_blocks)
    graph, outs = capture(graphed, padded, step)
    assert graphed._plan is not None
    print(f"{dtype}: captured with {graphed._plan.num_splits} splits per sequence")

    for contexts in ([1, 1000, 4096], [64, 65, 2047, 7], [4096]):
        n = len(contexts)
        tables = scattered_tables(contexts, bs, num_blocks)
        graphed.prepare_for_replay(make_attention_batch([1] * n, contexts, tables, bs), padded)
        replay(graph, inputs, [eager, reference], contexts, tables, bs)
        for i in range(len(layers)):
            real = [x[:n] for x in inputs[i]]
            want = eager.forward(eager.layer(i, scales[i]), *real)
            ref = reference.forward(reference.layer(i, scales[i]), *real)
            got = outs[i][:n]
            for other, label in ((want, "eager triton"), (ref, "torch")):
                err = rel_err(got, other)
                assert err <= TOL[dtype], f"contexts {contexts}, layer {i}: {err:.2e} vs {label}"
        torch.cuda.synchronize()
        for i in range(len(layers)):
            assert torch.equal(graphed.caches[i], eager.caches[i]), (contexts, i)
