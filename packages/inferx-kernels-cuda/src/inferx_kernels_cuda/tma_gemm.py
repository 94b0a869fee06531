"""A GEMM for more rows than the decode GEMVs (tma_gemv) take: both operands through TMA.

At 128-256 rows (the decode batches of a full server) an unquantized GEMM is compute-bound and
cuBLAS leaves the H200's SMs part idle where its tiles do not divide evenly over them: 8B's
gate_up at 256 rows is 224 tiles of 256 x 128 on 132 SMs (~600 TFLOPS, BENCHMARKS.md session
8), and o_proj / down_proj (N = 4096) have 32-64 such tiles. tma_gemm takes the same product
with three knobs cuBLAS has not got here:

- K-slices: [S, M, N] partial products (QuantLinear.forward_parts' form) whose sum the fused
  add + RMSNorm after o_proj / down_proj already does, so more programs share the SMs at no
  reduce cost;
- GATED: gate_up with SiLU-and-mul in its epilogue (as tma_linear_silu_and_mul at decode
  sizes), which saves writing the [M, 2I] product and reading it back;
- a persistent grid (one program an SM looping over tiles, `flatten` pipelining the next
  tile's loads under this one's epilogue) or one program a tile.

Tiles are visited GROUP_M row blocks at a time along each column block, so the weight tile a
group shares comes from L2 after its first read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from inferx_kernels_cuda.fused_kernels import _rounded, silu_times

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class TmaGemmConfig:
    """Tile (rows of x, weight rows, K columns), row blocks a group, warps, pipeline depth, and
    the programs of a persistent grid (0: one program a tile)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    programs: int = 0
    flatten: bool = True

    def __str__(self) -> str:
        grid = f" p{self.programs}{'f' if self.flatten else ''}" if self.programs else ""
        return (
            f"{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m} w{self.num_warps} "
            f"st{self.num_stages}{grid}"
        )


@triton.jit
def _tile_of(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of a tile number, GROUP_M row blocks down each column block."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % size_m, (tile % per_group) // size_m


@triton.jit(do_not_specialize=["m"])
def tma_gemm_kernel(
    x_desc,
    w_desc,
    out_ptr,
    m,
    n,
    k_per_split,
    up_row,
    units,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    FLATTEN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Units are (split, tile) pairs, split slowest; program p takes units p, p + programs, ...
    For each: out[s, rows, cols] = x[rows, ks] @ W[cols, ks].T over split s's k_per_split
    columns (a multiple of BLOCK_K; past K the descriptors read zeros). GATED (one split): W
    holds gate rows, then up rows from up_row; out [m, n] = silu(gate) * up, rounded as
    silu_and_mul rounds the GEMM's output."""
    num_m = tl.cdiv(m, BLOCK_M)
    num_n = tl.cdiv(n, BLOCK_N)
    tiles = num_m * num_n
    programs = tl.num_programs(0)
    k_steps = k_per_split // BLOCK_K
    dtype = out_ptr.dtype.element_ty
    for unit in tl.range(tl.program_id(0), units, programs, flatten=FLATTEN):
        split = unit // tiles
        pid_m, pid_n = _tile_of(unit % tiles, num_m, num_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        k0 = split * k_per_split
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for ki in range(k_steps):
            col = k0 + ki * BLOCK_K
            x = x_desc.load([m0, col])
            w = w_desc.load([n0, col])
            if UPCAST:  # the interpreter's bf16 dot would round the products to bf16
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
            if GATED:
                wu = w_desc.load([up_row + n0, col])
                if UPCAST:
                    wu = wu.to(tl.float32)
                acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PRECISION)
        if GATED:
            acc = silu_times(_rounded(acc, dtype), _rounded(acc_up, dtype), dtype)
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        out = out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(dtype), mask=(rows[:, None] < m) & (cols[None, :] < n))


def input_problem(x: torch.Tensor, weight: torch.Tensor, parts: int, name: str) -> str | None:
    """Why `name` cannot take these inputs, or None when it can."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return (
            f"{name}: x [M, K] and weight [N, K] must agree on K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[0] < 1 or parts < 1:
        return f"{name}: needs at least one row and parts >= 1, got {x.shape[0]}, {parts}"
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


def tma_gemm(
    x: torch.Tensor, weight: torch.Tensor, parts: int = 1, config: TmaGemmConfig | None = None
) -> torch.Tensor:
    """[parts, M, N] partial products of x [M, K] and weight [N, K] over equal slices of K
    (their sum is F.linear(x, weight) up to rounding), in x's dtype."""
    return _launch(x, weight, parts, False, config or TmaGemmConfig())


def tma_gemm_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, config: TmaGemmConfig | None = None
) -> torch.Tensor:
    """silu(gate) * up as [M, I] for x [M, K] and weight [2I, K] (gate rows, then up rows):
    silu_and_mul(F.linear(x, weight)) in one launch."""
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(
            f"tma_gemm_silu_and_mul: weight needs gate then up rows (an even count), got "
            f"{weight.shape[0]}"
        )
    return _launch(x, weight, 1, True, config or TmaGemmConfig())


def _launch(
    x: torch.Tensor, weight: torch.Tensor, parts: int, gated: bool, cfg: TmaGemmConfig
) -> torch.Tensor:
    name = "tma_gemm_silu_and_mul" if gated else "tma_gemm"
    problem = input_problem(x, weight, parts, name)
    if problem:
        raise ValueError(problem)
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    k_per_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    out = torch.empty((m, n) if gated else (parts, m, n), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, block_shape=[cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[cfg.block_n, cfg.block_k])
    units = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * parts
    programs = min(units, cfg.programs) if cfg.programs else units
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    tma_gemm_kernel[(programs,)](
        x_desc, w_desc, out, m, n, k_per_split, n, units, 0 if gated else out.stride(0),
        out.stride(-2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        GATED=gated, FLATTEN=cfg.flatten and cfg.programs > 0,
        UPCAST=interpret and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
