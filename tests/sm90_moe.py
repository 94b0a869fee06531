"""The fused-MoE kernels compiled for sm_90 without a GPU (test_fused_moe runs this in a process
of its own, outside the interpreter): every kernel of moe_kernels at the tiles gemm_configs picks
for gpt-oss-20b's and Qwen3-30B-A3B's shapes, decode and prefill, each weight format. Arguments
that a launch passes divisible by 16 (pointers, strides, sizes) are compiled as such, as
Triton's specialisation would, so the loads pipeline as they will on the GPU. Prints one JSON
line: [name, shared memory bytes, whether the loads went through cp.async, whether ptxas
serialized its wgmma (C7515: a wait after each)] per kernel.
benchmarks/kernel_sass.py compiles them (its UNALIGNED: the arguments not divisible by 16)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from kernel_sass import compile_sm90  # noqa: E402
from sm90_mla import wgmma_serialized  # noqa: E402

from inferx_kernels_cuda import moe_kernels as mk  # noqa: E402

GEMV_SHARED = ("A_ROW_DIV", "ACT", "GATE_STRIDE", "MXFP4", "ROW_SCALE", "HAS_BIAS", "WEIGHTED")
GEMV_SHARED += ("ATOMIC_K", "W4", "HAS_ZEROS", "HAS_PERM", "ROW_GROUP")
W4A16_GROUP = 128  # Qwen3-30B-A3B-GPTQ-Int4's


def gemm_types(fmt: str, per_pair: bool) -> dict[str, str]:
    w4 = fmt.startswith("w4a16")
    weight = {"dense": "*bf16", "mxfp4": "*u8", "fp8": "*fp8e4nv", "fp8-block": "*fp8e4nv"}
    scale = {"dense": "*bf16", "mxfp4": "*u8", "fp8": "*fp32", "fp8-block": "*fp32"}
    types = {"a_ptr": "*bf16", "bias_ptr": "*bf16"}
    types |= {"w_ptr": "*i32", "scale_ptr": "*fp16"} if w4 else {}
    types |= {} if w4 else {"w_ptr": weight[fmt], "scale_ptr": scale[fmt]}
    types |= {"zero_ptr": "*u8", "perm_ptr": "*i32", "rg_ptr": "*i32"}
    types |= {"topk_w_ptr": "*fp32", "out_ptr": "*bf16", "stride_we": "i64"}
    types |= {n: "*i32" for n in ("sorted_ptr", "block_expert_ptr", "num_padded_ptr")}
    if per_pair:  # all three are topk_ids then
        types |= {n: "*i64" for n in ("sorted_ptr", "block_expert_ptr", "num_padded_ptr")}
    return types | {"alpha": "fp32", "limit": "fp32"}


def cases():
    """(label, kernel, argument types, constexprs, num_warps, num_stages) of each compile."""
    ids = {"ids_ptr": "*i64", "starts_ptr": "*i32", "sorted_ptr": "*i32", "rank_ptr": "*i32"}
    ids |= {"block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "chunk_counts_ptr": "*i32"}
    ids |= {"chunk_first_ptr": "*i32"}
    logits = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64", "scaling": "fp32"}
    for experts, k in ((32, 4), (128, 8)):
        block_e = triton.next_power_of_2(experts)
        chunk = mk.ALIGN_CHUNK_ENTRIES // block_e
        top = dict(TOP_K=k, SHARED=0, K_PAD=k, SOFTMAX_ALL=False, BLOCK_T=16, BLOCK_E=block_e)
        top["PARTS"] = 4
        plan = dict(BLOCK_M=16, BLOCK_E=block_e, BLOCK_B=8192 // block_e)
        per_chunk = dict(CHUNK=chunk, BLOCK_E=block_e)
        yield f"topk_softmax E{experts}", mk.topk_softmax_kernel, logits, top, 4, 1
        yield f"align_one E{experts}", mk.align_one_kernel, ids, plan | {"CHUNK": chunk}, 4, 1
        yield f"align_count E{experts}", mk.align_count_kernel, ids, per_chunk, 4, 1
        yield f"align_plan E{experts}", mk.align_plan_kernel, ids, plan | {"BLOCK_C": chunk}, 8, 1
        yield f"align_scatter E{experts}", mk.align_scatter_kernel, ids, per_chunk, 4, 1
    # DeepSeek-V2-Lite's routing with its 2 shared experts appended (6 + 2 a row)
    lite = dict(TOP_K=6, SHARED=2, K_PAD=8, SOFTMAX_ALL=True, BLOCK_T=16, BLOCK_E=64, PARTS=4)
    yield "topk_softmax E64 shared", mk.topk_softmax_kernel, logits, lite, 4, 1
    sums = {"y_ptr": "*bf16", "out_ptr": "*bf16"}
    yield "moe_sum", mk.moe_sum_kernel, sums, dict(TOP_K=8, BLOCK=1024), 4, 1
    splits = sums | {"y_ptr": "*fp32"}
    yield "moe_sum splits", mk.moe_sum_kernel, splits, dict(TOP_K=4, BLOCK=1024, SPLITS=3), 4, 1
    shapes = {"gpt-oss-20b": (2880, 2880, 32, 4, False), "qwen3": (2048, 768, 128, 8, True)}
    for name, (hidden, inter, experts, k, silu) in shapes.items():
        # W4A16 (GPTQ / AWQ) at Qwen3-30B-A3B's: symmetric, and with zero points and act-order;
        # act-order over ranks ("-tp": down's scales by row, ROW_GROUP)
        w4_formats = ("w4a16", "w4a16-zeros-act-order", "w4a16-act-order-tp") if silu else ()
        for fmt in ("dense", "mxfp4", "fp8", "fp8-block", *w4_formats):
            # gpt-oss's MXFP4 at a 256-token step too: swapped, as fused_experts runs it
            steps = (1, 8, 256, 2048) if fmt == "mxfp4" and not silu else (1, 8, 2048)
            for tokens in steps:
                layout = "w4a16" if fmt.startswith("w4a16") else fmt
                configs = mk.gemm_configs(tokens * k, experts, inter, hidden, layout, 132)
                gemv_configs = mk.gemm_configs(
                    tokens * k, experts, inter, hidden, layout, 132, True
                )
                for gated, cfg, gemv_cfg in zip((True, False), configs, gemv_configs, strict=True):
                    k_in = hidden if gated else inter
                    row_group = fmt.endswith("-tp") and not gated
                    w4 = dict(
                        W4=fmt.startswith("w4a16"), HAS_ZEROS=fmt.endswith("zeros-act-order"),
                        HAS_PERM="act-order" in fmt, ROW_GROUP=row_group,
                    )  # fmt: skip
                    group = k_in if row_group else W4A16_GROUP
                    block_k = cfg.block_k
                    if w4["W4"]:  # as fused_experts lowers it
                        block_k = mk._w4_block_k(block_k, group, k_in)
                    constexprs = dict(
                        A_ROW_DIV=k if gated else 1,
                        ACT=(mk.ACT_SILU if silu else mk.ACT_SWIGLU_OAI) if gated else 0,
                        GATE_STRIDE=2 if gated and not silu else 1,
                        MXFP4=fmt == "mxfp4", ROW_SCALE=fmt == "fp8", K_SCALE=fmt == "fp8-block",
                        HAS_BIAS=not silu,
                        WEIGHTED=not gated, ATOMIC_K=0, DOT_FP32=False, BLOCK_M=cfg.block_m,
                        PER_PAIR=tokens <= mk.PER_PAIR_MAX_TOKENS,
                        BLOCK_N=cfg.block_n, BLOCK_K=block_k, BF16_BITS=True, **w4,
                        EVEN_K=k_in % block_k == 0,
                    )  # fmt: skip
                    label = f"{name} {fmt} {tokens} {'gate_up' if gated else 'down'}"
                    kernel = mk.moe_gemm_kernel
                    types = gemm_types(fmt, constexprs["PER_PAIR"])
                    yield label, kernel, types, constexprs, cfg.num_warps, cfg.num_stages
                    if fmt == "mxfp4" and tokens >= 256 and not silu:  # swapped operands
                        swapped = constexprs | {"SWAP_AB": True}
                        yield f"{label} swap_ab", kernel, types, swapped, cfg.num_warps, 3
                    if tokens <= mk.GEMV_MAX_TOKENS and fmt != "fp8-block":
                        gemv = {n: constexprs[n] for n in GEMV_SHARED} | dict(
                            BLOCK_N=gemv_cfg.block_n,
                            BLOCK_K=mk._w4_block_k(gemv_cfg.block_k, group, k_in)
                            if w4["W4"]
                            else gemv_cfg.block_k,
                            A_PAIRS=fmt == "mxfp4",  # bf16 rows, as fused_experts reads them
                        )
                        if fmt == "mxfp4":  # a thread's columns, as fused_experts passes them
                            gemv["ROWS"] = mk.gemv_rows(
                                gemv_cfg.block_n, gemv_cfg.block_k, gemv_cfg.num_warps
                            )
                        types = gemm_types(fmt, True) | {"ids_ptr": "*i64"}
                        warps = gemv_cfg.num_warps
                        yield f"{label} gemv", mk.moe_gemv_kernel, types, gemv, warps, 1
                        if fmt == "mxfp4" and not gated:  # down's K in runs (split_k)
                            split = gemv | {"SPLIT_K": 3}
                            f32 = types | {"out_ptr": "*fp32"}
                            yield f"{label} gemv split", mk.moe_gemv_kernel, f32, split, warps, 1


if __name__ == "__main__":
    out = []
    for label, kernel, types, constexprs, warps, stages in cases():
        compiled = compile_sm90(kernel, types, constexprs, warps, stages)
        ptx = compiled.asm["ptx"]
        out.append([label, compiled.metadata.shared, "cp.async" in ptx, wgmma_serialized(compiled)])
    print(json.dumps(out))
