"""Registers the toy model and attention backend through InferX's public hooks."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_model_archs(register: Register) -> None:
    register("ToyForCausalLM", "inferx_toy.model:ToyForCausalLM")


@hookimpl
def inferx_attention_backends(register: Register) -> None:
    register("toy", "inferx_toy.model:CountingAttention")
