"""Registers the Triton attention backend and kernel ops (lazily: listing imports no Triton)."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_attention_backends(register: Register) -> None:
    register("triton", "inferx_kernels_cuda.triton_attention:TritonAttention")


@hookimpl
def inferx_kernel_ops(register: Register) -> None:
    register("triton", "inferx_kernels_cuda.ops:TritonOps")
