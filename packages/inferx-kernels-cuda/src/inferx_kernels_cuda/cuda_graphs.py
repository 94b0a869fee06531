"""CUDA graphs: captured at start-up for a ladder of sizes, replayed padded.

A decode step at batch 1 launches about a thousand small kernels from Python; a graph replays
them all in one launch. Each captured size runs the model and the vocabulary projection over
static inputs (token ids, positions) and the attention backend's static metadata; a step of n
sequences replays the smallest captured size >= n, its extra rows padding that the backend makes
harmless. Sampling stays outside the graph, on the real rows.

Steps with prompt tokens (MixedGraphRunner) are graphs too, by padded token count: launching
their kernels one by one costs the host more than the GPU's own time for a short chunk,
whatever the chunk's length. They return hidden states; the vocabulary
projection of the sampled rows runs after the replay.
"""

from __future__ import annotations

import bisect
import gc
import logging
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from inferx_core.batch import host_tensor
from inferx_core.interfaces.attention import AttentionBackend, AttentionBatch
from inferx_core.interfaces.model import ModelArch
from inferx_core.interfaces.scheduler import ScheduledChunk

log = logging.getLogger("inferx.cuda_graphs")

MAX_GRAPH_BATCH = 256


def batch_ladder(max_batch: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, then every 16, and max_batch itself, so
    that any batch up to max_batch pads by less than 16 rows (and by less than half below 16)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, not {max_batch}")
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += range(16, max_batch, 16)
    return sizes + [max_batch]


def token_ladder(max_tokens: int) -> list[int]:
    """Token counts to capture steps with prompt tokens at, ascending: 64, 128, 192, 256, 384,
    512, 768, then every 512, and max_tokens itself. Past 64 rows the GEMMs are cuBLAS's and
    their time grows with the rows a graph was captured at (a few decodes and a short chunk
    at a wide rung cost much more than the decodes alone), hence the close rungs up to 512."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    sizes = [s for s in (64, 128, 192, 256, 384, 512, 768) if s < max_tokens]
    sizes += range(1024, max_tokens, 512)
    return sizes + [max_tokens]


def eager_reason(enabled: bool, device: torch.device, attention: AttentionBackend) -> str | None:
    """Why decode steps cannot use CUDA graphs here, or None when they can."""
    if not enabled:
        return "engine.cuda_graphs is false"
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if not attention.supports_cuda_graphs:
        return f"the {type(attention).__name__} attention backend does not support CUDA graphs"
    if len(attention.groups) > 1 and not attention.supports_kv_groups:
        # Such a backend's static buffers hold one block table a sequence.
        return (
            f"the model has {len(attention.groups)} KV cache groups, which the "
            f"{type(attention).__name__} backend's graph buffers do not hold"
        )
    return None


def _pinned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


class DecodeGraphRunner:
    """Captures and replays the decode forward pass (hidden states and logits) of one model.

    The host side of a step is written straight into pinned staging tensors (one row per
    sequence, no per-token lists): ids and positions travel in one copy, the attention
    backend's metadata in its own (prepare_for_replay).
    """

    def __init__(
        self,
        model: ModelArch,
        attention: AttentionBackend,
        device: torch.device,
        max_batch: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.attention = attention
        self.device = device
        self.block_size = block_size
        self.sizes = batch_ladder(min(max_batch, MAX_GRAPH_BATCH))
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        attention.init_graph_buffers(self.max_batch, self.max_blocks)
        n = self.max_batch
        # ids and positions are the rows of one tensor, on the device and staged on the host:
        # a replay moves both in one copy.
        self._inputs = torch.zeros((2, n), dtype=torch.int64, device=device)
        self.input_ids, self.positions = self._inputs
        self.logits: torch.Tensor | None = None  # [max_batch, vocab], sized by the first run
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays: Counter[int] = Counter()  # by padded size: what the ladder served
        self._staged_inputs = _pinned((2, n), torch.int64, device)
        self._ids, self._positions = self._staged_inputs
        self._context_len = _pinned((n,), torch.int32, device)
        self._slot_mapping = _pinned((n,), torch.int64, device)
        self._block_table = _pinned((n, self.max_blocks), torch.int32, device)
        self._query_start = torch.arange(n + 1, dtype=torch.int32)
        self._np = [t.numpy() for t in (self._ids, self._positions, self._context_len)]
        self._np += [self._slot_mapping.numpy(), self._block_table.numpy()]
        # Several KV groups: the slots and tables of groups 1.. are staged beside group 0's.
        more = len(attention.groups) - 1
        self._more_slots = _pinned((more, n), torch.int64, device)
        self._more_tables = _pinned((more, n, self.max_blocks), torch.int32, device)
        # Recorded after each replay's copies (on a GPU): the staging tensors are free again.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # Early copies: the forward pass records `_inputs_free` (inside the graph, as an
        # external event node) once it has read the static inputs for the last time, and the
        # next step's copies go on a stream of their own behind it, so that they run beside
        # this step's logits and sampling instead of after them.
        self._inputs_free: torch.cuda.Event | None = None
        self._input_stream: torch.cuda.Stream | None = None
        if device.type == "cuda" and attention.replays_on_current_stream:
            self._inputs_free = torch.cuda.Event(external=True)
            self._input_stream = torch.cuda.Stream(device)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a batch of num_seqs runs at, or None when it is too large."""
        return _next_size(self.sizes, num_seqs)

    def fits(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a step can replay: one new token per sequence, few enough sequences."""
        return len(chunks) <= self.max_batch and all(c.num_tokens == 1 for c in chunks)

    @torch.inference_mode()
    def capture(self, pool: object = None) -> object:
        """Capture every size, largest first so that smaller graphs reuse its memory pool (or
        `pool`, another runner's), each after one eager run of the same size (kernels compile
        and libraries set up outside). Returns the pool."""
        return _capture_ladder(
            self.sizes,
            self.graphs,
            self.attention.prepare_for_capture,
            self._forward,
            self.device,
            pool,
            "the decode CUDA graph of batch size {size}",
        )

    @torch.inference_mode()
    def dry_run(self) -> None:
        """The forward pass of every size, for jit_compile.compiles_in_background: their
        kernel variants compile, nothing is captured, and the static output is dropped again
        (made before the cache is sized, it would be counted twice)."""
        _dry_ladder(self.sizes, self.attention.prepare_for_capture, self._forward)
        self.logits = None

    def _copy_early(self, batch: AttentionBatch, size: int) -> None:
        """The step's copies into the static buffers on the input stream, once the last
        forward pass has read them (`_inputs_free`); the step's stream waits for them."""
        stream = self._input_stream
        assert stream is not None and self._inputs_free is not None and self._copied is not None
        stream.wait_event(self._inputs_free)
        with torch.cuda.stream(stream):
            self._inputs.copy_(self._staged_inputs, non_blocking=True)  # rows past size unread
            self.attention.prepare_for_replay(batch, size)
            self._copied.record()
        torch.cuda.current_stream(self.device).wait_event(self._copied)

    def _forward(self, size: int) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size])
        if self._inputs_free is not None:  # the static inputs are not read past this point
            self._inputs_free.record()
        if self.logits is None:  # the first (largest, eager) run makes the static output
            self.logits = _into_static(None, self.max_batch, self.model.compute_logits(hidden))
        else:  # the lm_head GEMM writes it itself: no copy of the logits in the step
            self.model.compute_logits_into(hidden, self.logits[:size])

    def run(
        self,
        chunks: Sequence[ScheduledChunk],
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Logits [len(chunks), vocab] of a step that fits(): chunk i is row i. The tensor is
        the graph's own output, valid until the next run. `fill`, if given, is called with the
        static input ids once the host's are copied in, to write tokens that are still on the
        device (PENDING on the host).

        A size not captured (before capture(), or on the CPU in tests) runs the same padded
        pass over the same static buffers eagerly.
        """
        n = len(chunks)
        size = self.padded_size(n)
        assert size is not None
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have left the staging tensors
        bs = self.block_size
        starts = [c.start for c in chunks]
        seqs = [c.seq for c in chunks]
        tables = [s.block_table for s in seqs]
        ids, positions, context_len, slot_mapping, table = self._np
        ids[:n] = [s.token_ids[p] for s, p in zip(seqs, starts, strict=True)]
        ids[n:size] = 0
        positions[:n] = starts
        positions[n:size] = 0
        context_len[:n] = positions[:n] + 1
        slot_mapping[:n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)]
        width = 1
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
            width = max(width, len(t))
        # Only the columns some sequence of this step uses travel to the device: the whole
        # [n, max_model_len / block_size] table was 8.4 MB a step at 256 x Llama 3.1's 128k
        # context (the copies of a large batch's step shrink about tenfold). The
        # slice is strided, so torch stages it through pageable memory: an asynchronous H2D
        # copy from pageable memory is staged at once and does not wait for the device.
        batch = AttentionBatch(
            query_lens=[1] * n,
            context_lens=[p + 1 for p in starts],
            block_tables=tables,
            slot_mapping=self._slot_mapping[:n],
            query_start=self._query_start[: n + 1],
            block_table=self._block_table[:n, :width],
            context_len=self._context_len[:n],
        )
        if self._more_tables.shape[0]:
            self._stage_groups(batch, seqs, starts)
        graph = self.graphs.get(size)
        if graph is None:
            self.attention.prepare_for_capture(size)
        if self._input_stream is not None:
            self._copy_early(batch, size)
            if fill is not None:
                fill(self.input_ids)
        else:
            self._inputs.copy_(self._staged_inputs, non_blocking=True)  # rows past size unread
            # The PENDING tokens' device copy after the metadata's host copies, not between
            # them: the stream switches copy directions fewer times ahead of the graph.
            self.attention.prepare_for_replay(batch, size)
            if fill is not None:
                fill(self.input_ids)
            if self._copied is not None:
                self._copied.record()
        if graph is None:
            self._forward(size)
        else:
            graph.replay()
        self.replays[size] += 1
        assert self.logits is not None
        return self.logits[:n]

    def _stage_groups(self, batch: AttentionBatch, seqs: list, starts: list[int]) -> None:
        """Every KV group's slots and block tables into `batch` (a model of several groups)."""
        n, bs = len(seqs), self.block_size
        batch.group_block_tables.append(batch.block_table)
        batch.group_slot_mappings.append(batch.slot_mapping)
        for g in range(self._more_tables.shape[0]):
            slots, table = self._more_slots[g].numpy(), self._more_tables[g].numpy()
            tables = [s.block_tables[g + 1] for s in seqs]
            slots[:n] = [t[p // bs] * bs + p % bs for t, p in zip(tables, starts, strict=True)]
            width = 1
            for i, t in enumerate(tables):
                table[i, : len(t)] = t
                width = max(width, len(t))
            batch.group_block_tables.append(self._more_tables[g, :n, :width])
            batch.group_slot_mappings.append(self._more_slots[g, :n])


def _next_size(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending `sizes` that holds n, or None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def _into_static(static: torch.Tensor | None, rows: int, value: torch.Tensor) -> torch.Tensor:
    """Copy `value` into the first rows of `static`, which is made [rows, ...] by the first
    call (the largest size's eager run, before any capture). One static output serves every
    size of a ladder: a graph's own output would stay in the memory pool for good."""
    if static is None:
        static = torch.empty((rows, *value.shape[1:]), dtype=value.dtype, device=value.device)
    static[: value.shape[0]].copy_(value)
    return static


def _dry_ladder(
    sizes: list[int], prepare: Callable[[int], None], forward: Callable[[int], None]
) -> None:
    for size in reversed(sizes):
        prepare(size)
        forward(size)


def _capture_ladder(
    sizes: list[int],
    graphs: dict[int, torch.cuda.CUDAGraph],
    prepare: Callable[[int], None],
    forward: Callable[[int], None],
    device: torch.device,
    pool: object,
    what: str,
) -> object:
    gc.collect()
    gc.freeze()  # a collection during each capture would walk every live object again
    try:
        for size in reversed(sizes):
            try:
                prepare(size)
                forward(size)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    forward(size)
            except Exception as exc:
                raise RuntimeError(
                    f"capturing {what.format(size=size)} failed ({exc}); set "
                    "engine.cuda_graphs = false (or engine.graph_max_tokens = 0) to run eagerly"
                ) from exc
            if pool is None:
                pool = graph.pool()
            graphs[size] = graph
    finally:
        gc.unfreeze()
    torch.cuda.synchronize(device)
    return pool


class MixedGraphRunner:
    """Captures and replays the forward pass (hidden states) of steps with prompt tokens, by
    token count; the attention backend's mixed hooks hold the layout. A step of t tokens over s
    sequences replays the smallest captured count >= t; padding tokens are id 0 at position 0
    and write no cache slot."""

    def __init__(
        self,
        model: ModelArch,
        attention: AttentionBackend,
        device: torch.device,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model = model
        self.attention = attention
        self.device = device
        self.sizes = token_ladder(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_seqs = max_seqs
        attention.init_mixed_graph_buffers(
            self.max_tokens, max_seqs, -(-max_model_len // block_size)
        )
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.hidden: torch.Tensor | None = None  # [max_tokens, hidden], sized by the first run
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays: Counter[int] = Counter()
        self.declined = 0  # steps of a fitting size whose layout the backend declined

    def padded_size(self, num_tokens: int) -> int | None:
        return _next_size(self.sizes, num_tokens)

    def fits(self, query_lens: list[int], context_lens: list[int]) -> bool:
        """Whether a step of these chunks replays: few enough tokens and sequences, and a
        layout the backend's graphs hold (takes_mixed_step; `declined` counts the others)."""
        if sum(query_lens) > self.max_tokens or len(query_lens) > self.max_seqs:
            return False
        if self.attention.takes_mixed_step(query_lens, context_lens):
            return True
        self.declined += 1
        return False

    @torch.inference_mode()
    def capture(self, pool: object = None) -> object:
        """As DecodeGraphRunner.capture; capture this runner first (its steps are larger)."""
        return _capture_ladder(
            self.sizes,
            self.graphs,
            self.attention.prepare_mixed_capture,
            self._forward,
            self.device,
            pool,
            "the CUDA graph of steps with prompt tokens at {size} tokens",
        )

    @torch.inference_mode()
    def dry_run(self) -> None:
        """As DecodeGraphRunner.dry_run."""
        _dry_ladder(self.sizes, self.attention.prepare_mixed_capture, self._forward)
        self.hidden = None

    def _forward(self, size: int) -> None:
        hidden = self.model(self.input_ids[:size], self.positions[:size])
        self.hidden = _into_static(self.hidden, self.max_tokens, hidden)

    def run(
        self,
        ids: list[int],
        positions: list[int],
        batch: AttentionBatch,
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states [len(ids), hidden] of a step that fits(), row t for token t; the
        graph's own output, valid until the next run. `batch` is the step's layout on the
        host; `fill` as in DecodeGraphRunner.run. Without a captured graph (before capture(),
        on the CPU) the same padded pass runs eagerly."""
        n = len(ids)
        size = self.padded_size(n)
        assert size is not None
        host = torch.zeros((2, size), dtype=torch.int64)  # padding: id 0 at position 0
        host[0, :n] = host_tensor(ids, torch.int64)
        host[1, :n] = host_tensor(positions, torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        if fill is not None:
            fill(self.input_ids)
        self.attention.prepare_mixed_replay(batch, size)
        graph = self.graphs.get(size)
        if graph is None:
            self._forward(size)
        else:
            graph.replay()
        self.replays[size] += 1
        assert self.hidden is not None
        return self.hidden[:n]
