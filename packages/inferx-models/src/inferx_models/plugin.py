"""Registers inferx-models' architectures and checkpoint formats with InferX (lazily, by path)."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_model_archs(register: Register) -> None:
    register("LlamaForCausalLM", "inferx_models.llama:LlamaForCausalLM")
    register("Qwen2ForCausalLM", "inferx_models.llama:Qwen2ForCausalLM")


@hookimpl
def inferx_checkpoint_formats(register: Register) -> None:
    register("safetensors", "inferx_models.formats:SafetensorsFormat")
    register("gguf", "inferx_models.gguf:GGUFFormat")
    register("dummy", "inferx_models.formats:DummyFormat")
    register("demo", "inferx_models.formats:DemoFormat")
