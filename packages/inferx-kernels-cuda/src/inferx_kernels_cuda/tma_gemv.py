"""A decode GEMM that reads its weight through Hopper's tensor memory accelerator (TMA).

Session 12 (BENCHMARKS.md) found the limit of the Triton GEMVs here: with pointer loads,
Triton pipelines the weight through cp.async, every thread issuing its share of each tile, and
the tiles of a small-M product came in at 3.1-3.7 TB/s where cuBLAS (TMA and warp-specialised
loads) reads at 3.4-4.1. Every fusion that needs our own GEMV (the MLP in one launch, the norm
folded in) lost that way. `tma_linear_parts` is the same product with the weight and x read
through tensor descriptors: one thread issues each tile's bulk copy, the hardware zero-fills
what lies past the tensor's edges (no masks), and Triton pipelines the copies num_stages deep.
The model runs it only under INFERX_TMA_GEMV=1 (TritonOps.linear_parts / linear_split /
linear_silu_and_mul), until benchmarks/bench_tma_gemv.py and an A/B in the model have timed it
against cuBLAS on the H200.

The output is QuantLinear.forward_parts' form, [S, M, N] partial products over S equal slices
of K, each rounded to x's dtype (S = 1: F.linear without bias). A program owns BLOCK_N weight
rows of one slice; x is padded to BLOCK_M >= 16 rows for the tensor cores by the descriptor's
zero fill, so no padding is read from memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

MAX_ROWS = 64
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TmaGemvConfig:
    """Weight rows and K columns per tile, warps and Triton's pipeline depth."""

    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4

    def __str__(self) -> str:
        return f"n{self.block_n} k{self.block_k} w{self.num_warps} st{self.num_stages}"


@triton.jit
def tma_gemv_kernel(
    x_desc,
    w_desc,
    out_ptr,
    m,
    n,
    k_per_split,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (row blocks, splits): out[s, :, rows] = x[:, ks] @ W[rows, ks].T, ks = split s's
    k_per_split columns (a multiple of BLOCK_K; the last split's run past K reads zeros)."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_s * k_per_split
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        w = w_desc.load([n0, k0 + kk])  # [BLOCK_N, BLOCK_K]
        x = x_desc.load([0, k0 + kk])  # [BLOCK_M, BLOCK_K], rows past m zero
        if UPCAST:  # the interpreter's bf16 dot would round the products to bf16
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    rows = n0 + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_M)
    out = out_ptr + pid_s * stride_os + cols[None, :] * stride_om + rows[:, None]
    mask = (rows[:, None] < n) & (cols[None, :] < m)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def input_problem(x: torch.Tensor, weight: torch.Tensor, parts: int = 1) -> str | None:
    """Why tma_linear_parts cannot take these inputs, or None when it can."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return (
            f"tma_linear_parts: x [M, K] and weight [N, K] must agree on K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS or parts < 1:
        return (
            f"tma_linear_parts: takes 1 to {MAX_ROWS} rows and parts >= 1, got {x.shape[0]}, "
            f"{parts}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return (
            "tma_linear_parts: x and weight must share float16, bfloat16 or float32, got "
            f"{x.dtype} and {weight.dtype}"
        )
    # TMA: 16-byte aligned base and row strides, unit stride along K.
    for name, t in (("x", x), ("weight", weight)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return (
                f"tma_linear_parts: {name} needs a unit K stride and 16-byte aligned rows "
                f"(strides {t.stride()}, address {t.data_ptr()})"
            )
    return None


def tma_linear_parts(
    x: torch.Tensor, weight: torch.Tensor, parts: int = 1, config: TmaGemvConfig | None = None
) -> torch.Tensor:
    """[parts, M, N] partial products of x [M <= MAX_ROWS, K] and weight [N, K] over equal
    slices of K (their sum is F.linear(x, weight) up to rounding), in x's dtype."""
    cfg = config or TmaGemvConfig()
    problem = input_problem(x, weight, parts)
    if problem:
        raise ValueError(problem)
    m, k = x.shape
    n = weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    out = torch.empty((parts, m, n), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, block_shape=[block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[cfg.block_n, cfg.block_k])
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    tma_gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x_desc, w_desc, out, m, n, k_per_split, out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        UPCAST=interpret and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
