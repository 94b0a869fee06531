"""InferX's own defaults, registered through the same hooks as any third-party plugin."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_schedulers(register: Register) -> None:
    register("continuous", "inferx_core.scheduler:ContinuousScheduler")


@hookimpl
def inferx_kv_managers(register: Register) -> None:
    register("paged", "inferx_core.kv_manager:PagedKVManager")


@hookimpl
def inferx_attention_backends(register: Register) -> None:
    register("torch", "inferx_core.attention_torch:TorchAttention")


@hookimpl
def inferx_quant_schemes(register: Register) -> None:
    register("none", "inferx_core.quant_none:Unquantized")


@hookimpl
def inferx_kernel_ops(register: Register) -> None:
    register("torch", "inferx_core.ops_torch:TorchOps")


@hookimpl
def inferx_executors(register: Register) -> None:
    register("torch", "inferx_core.executor:ModelRunner")
