"""gate_up and SiLU-and-mul in one launch for 65-256 rows, tiles balanced over the SMs.

At 256 rows an unquantized gate_up is compute-bound, and cuBLAS leaves part of the H200 idle
where its tiles do not divide evenly over the 132 SMs: Llama-3.1-8B's (2 x 14,336 columns) is
224 tiles of 256 x 128, 1.7 waves, so the second wave runs on 92 SMs (~600 TFLOPS, BENCHMARKS.md
session 8). A Triton kernel with the same tiles (this one with one phase) measured level with
cuBLAS plus silu_and_mul (93.6 against 94.3 µs, session 29).

Here a program takes one tile in each of up to three phases, the tiles of a phase narrower than
the last: the first covers as many gate columns as one tile a program can, the next the same
with half-width tiles, and the last what is left in narrow tiles. For 8B at 256 rows (two row
blocks of 128): 132 tiles of 128 gate (+ 128 up) columns, 132 of 64, 104 of 32, so each SM does
1.75 wide tiles' work instead of 2. `phases_for` makes the plan; one phase of one width is the
plain one-program-a-tile kernel. Each tile loads its x rows, gate rows and up rows through TMA
(zero fill past the edges), keeps two fp32 accumulators and writes silu(gate) * up, each
rounded as silu_and_mul rounds the GEMM's output.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from inferx_kernels_cuda.fused_kernels import _rounded, silu_times

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M = 128
BLOCK_K = 64
WIDTHS = (128, 64, 32)  # gate columns a tile, by phase


@triton.jit
def _gated_tile(
    x_desc, w_desc, out_ptr, m, n, k, up_row, stride_om, m0, n0,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """out[m0:, n0:] (BLOCK_M x BLOCK_N) = silu(x @ gate.T) * (x @ up.T), gate rows n0..,
    up rows up_row + n0..; rows past m and columns past n not stored."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for col in range(0, k, BLOCK_K):
        x = x_desc.load([m0, col])
        g = w_desc.load([n0, col])
        u = w_desc.load([up_row + n0, col])
        if UPCAST:  # the interpreter's bf16 dot would round the products to bf16
            x = x.to(tl.float32)
            g = g.to(tl.float32)
            u = u.to(tl.float32)
        acc = tl.dot(x, tl.trans(g), acc, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    y = silu_times(_rounded(acc, dtype), _rounded(acc_up, dtype), dtype)
    rows = m0 + tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < m) & (cols[None, :] < n)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(dtype), mask=mask)


@triton.jit(do_not_specialize=["m"])
def tma_gated_phases_kernel(
    x_desc, w0_desc, w1_desc, w2_desc, out_ptr, m, n, k, stride_om, row_blocks,
    tiles0, tiles1, tiles2, col1, col2,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program p: tile p of each phase that has one (phase i: tiles_i tiles of BN_i gate
    columns from column col_i, row blocks fastest, so the two row blocks of a weight tile run
    side by side and the second reads it from L2). Phase 0 starts at column 0."""
    p = tl.program_id(0)
    m0 = (p % row_blocks) * BLOCK_M
    block = p // row_blocks
    if p < tiles0:
        _gated_tile(x_desc, w0_desc, out_ptr, m, n, k, n, stride_om, m0, block * BN0,
                    BLOCK_M, BN0, BLOCK_K, UPCAST, DOT_PRECISION)  # fmt: skip
    if p < tiles1:
        _gated_tile(x_desc, w1_desc, out_ptr, m, n, k, n, stride_om, m0, col1 + block * BN1,
                    BLOCK_M, BN1, BLOCK_K, UPCAST, DOT_PRECISION)  # fmt: skip
    if p < tiles2:
        _gated_tile(x_desc, w2_desc, out_ptr, m, n, k, n, stride_om, m0, col2 + block * BN2,
                    BLOCK_M, BN2, BLOCK_K, UPCAST, DOT_PRECISION)  # fmt: skip


def phases_for(
    m: int, n: int, programs: int, widths: tuple[int, ...] = WIDTHS
) -> list[tuple[int, int, int]]:
    """(width, first gate column, column blocks) of each phase for m rows and n gate columns
    when `programs` programs run at once: every phase but the last as many column blocks of
    its width as the programs take in one tile each (and no more than fit), the last phase the
    rest. With one width: the plain plan, one phase of every tile."""
    row_blocks = triton.cdiv(m, BLOCK_M)
    per_phase = max(1, programs // row_blocks)
    phases, col = [], 0
    for w in widths[:-1]:
        blocks = min(per_phase, (n - col) // w)
        if blocks:
            phases.append((w, col, blocks))
            col += blocks * w
    if col < n:
        phases.append((widths[-1], col, triton.cdiv(n - col, widths[-1])))
    return phases


def input_problem(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why tma_gated_phases cannot take these inputs, or None when it can."""
    name = "tma_gated_phases"
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return (
            f"{name}: x [M, K] and weight [N, K] must agree on K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[0] < 1 or weight.shape[0] % 2:
        return (
            f"{name}: needs at least one row and gate then up rows (an even count), got "
            f"{x.shape[0]} rows, weight {tuple(weight.shape)}"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return (
            f"{name}: x and weight must share float16, bfloat16 or float32, got "
            f"{x.dtype} and {weight.dtype}"
        )
    for arg, t in (("x", x), ("weight", weight)):  # TMA: 16-byte aligned base and rows
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return (
                f"{name}: {arg} needs a unit K stride and 16-byte aligned rows "
                f"(strides {t.stride()}, address {t.data_ptr()})"
            )
    return None


def tma_gated_phases(
    x: torch.Tensor,
    weight: torch.Tensor,
    programs: int,
    widths: tuple[int, ...] = WIDTHS,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:
    """silu(gate) * up as [M, I] for x [M, K] and weight [2I, K] (gate rows, then up rows):
    silu_and_mul(F.linear(x, weight)) in one launch, planned by phases_for(M, I, programs)
    (programs: the SMs; at most three phases)."""
    problem = input_problem(x, weight)
    if problem:
        raise ValueError(problem)
    m, k = x.shape
    n = weight.shape[0] // 2
    phases = phases_for(m, n, programs, widths)
    if len(phases) > 3:
        raise ValueError(f"tma_gated_phases: at most three phases, planned {phases}")
    row_blocks = triton.cdiv(m, BLOCK_M)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, block_shape=[BLOCK_M, BLOCK_K])
    plan = phases + [(phases[-1][0], 0, 0)] * (3 - len(phases))  # absent phases: no tiles
    descs = [TensorDescriptor.from_tensor(weight, block_shape=[w, BLOCK_K]) for w, _, _ in plan]
    tiles = [blocks * row_blocks for _, _, blocks in plan]
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    tma_gated_phases_kernel[(max(tiles),)](
        x_desc, *descs, out, m, n, k, out.stride(0), row_blocks, *tiles, plan[1][1], plan[2][1],
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BN0=plan[0][0], BN1=plan[1][0], BN2=plan[2][0],
        UPCAST=interpret and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
