"""Pluggy hook specifications: one hook per kind of implementation a package can add.

Each hook receives `register(name, target)`; target is the implementation itself or a lazy
"package.module:Attribute" string, imported only when a deployment picks that name (so listing
plugins never imports torch kernels or initialises CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("inferx")
hookimpl = pluggy.HookimplMarker("inferx")

Register = Callable[[str, object], None]


@hookspec
def inferx_model_archs(register: Register) -> None:
    """Register ModelArch classes by Hugging Face architecture name ("LlamaForCausalLM")."""


@hookspec
def inferx_checkpoint_formats(register: Register) -> None:
    """Register CheckpointFormat classes ("safetensors", "gguf", "dummy")."""


@hookspec
def inferx_attention_backends(register: Register) -> None:
    """Register AttentionBackend classes ("torch", "triton", "flashinfer")."""


@hookspec
def inferx_schedulers(register: Register) -> None:
    """Register Scheduler classes ("continuous")."""


@hookspec
def inferx_kv_managers(register: Register) -> None:
    """Register KVManager classes ("paged")."""


@hookspec
def inferx_quant_schemes(register: Register) -> None:
    """Register QuantScheme classes ("none", "fp8", ...)."""


@hookspec
def inferx_transports(register: Register) -> None:
    """Register Transport classes ("litestar")."""


@hookspec
def inferx_kernel_ops(register: Register) -> None:
    """Register KernelOps classes ("torch", "triton")."""


@hookspec
def inferx_executors(register: Register) -> None:
    """Register Executor classes built as `Cls(config, plugins)` ("torch": the plain torch
    model runner; "cuda": the CUDA runtime's)."""


@hookspec
def inferx_grammar_backends(register: Register) -> None:
    """Register GrammarBackend classes for structured output ("llguidance")."""


@hookspec
def inferx_presets(register: Register) -> None:
    """Register checkpoint presets by name ("qwen2.5-3b-instruct"): the target is a function
    `write(name, out, *, tokenizer_dir, dtype, seed) -> Path` that writes a random-weight
    checkpoint of the preset's published layout (`inferx checkpoint --preset NAME OUT`)."""
