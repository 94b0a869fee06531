"""tma_fp8_gemv_kernel compiled for sm_90 without a GPU (test_fp8_tma runs this in a process of
its own, outside the interpreter): argv[1] is a JSON list of [x dtype ("fp8e4nv": e4m3 x e4m3;
"bf16": weight-only), rows, [block_n, block_k, num_warps, num_stages], gated]. Arguments that a
launch passes divisible by 16 (pointers, strides) are compiled as such. Prints one JSON line:
[shared memory bytes, registers, spilled bytes (sm90_mla's ptxas reading), the wgmma
operand types, whether the tiles come by TMA bulk copies, whether ptxas serialized the wgmma]
per case."""

from __future__ import annotations

import inspect
import json
import re
import sys

import triton
from sm90_mla import registers_and_spills, wgmma_serialized
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda.tma_gemv import tma_fp8_gemv_kernel

UNALIGNED = {"m", "n", "k_per_split", "up_row", "stride_xs", "stride_om"}


def compile_sm90(x_dtype: str, rows: int, config: list[int], gated: bool):
    block_n, block_k, num_warps, num_stages = config
    block_m = max(16, triton.next_power_of_2(rows))
    scaled = x_dtype == "fp8e4nv"
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, X_SCALED=scaled,
        HAS_BIAS=True, UPCAST=False, PDL=True, TRIGGER=False, LATE=False,
    )  # fmt: skip
    descs = {
        "x_desc": f"tensordesc<{x_dtype}[{block_m}, {block_k}]>",
        "w_desc": f"tensordesc<fp8e4nv[{block_n}, {block_k}]>",
    }
    ptrs = {"x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16"}
    ptrs["out_ptr"] = "*bf16"
    names = list(inspect.signature(tma_fp8_gemv_kernel.fn).parameters)
    sig = {}
    for name in names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = descs.get(name) or ptrs.get(name) or "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if name not in constexprs and name not in descs and name not in UNALIGNED
    }
    src = ASTSource(tma_fp8_gemv_kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


if __name__ == "__main__":
    out = []
    for case in json.loads(sys.argv[1]):
        kernel = compile_sm90(*case)
        ptx = kernel.asm["ptx"]
        wgmma = sorted(set(re.findall(r"wgmma\.mma_async\S*\.f32\.(\w+\.\w+)", ptx)))
        bulk = "cp.async.bulk.tensor" in ptx
        serialized = wgmma_serialized(kernel)
        out.append([kernel.metadata.shared, *registers_and_spills(kernel), wgmma, bulk, serialized])
    print(json.dumps(out))
