"""tma_fp8_gemv_kernel compiled for sm_90 without a GPU (test_fp8_tma runs this in a process of
its own, outside the interpreter): argv[1] is a JSON list of [x dtype ("fp8e4nv": e4m3 x e4m3;
"bf16": weight-only), rows, [block_n, block_k, num_warps, num_stages], gated]; or, for the fused
kernels' weight-only FP8 variants (W_SCALED, bf16 activations), ["norm", rows, [block_n,
block_k, num_warps, num_stages, select_own], gated, parts, parts in] (tma_norm_gemv_kernel) and
["reduce", rows, [block_n, block_k, num_warps, num_stages], heads, head_dim, slices, chunk]
(tma_reduce_gemv_kernel; block_k the slice's width: whole). Arguments that a launch passes
divisible by 16 (pointers, strides) are compiled as such. Prints one JSON line: [shared memory
bytes, registers, spilled bytes (sm90_mla's ptxas reading), the wgmma operand types, whether
the tiles come by TMA bulk copies] per case."""

from __future__ import annotations

import inspect
import json
import re
import sys

import triton
from sm90_mla import registers_and_spills
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda.tma_gemv import (
    tma_fp8_gemv_kernel,
    tma_norm_gemv_kernel,
    tma_reduce_gemv_kernel,
)

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


def _compile(kernel, constexprs: dict, types: dict, unaligned: set, config: list[int]):
    """kernel with these constexprs and argument types (others i32), pointers and integers not
    in `unaligned` divisible by 16."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n] != "constexpr" and not sig[n].startswith("tensordesc") and n not in unaligned
        and sig[n] != "fp32"
    }  # fmt: skip
    src = ASTSource(kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": config[2], "num_stages": config[3]}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_norm(rows: int, config: list, gated: bool, parts: int, s_in: int):
    block_n, block_k, _, _, select_own = config
    pow_rows = triton.next_power_of_2(rows)
    constexprs = dict(
        ROWS=pow_rows, BLOCK_M=max(16, pow_rows), BLOCK_N=block_n, BLOCK_K=block_k, S_IN=s_in,
        S_OUT=parts, GATED=gated, SELECT_OWN=bool(select_own), UPCAST=False,
        DOT_PRECISION="tf32", PDL=True, TRIGGER=False, LATE=False, W_SCALED=True,
    )  # fmt: skip
    types = {n: "*bf16" for n in ("parts_ptr", "residual_ptr", "norm_w_ptr", "residual_out_ptr")}
    types |= {"out_ptr": "*bf16", "w_scale_ptr": "*fp32", "eps": "fp32"}
    types["w_desc"] = f"tensordesc<fp8e4nv[{block_n}, {block_k}]>"
    unaligned = {"m", "n", "up_row", "stride_os", "stride_om"}
    return _compile(tma_norm_gemv_kernel, constexprs, types, unaligned, config)


def compile_reduce(rows: int, config: list[int], heads: int, dim: int, slices: int, chunk: int):
    block_n, block_k = config[:2]
    pow_rows = triton.next_power_of_2(rows)
    slice_heads = heads // slices
    constexprs = dict(
        ROWS=pow_rows, BLOCK_M=max(16, pow_rows), BLOCK_N=block_n, HEAD_DIM=dim,
        SLICE_HEADS=slice_heads, SPLIT_CHUNK=chunk, SEQ_SPLIT=True, TILE=64,
        WHOLE=block_k == slice_heads * dim, UPCAST=False, DOT_PRECISION="tf32", PDL=True,
        TRIGGER=False, LATE=False, W_SCALED=True,
    )  # fmt: skip
    types = {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "context_len_ptr": "*i32"}
    types |= {"out_ptr": "*bf16", "w_scale_ptr": "*fp32"}
    types["w_desc"] = f"tensordesc<fp8e4nv[{block_n}, {block_k}]>"
    unaligned = {"m", "n", "heads", "num_splits", "split_len", "stride_om"}
    return _compile(tma_reduce_gemv_kernel, constexprs, types, unaligned, config)


if __name__ == "__main__":
    out = []
    for case in json.loads(sys.argv[1]):
        if case[0] == "norm":
            kernel = compile_norm(*case[1:])
        elif case[0] == "reduce":
            kernel = compile_reduce(*case[1:])
        else:
            kernel = compile_sm90(*case)
        ptx = kernel.asm["ptx"]
        wgmma = sorted(set(re.findall(r"wgmma\.mma_async\S*\.f32\.(\w+\.\w+)", ptx)))
        bulk = "cp.async.bulk.tensor" in ptx
        out.append([kernel.metadata.shared, *registers_and_spills(kernel), wgmma, bulk])
    print(json.dumps(out))
