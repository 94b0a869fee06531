"""Registers the toy MoE model and the int8wo quant scheme through InferX's public hooks."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_model_archs(register: Register) -> None:
    register("ToyMoeForCausalLM", "inferx_toy_moe.model:ToyMoeForCausalLM")


@hookimpl
def inferx_quant_schemes(register: Register) -> None:
    register("int8wo", "inferx_toy_moe.quant:Int8WeightOnly")
