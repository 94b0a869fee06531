"""The deployment config: deploy.toml parsed into pydantic models; flags override the file.

Every key has a command-line flag `--<section>-<key>` (underscores as dashes); the common ones
have a short alias too (ALIASES). Errors name the key: `kv_cache.block_size: ...`.
"""

from __future__ import annotations

import re
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config file or flag is wrong; the message names the key."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    path: str | None = Field(
        default=None,
        description="checkpoint directory, .gguf file or Hugging Face hub id org/name "
        "(neither path nor preset: the demo model)",
    )
    revision: str | None = Field(
        default=None, description="hub branch, tag or commit when path is a hub id (default: main)"
    )
    preset: str | None = Field(
        default=None, description="random weights with the exact shapes of a known model"
    )
    tokenizer: str | None = Field(
        default=None, description="directory with tokenizer.json, if not beside the weights"
    )
    load_format: str = Field(
        default="auto", description="auto, safetensors, gguf, dummy (or a plugin's format)"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        default="auto", description="auto: the checkpoint's on a GPU, float32 on the CPU"
    )
    max_model_len: int | None = Field(
        default=None, ge=1, description="context length (default: the checkpoint's)"
    )
    seed: int = Field(default=0, description="seed of dummy weights and unseeded sampling")
    served_name: str | None = Field(
        default=None, description="model name the API reports (default: the path or preset)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if self.path and self.preset:
            raise ValueError("set model.path or model.preset, not both")
        return self


class EngineSection(Section):
    device: str = Field(default="auto", description="auto, cpu, cuda or cuda:N")
    attention_backend: str = Field(
        default="auto", description="auto, torch, triton, flashinfer (or a plugin's backend)"
    )
    kernels: str = Field(
        default="auto", description="fused norm/rotary/activation ops: auto, torch, triton"
    )
    # auto takes cuda on a GPU where inferx-kernels-cuda is installed.
    executor: str = Field(
        default="auto",
        description="model runner: auto, torch (plain, eager), cuda (CUDA graphs, memory "
        "profiling, kernels compiled ahead)",
    )
    cuda_graphs: bool = Field(
        default=True, description="replay steps from CUDA graphs (GPU and a capable backend)"
    )
    # Steps with prompt tokens of up to this many tokens also replay CUDA graphs (captured for a
    # ladder of token counts, when the attention backend supports it); 0: they run eagerly.
    # 4096 over 2048: lower TTFT and higher throughput in serving (docs/BENCHMARKS.md).
    graph_max_tokens: int = Field(
        default=4096, ge=0, le=16384, description="largest step with prompt tokens in a graph"
    )
    # ... and over at most this many sequences (more decodes beside a chunk: eager).
    graph_max_seqs: int = Field(
        default=128, ge=1, description="most sequences in a graph step with prompt tokens"
    )
    # Schedule and submit step N+1 while the device runs step N. auto: on, unless the executor
    # computes on the CPU, where submitting a step runs it, so overlap gains nothing and holds
    # every output back one step (a later first token).
    overlap: bool | Literal["auto"] = Field(
        default="auto", description="prepare step N+1 while the device runs step N"
    )
    threads: int | None = Field(default=None, ge=1, description="torch CPU threads")
    # Once started, collect and gc.freeze() the heap so that Python's full collections skip the
    # objects start-up leaves (torch, triton, the model): a pass over them inside a step
    # stalls it (the decision register in docs/ARCHITECTURE.md).
    gc_freeze: bool = Field(
        default=True, description="freeze the heap once started (shorter garbage collections)"
    )
    # Start-up compiles Triton kernel variants on this many threads, in one dry run of every
    # phase's step shapes before the phases run them (0 or 1: one at a time, at first launch).
    # On a fresh Triton cache this shortens start-up (docs/BENCHMARKS.md).
    compile_threads: int = Field(
        default=8, ge=0, le=64, description="threads compiling Triton kernels at start-up"
    )

    # Structured output (a request's JSON schema): the grammar library, and how many compiled
    # schemas are kept (least recently used go first; 0 compiles every request's anew).
    grammar_backend: str = Field(
        default="auto", description="structured output's grammar library: auto, llguidance"
    )
    grammar_cache_size: int = Field(
        default=128, ge=0, description="compiled JSON schemas kept for reuse"
    )
    # Advance the matchers and fill the token masks on a thread of their own while the engine
    # applies the previous step and schedules the next (false, the default: the same tasks on
    # the engine's thread; faster at 64 clients, docs/ARCHITECTURE.md "Structured output").
    grammar_worker: bool = Field(
        default=False, description="fill structured output's token masks on a thread of their own"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", v):
            raise ValueError(f"must be auto, cpu, cuda or cuda:N, not {v!r}")
        return v


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_memory(value: float | int | str) -> float | int:
    """A fraction of device memory (0 < x <= 1), or an absolute size in bytes ("4GiB", "512MB")."""
    if isinstance(value, str):
        try:  # a bare number given as a flag
            return parse_memory(int(value) if value.strip().isdigit() else float(value))
        except ValueError:
            pass
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"{value!r} is not a size like '4GiB' or a fraction like 0.9")
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, int) and value > 1:
        return value
    raise ValueError(f"{value!r} is neither a fraction in (0, 1] nor a size in bytes")


class KVCacheSection(Section):
    manager: str = Field(default="paged", description="KV manager (or a plugin's)")
    block_size: int = Field(default=16, description="tokens a KV block holds (a power of two)")
    memory: float | int | str | None = Field(
        default=None,
        description="a fraction of the GPU (0.9 by default) or a size like '4GiB' (1GiB on CPU)",
    )
    num_blocks: int | None = Field(
        default=None, ge=2, description="KV blocks, overriding memory (block 0 is reserved)"
    )
    dtype: Literal["auto", "fp8_e4m3"] = Field(
        default="auto",
        description="the cache's dtype: auto (the model's) or fp8_e4m3 (half the bytes; "
        "k/v scales from the checkpoint, else 1.0)",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, v: int) -> int:
        if v not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"must be a power of two from 1 to 256, not {v}")
        return v

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: float | int | str | None) -> float | int | None:
        return None if v is None else parse_memory(v)


class SchedulerSection(Section):
    name: str = Field(default="continuous", description="scheduler (or a plugin's)")
    max_running: int = Field(default=256, ge=1, description="most sequences in one step")
    max_batched_tokens: int = Field(default=2048, ge=1, description="most tokens in one step")
    prefill_chunk: int = Field(
        default=512, ge=1, description="most prompt tokens of one sequence in one step"
    )
    prefix_cache: bool = Field(default=True, description="reuse cached prompt prefixes")
    max_waiting: int = Field(
        default=4096, ge=0, description="queued requests before new ones are refused (429)"
    )

    @model_validator(mode="after")
    def _budget(self) -> SchedulerSection:
        if self.prefill_chunk > self.max_batched_tokens:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) exceeds max_batched_tokens "
                f"({self.max_batched_tokens})"
            )
        if self.max_running > self.max_batched_tokens:
            raise ValueError(
                f"max_running ({self.max_running}) exceeds max_batched_tokens "
                f"({self.max_batched_tokens}): a full decode step would not fit"
            )
        return self


class QuantizationSection(Section):
    # auto: the scheme that reads the checkpoint's quantization_config (none without one). The
    # table's other keys are the scheme's options (QuantConfig.options), which it checks itself.
    model_config = ConfigDict(extra="allow", validate_assignment=True)
    scheme: str = Field(
        default="auto",
        description="quantization scheme: auto (the checkpoint's), none, or a plugin's",
    )

    def options(self) -> dict[str, Any]:
        """The keys besides `scheme`."""
        return dict(self.model_extra or {})


class ServerSection(Section):
    transport: str = Field(default="litestar", description="HTTP transport (or a plugin's)")
    host: str = Field(default="127.0.0.1", description="address to listen on")
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    drain_timeout: float = Field(
        default=30.0, ge=0, description="seconds SIGTERM lets running requests finish"
    )
    api_key: str | None = Field(default=None, description="bearer token clients must send")
    health_timeout: float = Field(
        default=30.0,
        gt=0,
        description="seconds without a finished step (while busy) before /health fails",
    )
    # Run the engine in a child process (its own GIL) rather than on a thread of the server's:
    # for many streams, where the engine's and the SSE loop's Python work share one GIL. auto: a
    # process when the engine runs on a GPU (measured faster there), a thread on a CPU (where
    # the child and the HTTP side would share the few cores).
    engine_process: bool | Literal["auto"] = Field(
        default="auto", description="run the engine in a child process (auto: on a GPU)"
    )
    # An idle engine handed a request while others are still being tokenized (a burst of
    # clients) waits up to this long for them, so that their prompts share one prompt step
    # instead of the first running alone and the rest queueing behind it. 0: never waits.
    intake_wait_ms: float = Field(
        default=5.0, ge=0, le=1000, description="ms an idle engine waits for a burst's prompts"
    )
    # tool_choice "auto": "lazy" holds a tool call to the tools' schemas from the moment the
    # model opens one (its text stays free); "off" (the default, as vLLM) only parses the
    # reply: a grammar on every row costs host time each step (docs/ARCHITECTURE.md).
    # "required" and a named function are always held to a call.
    tool_call_grammar: Literal["lazy", "off"] = Field(
        default="off", description="tool_choice auto: constrain calls once opened (lazy) or off"
    )


class ParallelSection(Section):
    # Ranks (processes, one GPU each) to shard the model over: inferx_core.distributed. A
    # size that does not divide the model's heads, KV heads or MLP is refused at start-up.
    tensor: int = Field(default=1, ge=1, description="GPUs (ranks) to shard the model over")
    # At parallel.tensor = 1, run through the same path as N ranks (a process group, NCCL on a
    # GPU; rank 0's TensorParallelExecutor broadcasting each step's plan) instead
    # of the plain executor: what that path costs, measured on one GPU. Above 1 it always is.
    distributed_executor: bool = Field(
        default=False,
        description="at parallel.tensor = 1 too, run the tensor-parallel executor (process "
        "group, per-step plan broadcast)",
    )


class Config(Section):
    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    kv_cache: KVCacheSection = KVCacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    quantization: QuantizationSection = QuantizationSection()
    server: ServerSection = ServerSection()
    parallel: ParallelSection = ParallelSection()


# Short flags for the keys people type most.
ALIASES = {
    "model": "model.path",
    "preset": "model.preset",
    "revision": "model.revision",
    "tokenizer": "model.tokenizer",
    "load-format": "model.load_format",
    "dtype": "model.dtype",
    "max-model-len": "model.max_model_len",
    "device": "engine.device",
    "attention-backend": "engine.attention_backend",
    "block-size": "kv_cache.block_size",
    "kv-cache-memory": "kv_cache.memory",
    "host": "server.host",
    "port": "server.port",
}


def flag_name(dotted: str) -> str:
    """The command-line flag of a dotted key, without its dashes: "server.engine_process" ->
    "server-engine-process" (what scripts that spawn `inferx-server` pass as --<name>)."""
    return dotted.replace(".", "-").replace("_", "-")


def config_keys() -> dict[str, tuple[str, str, Any]]:
    """flag name -> (section, key, annotation) for every key of every section."""
    keys = {}
    for section, info in Config.model_fields.items():
        for key, field in info.annotation.model_fields.items():
            keys[flag_name(f"{section}.{key}")] = (section, key, field.annotation)
    for alias, dotted in ALIASES.items():
        section, key = dotted.split(".")
        keys[alias] = (
            section,
            key,
            Config.model_fields[section].annotation.model_fields[key].annotation,
        )
    return keys


def flag_help(section: str, key: str) -> tuple[str, str]:
    """(metavar, help) of a key's flag, from its field: the type's name, or the choices where
    the key has a fixed set; the field's description where it has one; the default."""
    field = Config.model_fields[section].annotation.model_fields[key]
    ann = field.annotation
    args = (ann,) if typing.get_origin(ann) is Literal else typing.get_args(ann) or (ann,)
    types: list[str] = []
    choices: list[str] = []
    for arg in args:
        if typing.get_origin(arg) is Literal:
            choices += [str(c).lower() for c in typing.get_args(arg)]
        elif arg is bool:
            choices += ["true", "false"]
        elif arg is not type(None):
            types.append({int: "INT", float: "FLOAT", str: "STR"}.get(arg, "VALUE"))
    metavar = "|".join(types) if types else "{" + ",".join(choices) + "}"
    default = field.default
    shown = "none" if default is None else str(default).lower()
    parts = [field.description] if field.description else []
    parts.append(f"{section}.{key}; default: {shown}")
    if choices and types:
        parts.append("or one of " + ", ".join(choices))
    return metavar, "; ".join(parts)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read TOML (if given), apply {"section.key": value} overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        section, key = dotted.split(".", 1)
        sect = data.setdefault(section, {})
        if not isinstance(sect, dict):
            raise ConfigError(f"{section}: must be a table")
        sect[key] = value
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc, path)) from None


def format_errors(exc: ValidationError, path: str | Path | None = None) -> str:
    return "; ".join(error_lines(exc, path))


def error_lines(
    exc: ValidationError, path: str | Path | None = None, whole: str = "config"
) -> list[str]:
    """One `key: problem` per error of a pydantic validation (`whole` where it names no key)."""
    where = f"{path}: " if path else ""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or whole
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{where}{loc}: {msg}")
    return lines
