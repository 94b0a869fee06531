"""Registers the Triton and FlashInfer attention backends, the Triton kernel ops and the CUDA
runtime's executor (lazily: listing them imports neither Triton nor FlashInfer)."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_attention_backends(register: Register) -> None:
    register("triton", "inferx_kernels_cuda.triton_attention:TritonAttention")
    # FlashInfer is an optional extra (inferx-kernels-cuda[flashinfer]); the backend imports it
    # only when it is built, and says how to install it when it is missing.
    register("flashinfer", "inferx_kernels_cuda.flashinfer_attention:FlashInferAttention")


@hookimpl
def inferx_kernel_ops(register: Register) -> None:
    register("triton", "inferx_kernels_cuda.ops:TritonOps")


@hookimpl
def inferx_executors(register: Register) -> None:
    register("cuda", "inferx_kernels_cuda.runtime:CudaModelRunner")
