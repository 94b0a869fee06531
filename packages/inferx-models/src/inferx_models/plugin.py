"""Registers inferx-models' architectures, checkpoint formats and presets with InferX (lazily,
by path)."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_model_archs(register: Register) -> None:
    register("LlamaForCausalLM", "inferx_models.llama:LlamaForCausalLM")
    register("Qwen2ForCausalLM", "inferx_models.llama:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "inferx_models.qwen3:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "inferx_models.qwen3:Qwen3MoeForCausalLM")
    register("GptOssForCausalLM", "inferx_models.gptoss:GptOssForCausalLM")
    register("DeepseekV2ForCausalLM", "inferx_models.deepseek_v2:DeepseekV2ForCausalLM")


@hookimpl
def inferx_checkpoint_formats(register: Register) -> None:
    register("safetensors", "inferx_models.formats:SafetensorsFormat")
    register("gguf", "inferx_models.gguf:GGUFFormat")
    register("dummy", "inferx_models.formats:DummyFormat")
    register("demo", "inferx_models.formats:DemoFormat")


@hookimpl
def inferx_presets(register: Register) -> None:
    from inferx_models.preset_configs import PRESETS

    for name in PRESETS:
        register(name, "inferx_models.presets:write_checkpoint")
