"""The CUDA runtime: the model runner on a GPU, with what plain torch lacks there: the KV cache
sized from a profiled step, kernels compiled ahead on threads, warm-up steps, CUDA graphs for
decode steps and steps with prompt tokens, and a stream for the sampled tokens' copies."""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass

import torch

from inferx_core.batch import make_attention_batch, to_host
from inferx_core.executor import GiB, LoadError, ModelRunner, at_least_two
from inferx_core.interfaces import PendingStep, StepResult
from inferx_core.sampler import Sampler, TopLogprobs
from inferx_core.sequence import SamplingParams, Sequence
from inferx_kernels_cuda.cuda_graphs import (
    MAX_GRAPH_BATCH,
    DecodeGraphRunner,
    MixedGraphRunner,
    eager_reason,
)
from inferx_kernels_cuda.jit_compile import compiles_in_background, summarize

log = logging.getLogger("inferx.executor")


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory at start-up in bytes, measured around one worst-case profiling step."""

    total: int  # the card's memory
    other: int  # outside torch's allocator: CUDA context, libraries, other processes
    weights: int  # allocated before the profiling step: weights and fixed buffers
    activations: int  # the step's peak above that: activations, logits, sampling
    cuda_graphs: int = 0  # estimated memory pool of the decode CUDA graphs (0: eager decode)

    @property
    def used(self) -> int:
        return self.other + self.weights + self.activations + self.cuda_graphs

    def describe(self) -> str:
        return (
            f"{self.used / GiB:.2f} GiB in use at the peak (weights {self.weights / GiB:.2f}, "
            f"activation peak {self.activations / GiB:.2f}, CUDA graphs ~"
            f"{self.cuda_graphs / GiB:.2f}, outside torch {self.other / GiB:.2f})"
        )


def kv_cache_blocks(memory: float | int, bytes_per_block: int, profile: MemoryProfile) -> int:
    """KV blocks for kv_cache.memory once the profiled use is set aside.

    A fraction is of the card's total memory and bounds everything InferX uses: the cache gets
    what is left of it after `profile.used`. A size is the cache's alone and must fit in what
    the card has left after `profile.used`. Raises LoadError naming kv_cache.memory otherwise.
    """
    total = profile.total
    if isinstance(memory, float):
        kv_bytes = int(memory * total) - profile.used
        if kv_bytes < 2 * bytes_per_block:
            raise LoadError(
                f"kv_cache.memory = {memory} allows {memory * total / GiB:.2f} GiB of the card's "
                f"{total / GiB:.2f} GiB, which leaves {kv_bytes / GiB:.2f} GiB for the KV cache "
                f"after {profile.describe()}; raise kv_cache.memory (at most 1.0) or lower "
                "scheduler.max_batched_tokens"
            )
    else:
        kv_bytes = memory
        free = total - profile.used
        if memory > free:
            raise LoadError(
                f"kv_cache.memory = {memory / GiB:.2f} GiB does not fit: the card has "
                f"{total / GiB:.2f} GiB, {profile.describe()}, so at most {free / GiB:.2f} GiB "
                "is free for the KV cache; lower kv_cache.memory or give a fraction like 0.9"
            )
    return at_least_two(kv_bytes // bytes_per_block, bytes_per_block)


def fresh_tables(lengths: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of these lengths over consecutive blocks from 1 (block 0 is
    the padding block), and the first block left over."""
    tables: list[list[int]] = []
    next_block = 1
    for n in lengths:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables, next_block


def first_tokens(lens: list[int], n: int) -> list[int]:
    """The chunk lengths `lens` cut to their first n tokens in all."""
    out = []
    for length in lens:
        if n <= 0:
            break
        out.append(min(length, n))
        n -= out[-1]
    return out


class CudaModelRunner(ModelRunner):
    """ModelRunner on a CUDA device (engine.executor "cuda")."""

    def _prepare(self) -> None:
        config = self.config
        # Threads that compile Triton kernels in start-up's dry run (jit_compile).
        self.compile_threads = 0
        if self.device.type == "cuda":
            self.compile_threads = min(config.engine.compile_threads, os.cpu_count() or 1)
        # The sampled tokens (and logprobs) travel to the host on a stream of their own, so the
        # step's stream goes from sampling straight to the next step's host-to-device copies
        # (fewer idle gaps between steps; ARCHITECTURE.md's decision rows).
        self._copy_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
        # The graph runners (their static buffers) exist before the cache is sized: the
        # profiling step's dry run compiles their kernels too (_dry_run_start_up).
        self.eager_reason = eager_reason(config.engine.cuda_graphs, self.device, self.attention)
        if self.eager_reason is not None:
            log.info("decode runs eagerly: %s", self.eager_reason)
        else:
            if mixed_tokens := self._mixed_graph_tokens():
                self.mixed = MixedGraphRunner(
                    self.model,
                    self.attention,
                    self.device,
                    mixed_tokens,
                    min(config.scheduler.max_running, config.engine.graph_max_seqs),
                    self.max_model_len,
                    self.block_size,
                )
            self.graphs = DecodeGraphRunner(
                self.model,
                self.attention,
                self.device,
                config.scheduler.max_running,
                self.max_model_len,
                self.block_size,
            )
        self._compiled_ahead = False  # whether the profiling step's dry run covered start-up

    def _start(self) -> None:
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            if self.compile_threads > 1 and not self._compiled_ahead:
                with compiles_in_background(self.compile_threads) as compiles:
                    self._dry_run_start_up(self.num_kv_blocks)
                self.report.compiles = summarize(compiles, time.perf_counter() - t0)
            self._warm_up()
            variants = self.report.compiles.get("variants", 0)
            self.report.done("warm_up", t0, f"{variants} Triton kernel variants compiled ahead")
        if isinstance(self.graphs, DecodeGraphRunner):
            t0 = time.perf_counter()
            pool = self.mixed.capture() if self.mixed is not None else None
            self.graphs.capture(pool)
            mixed = len(self.mixed.sizes) if self.mixed else 0
            self.report.done(
                "cuda_graphs", t0, f"{len(self.graphs.sizes)} decode sizes, {mixed} mixed sizes"
            )

    def _device_kv_blocks(self, per_block: int, budget: float | int | None) -> int:
        """What kv_cache.memory allows after a profiling step (kv_cache_blocks)."""
        t0 = time.perf_counter()
        profile = self._profile_memory()
        self.report.done("profile", t0, "a worst-case step sizes the KV cache")
        blocks = kv_cache_blocks(0.9 if budget is None else budget, per_block, profile)
        self.report.memory = {
            "total": profile.total,
            "other": profile.other,
            "weights": profile.weights,
            "activations": profile.activations,
            "cuda_graphs": profile.cuda_graphs,
            "kv_cache": blocks * per_block,
        }
        log.info(
            "KV cache: %d blocks, %.2f GiB; weights %.2f GiB; activation peak %.2f GiB; "
            "CUDA graphs ~%.2f GiB; outside torch %.2f GiB; card %.2f GiB",
            blocks,
            blocks * per_block / GiB,
            profile.weights / GiB,
            profile.activations / GiB,
            profile.cuda_graphs / GiB,
            profile.other / GiB,
            profile.total / GiB,
        )
        return blocks

    def _mixed_graph_tokens(self) -> int:
        """The largest step with prompt tokens to capture (0: none): engine.graph_max_tokens
        within what the scheduler can send, where graphs run and the backend supports them."""
        if eager_reason(self.config.engine.cuda_graphs, self.device, self.attention):
            return 0
        if not self.attention.supports_mixed_graphs:
            return 0
        # The profiling step's prompt chunks are the most tokens one step can hold.
        return min(self.config.engine.graph_max_tokens, sum(self._profile_layout()[0]))

    def _profile_layout(self) -> tuple[list[int], list[list[int]], int, int]:
        """The worst step the scheduler allows, over a temporary cache: (prompt chunk lengths,
        their block tables, decode graph batch size or 0, temporary cache blocks).

        max_batched_tokens tokens as fresh prompt chunks of at most prefill_chunk tokens (no
        more chunks than max_running); the decode graphs' largest batch, when graphs are on,
        one block per sequence. Block 0 stays the padding block.
        """
        sched = self.config.scheduler
        chunk = min(sched.prefill_chunk, self.max_model_len)
        tokens = sched.max_batched_tokens
        lens = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
        lens = lens[: sched.max_running]
        tables, next_block = fresh_tables(lens, self.block_size)
        graph_batch = 0
        if eager_reason(self.config.engine.cuda_graphs, self.device, self.attention) is None:
            graph_batch = min(sched.max_running, MAX_GRAPH_BATCH)
        return lens, tables, graph_batch, max(next_block, graph_batch + 1)

    def _profile_step(
        self,
        query_lens: list[int],
        tables: list[list[int]],
        rows: int,
        sample: bool,
        context_lens: list[int] | None = None,
    ) -> torch.Tensor:
        """One forward of token 0 at every position, where query i is the last query_lens[i] of
        context_lens[i] tokens (default: all of them, a fresh sequence); logits for its last
        `rows` tokens and, if `sample`, sampling them with every filter and logprobs on (the
        sampler's largest working set). Returns the logits."""
        context_lens = context_lens or query_lens
        pairs = list(zip(query_lens, context_lens, strict=True))
        batch = make_attention_batch(query_lens, context_lens, tables, self.block_size, self.device)
        self.attention.begin_step(batch)
        num_tokens = sum(query_lens)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(c - q, c) for q, c in pairs]).to(self.device)
        hidden = self.model(ids, positions)
        picked = torch.arange(num_tokens - rows, num_tokens, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, picked))
        del hidden
        if sample:
            params = SamplingParams(
                temperature=1.0,
                top_k=50,
                top_p=0.9,
                min_p=0.05,
                repetition_penalty=1.1,
                logprobs=20,
            )
            seqs = [Sequence([0], params) for _ in range(rows)]
            Sampler(self.device)(logits, seqs)
        return logits

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Eager steps of the shapes that neither the profiling step (prompt chunks alone) nor
        the graph capture (decodes alone) runs: decodes eagerly, alone and beside a prompt
        chunk, with one split of the context and with several. Kernels compile now, not in the
        middle of serving (a JIT compile stalls every running request for up to seconds)."""
        self._warm_up_steps(self.num_kv_blocks)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warm_up_steps(self, num_blocks: int) -> None:
        """_warm_up's steps over a cache of num_blocks blocks (those that fit in it)."""
        bs = self.block_size
        long = max(2, min(1024, self.max_model_len - 1, (num_blocks - 1) // 3 * bs))
        cases = [([1], [long]), ([1, 1], [1, 2]), ([1, 17], [long, 17]), ([1, 16], [1, 16])]
        sched = self.config.scheduler
        fits = min(sched.prefill_chunk, sched.max_batched_tokens, self.max_model_len)
        cases += [([n], [n]) for n in self.attention.warm_up_prompt_lens if n <= fits]
        for query_lens, context_lens in cases:
            tables, next_block = fresh_tables(context_lens, bs)
            if next_block <= num_blocks:
                self._profile_step(query_lens, tables, 1, False, context_lens)
        # The sampler's argmax over logits of the model's dtype (greedy steps) and float32
        # (the race of sampled rows): the steps above sample nothing.
        for dtype in {self.dtype, torch.float32}:
            logits = torch.zeros(2, self.vocab_size, dtype=dtype, device=self.device)
            self.sampler.argmax(logits)

    def _dry_run_start_up(self, num_blocks: int) -> None:
        """Inside compiles_in_background: the warm-up's steps and every graph size, dry, over
        a cache of num_blocks blocks. Run within the profiling step's dry run, every kernel
        variant start-up needs compiles side by side in one wait, not one wait per phase."""
        self._warm_up_steps(num_blocks)
        for runner in (self.mixed, self.graphs):
            if runner is not None:
                runner.dry_run()

    @torch.inference_mode()
    def _profile_memory(self) -> MemoryProfile:
        """Run the worst step (see _profile_layout) over a temporary cache just big enough for
        it and measure, as nano-vllm does: the peak above the weights is the activations' share;
        an eager decode step at the graphs' largest batch stands for the graphs' memory pool."""
        dev = self.device
        lens, tables, graph_batch, num_blocks = self._profile_layout()
        gc.collect()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        self.attention.allocate(num_blocks)
        temporary = torch.cuda.memory_allocated(dev) - weights
        rows = min(self.config.scheduler.max_running, sum(lens))
        decode_tables = [[1 + i] for i in range(graph_batch)]
        # the graphs share one pool: the larger of the decode and the mixed step's needs
        mixed = self._mixed_graph_tokens() if graph_batch else 0
        mixed_lens = first_tokens(lens, mixed) if mixed else []
        try:
            if self.compile_threads > 1:  # the steps below, dry: kernels compile side by side
                dry_t0 = time.perf_counter()
                with compiles_in_background(self.compile_threads) as compiles:
                    self._profile_step(lens, tables, rows, sample=False)
                    if graph_batch:
                        self._profile_step([1] * graph_batch, decode_tables, graph_batch, False)
                    if mixed:
                        self._profile_step(mixed_lens, tables[: len(mixed_lens)], 1, False)
                    self._dry_run_start_up(num_blocks)
                self.report.compiles = summarize(compiles, time.perf_counter() - dry_t0)
                self._compiled_ahead = True
                gc.collect()
                torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            self._profile_step(lens, tables, rows, sample=True)
            torch.cuda.synchronize(dev)
            activations = max(0, torch.cuda.max_memory_allocated(dev) - weights - temporary)
            graphs = 0
            if graph_batch:
                before = torch.cuda.memory_allocated(dev)
                torch.cuda.reset_peak_memory_stats(dev)
                logits = self._profile_step([1] * graph_batch, decode_tables, graph_batch, False)
                torch.cuda.synchronize(dev)
                # The pool holds one step's intermediates; the runners keep their outputs outside.
                pool = torch.cuda.max_memory_allocated(dev) - before
                outputs = logits.numel() * logits.element_size()
                del logits
                if mixed:
                    before = torch.cuda.memory_allocated(dev)
                    torch.cuda.reset_peak_memory_stats(dev)
                    logits = self._profile_step(mixed_lens, tables[: len(mixed_lens)], 1, False)
                    torch.cuda.synchronize(dev)
                    pool = max(pool, torch.cuda.max_memory_allocated(dev) - before)
                    del logits
                    # and the runner's static output, outside the pool
                    hidden = int(self.hf_config["hidden_size"])
                    outputs += mixed * hidden * torch.tensor([], dtype=self.dtype).element_size()
                graphs = max(0, pool) + outputs
        except torch.OutOfMemoryError as exc:
            raise LoadError(
                f"the profiling step of {sum(lens)} tokens (scheduler.max_batched_tokens) ran "
                f"out of device memory beside {weights / GiB:.2f} GiB of weights; lower "
                f"scheduler.max_batched_tokens or scheduler.max_running ({exc})"
            ) from None
        finally:
            self.attention.allocate(1)  # drops the temporary cache before the real one is made
        gc.collect()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        other = max(0, total - free - torch.cuda.memory_reserved(dev))
        return MemoryProfile(total, other, weights, activations, graphs)

    def _sampled_step(
        self, tokens: torch.Tensor, top: TopLogprobs | None, ks: list[int | None] | None
    ) -> PendingStep:
        return _SampledStep(self.device, tokens, top, ks, self._copy_stream)


class _SampledStep:
    """A submitted step's sampled tokens (and logprobs), copying to the host: on `stream`
    once the step's stream has sampled them, or in order on the step's stream without one."""

    def __init__(
        self,
        device: torch.device,
        tokens: torch.Tensor,
        top: TopLogprobs | None,
        ks: list[int | None] | None,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        self.ks = ks
        self.copied: torch.cuda.Event | None = None
        if stream is None:  # (always off CUDA)
            self.tokens, self.top = to_host(tokens), top and top.copy_to_host()
        else:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.tokens, self.top = to_host(tokens), top and top.copy_to_host()
            # The device tensors are read on `stream`: keep their memory from being reused
            # by the step's stream before that.
            for t in [tokens] + ([top.sampled, top.ids, top.values] if top else []):
                t.record_stream(stream)
        if device.type == "cuda":
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        self._result: StepResult | None = None

    def result(self) -> StepResult:
        """The step's result, built once (structured rows ask for it a row at a time). The
        grammar worker's thread may ask too: the result is whole before it is published."""
        if self._result is None:
            if self.copied is not None:
                self.copied.synchronize()  # waits for this step only, not for a later one
            result = StepResult(sampled=self.tokens.tolist())
            if self.top is not None and self.ks is not None:
                result.logprobs = self.top.rows(self.ks)
            self._result = result
        return self._result
