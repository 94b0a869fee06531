"""moe_tma_gemv_kernel compiled for sm_90 without a GPU (test_moe_tma_gemv runs this in a process
of its own, outside the interpreter): at the tiles tma_configs picks for DeepSeek-V2-Lite's
(shared experts as slots), Qwen3-30B-A3B's and gpt-oss-20b's bf16 shapes, one token (a tile per
pair) and four (grouped), gate_up and down; down also split along K and with atomics; fp16
once. Arguments that a launch passes divisible by 16 (pointers, strides, sizes) are
compiled as such. Prints one JSON line: [label, shared memory bytes, registers, spilled bytes
(sm90_mla's ptxas reading), the wgmma operand types, whether the weight comes by TMA bulk
copies] per case."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re

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


if __name__ == "__main__":
    result = []
    for label, args in cases():
        kernel = compile_sm90(*args)
        ptx = kernel.asm["ptx"]
        wgmma = sorted(set(re.findall(r"wgmma\.mma_async\S*\.f32\.(\w+\.\w+)", ptx)))
        bulk = "cp.async.bulk.tensor" in ptx
        result.append([label, kernel.metadata.shared, *registers_and_spills(kernel), wgmma, bulk])
    print(json.dumps(result))
