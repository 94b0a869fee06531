"""Registers this package's attention backends; targets are lazy, so listing imports no Triton."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_attention_backends(register: Register) -> None:
    register("triton", "inferx_kernels_cuda.triton_attention:TritonAttention")
