"""Shared memory of tma_gemv_kernel compiled for sm_90, without a GPU (test_tma_gemv runs this
in a process of its own, outside the interpreter): argv[1] is a JSON list of [dtype ("bf16" or
"fp32"), rows, [block_n, block_k, num_warps, num_stages], gated]; prints the bytes of each."""

from __future__ import annotations

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda.tma_gemv import tma_gemv_kernel


def shared_bytes(dtype: str, rows: int, config: list[int], gated: bool) -> int:
    block_n, block_k, num_warps, num_stages = config
    block_m = max(16, triton.next_power_of_2(rows))
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, UPCAST=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32", PDL=False, TRIGGER=False,
        HAS_BIAS=False,
    )  # fmt: skip
    descs = {"x_desc": (block_m, block_k), "w_desc": (block_n, block_k)}
    sig = {}
    for name in inspect.signature(tma_gemv_kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = f"tensordesc<{dtype}[{descs[name][0]}, {descs[name][1]}]>"
        else:
            sig[name] = f"*{dtype}" if name == "out_ptr" else "i32"
    at = {name: (i,) for i, name in enumerate(sig)}
    src = ASTSource(tma_gemv_kernel, sig, constexprs={at[n]: v for n, v in constexprs.items()})
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared


if __name__ == "__main__":
    print(json.dumps([shared_bytes(*case) for case in json.loads(sys.argv[1])]))
