"""moe_tma_gemv_kernel compiled for sm_90 without a GPU (test_moe_tma_gemv runs this in a process
of its own, outside the interpreter): at the tiles tma_configs picks for DeepSeek-V2-Lite's
(shared experts as slots), Qwen3-30B-A3B's and gpt-oss-20b's bf16 shapes, one token (a tile per
pair) and four (grouped), gate_up and down; down also split along K and with atomics; fp16
once. Arguments that a launch passes divisible by 16 (pointers, strides, sizes) are
compiled as such. Prints one JSON line: [label, shared memory bytes, registers, spilled bytes
(sm90_mla's ptxas reading), the wgmma operand types, whether the weight comes by TMA bulk
copies] per case.

`python sm90_moe_tma.py mxfp4` compiles moe_gemv_tma_kernel instead (MXFP4's GEMV, its weight
words by TMA; test_moe_mxfp4_tma runs it): at gemm_configs(gemv_tma=True)'s tiles for
gpt-oss-20b's one token (gate_up, down; down split and atomic; fp16 activations) and for
SiLU experts (gate and up rows as two tiles). One JSON line: [label, shared memory bytes,
registers, spilled bytes, whether the words come by TMA bulk copies, the bytes of one stage's
weight tiles] per case.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path

import triton
from sm90_mla import registers_and_spills
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inferx_kernels_cuda import moe_kernels as mk

UNALIGNED = {"num_pairs", "up_offset", "alpha", "limit"}
# (hidden, intermediate, experts with shared slots, pairs a token, activation)
SHAPES = {
    "deepseek-v2-lite": (2048, 1408, 66, 8, "silu"),
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu"),
    "gpt-oss-20b-bf16": (2880, 2880, 32, 4, "swiglu_oai"),
}


def compile_sm90(dtype: str, cfg: mk.GemmConfig, gated: bool, silu: bool, per_pair: bool,
                 out: str, atomic: bool):  # fmt: skip
    interleaved = gated and not silu
    constexprs = dict(
        A_ROW_DIV=8 if gated else 1,
        ACT=(mk.ACT_SILU if silu else mk.ACT_SWIGLU_OAI) if gated else mk.ACT_NONE,
        GATE_STRIDE=2 if interleaved else 1, HAS_BIAS=not silu, WEIGHTED=not gated,
        ATOMIC_K=8 if atomic else 0, PER_PAIR=per_pair, DOT_FP32=False,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=1 if gated else cfg.split_k,
    )  # fmt: skip
    rows = 2 * cfg.block_n if interleaved else cfg.block_n
    ids = "*i64" if per_pair else "*i32"
    types = {"a_ptr": f"*{dtype}", "w_desc": f"tensordesc<{dtype}[{rows}, {cfg.block_k}]>"}
    types |= {"bias_ptr": f"*{dtype}", "topk_w_ptr": "*fp32", "out_ptr": f"*{out}"}
    types |= {"sorted_ptr": ids, "block_expert_ptr": ids, "num_padded_ptr": ids}
    types |= {"alpha": "fp32", "limit": "fp32"}
    names = list(inspect.signature(mk.moe_tma_gemv_kernel.fn).parameters)
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if n not in constexprs and n not in UNALIGNED and not sig[n].startswith("tensordesc")
    }
    src = ASTSource(mk.moe_tma_gemv_kernel, sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cases():
    """(label, compile_sm90's arguments) of each compile."""
    for name, (hidden, inter, experts, k, act) in SHAPES.items():
        silu = act == "silu"
        for tokens in (1, 4):
            configs = mk.tma_configs(tokens * k, experts, inter, hidden, 132)
            per_pair = tokens <= mk.PER_PAIR_MAX_TOKENS
            for gated, cfg in zip((True, False), configs, strict=True):
                label = f"{name} {tokens} {'gate_up' if gated else 'down'}"
                yield label, ("bf16", cfg, gated, silu, per_pair, "bf16", False)
        down = mk.tma_configs(k, experts, inter, hidden, 132)[1]
        split = dataclasses.replace(down, split_k=2)
        yield f"{name} 1 down split", ("bf16", split, False, silu, True, "fp32", False)
        yield f"{name} 1 down atomic", ("bf16", down, False, silu, True, "fp32", True)
    hidden, inter, experts, k, _ = SHAPES["deepseek-v2-lite"]
    configs = mk.tma_configs(k, experts, inter, hidden, 132)
    for gated, cfg in zip((True, False), configs, strict=True):
        label = f"deepseek-v2-lite fp16 1 {'gate_up' if gated else 'down'}"
        yield label, ("fp16", cfg, gated, True, True, "fp16", False)


def mxfp4_cases():
    """(label, kernel_sass.compile_sm90's arguments, one stage's weight tile bytes) of each
    compile of moe_gemv_tma_kernel."""
    cfgs = mk.gemm_configs(4, 32, 2880, 2880, "mxfp4", 132, gemv=True, gemv_tma=True)
    silu = mk.gemm_configs(8, 128, 768, 2048, "mxfp4", 132, gemv=True, gemv_tma=True)
    types = {"a_ptr": "*bf16", "scale_ptr": "*u8", "bias_ptr": "*bf16", "topk_w_ptr": "*fp32"}
    types |= {"ids_ptr": "*i64", "out_ptr": "*bf16", "alpha": "fp32", "limit": "fp32"}
    for label, cfg, gated, swiglu, act, extra in (
        ("gpt-oss-20b 1 gate_up", cfgs[0], True, True, "bf16", {}),
        ("gpt-oss-20b 1 down", cfgs[1], False, True, "bf16", {}),
        ("gpt-oss-20b 1 down split", cfgs[1], False, True, "bf16", {"SPLIT_K": 2}),
        ("gpt-oss-20b 1 down atomic", cfgs[1], False, True, "bf16", {"ATOMIC_K": 4}),
        ("gpt-oss-20b fp16 1 gate_up", cfgs[0], True, True, "fp16", {}),
        ("gpt-oss-20b fp16 1 down", cfgs[1], False, True, "fp16", {}),
        ("silu 1 gate_up", silu[0], True, False, "bf16", {}),
    ):
        rows = 2 * cfg.block_n if gated and swiglu else cfg.block_n
        constexprs = dict(
            A_ROW_DIV=4 if gated else 1,
            ACT=(mk.ACT_SWIGLU_OAI if swiglu else mk.ACT_SILU) if gated else mk.ACT_NONE,
            GATE_STRIDE=2 if gated and swiglu else 1, HAS_BIAS=swiglu, WEIGHTED=not gated,
            ATOMIC_K=0, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages,
            A_PAIRS=act == "bf16",
        ) | extra  # fmt: skip
        out = "fp32" if extra else act
        arg_types = types | {"a_ptr": f"*{act}", "bias_ptr": f"*{act}", "out_ptr": f"*{out}"}
        arg_types["w_desc"] = f"tensordesc<i32[1, {rows}, {cfg.block_k // 8}]>"
        args = (mk.moe_gemv_tma_kernel, arg_types, constexprs, cfg.num_warps, cfg.num_stages)
        yield label, args, rows * cfg.block_k // 2 * (2 if gated and not swiglu else 1)


if __name__ == "__main__" and sys.argv[1:] == ["mxfp4"]:
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from kernel_sass import compile_sm90 as compile_kernel

    result = []
    for label, args, tile_bytes in mxfp4_cases():
        kernel = compile_kernel(*args)
        bulk = "cp.async.bulk.tensor" in kernel.asm["ptx"]
        spills = registers_and_spills(kernel)
        result.append([label, kernel.metadata.shared, *spills, bulk, tile_bytes])
    print(json.dumps(result))
elif __name__ == "__main__":
    result = []
    for label, args in cases():
        kernel = compile_sm90(*args)
        ptx = kernel.asm["ptx"]
        wgmma = sorted(set(re.findall(r"wgmma\.mma_async\S*\.f32\.(\w+\.\w+)", ptx)))
        bulk = "cp.async.bulk.tensor" in ptx
        result.append([label, kernel.metadata.shared, *registers_and_spills(kernel), wgmma, bulk])
    print(json.dumps(result))
