"""Registers inferx-quant's quantization schemes with InferX (lazily, by path)."""

from inferx_core.hookspecs import Register, hookimpl


@hookimpl
def inferx_quant_schemes(register: Register) -> None:
    register("fp8", "inferx_quant.fp8:Fp8")
    register("mxfp4", "inferx_quant.mxfp4:Mxfp4")
    register("gptq", "inferx_quant.w4a16:Gptq")
    register("awq", "inferx_quant.w4a16:Awq")
