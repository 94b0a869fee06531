"""RMSNorm and SiLU-and-mul that write their output as e4m3 with its scales, for the FP8 linear
layer after them: one launch instead of the op and fp8_gemm.quantize_rows.

Each kernel computes its op exactly as fused_kernels' does (the output rounded to the
activations' dtype where the unfused op stores it), then quantizes those values as
quantize_rows does: per token (absmax / 448, at least 1 / (448 * 512)), per token per GROUP
columns, or by a static scale. So the e4m3 bytes and scales equal the unfused pair's bit for
bit (and the torch reference's, inferx_core.quant_utils.quantize_e4m3, wherever the op itself
agrees with torch's to the bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferx_kernels_cuda.fp8_gemm import FP8, _to_e4m3
from inferx_kernels_cuda.fused_kernels import _rounded, norm_row, silu_times
from inferx_kernels_cuda.pdl import pdl_start

# SiLU-and-mul per token holds the whole row in one program up to this many columns (3B's
# 11008 and 8B's 14336 pad to 16384): one load's latency instead of two passes of several.
SILU_ONE_TILE_MAX = 16384
# Columns a SiLU-and-mul program takes where columns are independent (groups, static scale)
# and a pass's tile where a token's row is longer than SILU_ONE_TILE_MAX.
SILU_BLOCK = 1024
SILU_LOOP_BLOCK = 4096


@triton.jit
def _quantize_store(
    y, col0, cols, mask, q_row, s_row, static_ptr, n_cols,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr, HAND_ROUND: tl.constexpr,
):  # fmt: skip
    """y [BLOCK] fp32 at columns cols = col0 + arange(BLOCK) (masked columns 0) quantized to
    e4m3 at q_row + cols, with one scale (the row's, at s_row), one per GROUP columns (at
    s_row + column // GROUP; col0 starts a group) or the static scale at static_ptr."""
    q_dtype = q_row.dtype.element_ty
    if STATIC:
        scale = tl.load(static_ptr)
        q = _to_e4m3(tl.clamp(y / scale, -448.0, 448.0), HAND_ROUND)
        tl.store(q_row + cols, q.to(q_dtype), mask=mask)
    elif GROUP > 0:
        y2 = tl.reshape(y, [BLOCK // GROUP, GROUP])
        scale = tl.maximum(tl.max(tl.abs(y2), axis=1) / 448.0, 1.0 / (448.0 * 512.0))
        q = _to_e4m3(tl.clamp(y2 / scale[:, None], -448.0, 448.0), HAND_ROUND)
        tl.store(q_row + cols, tl.reshape(q, [BLOCK]).to(q_dtype), mask=mask)
        groups = col0 // GROUP + tl.arange(0, BLOCK // GROUP)
        tl.store(s_row + groups, scale, mask=groups * GROUP < n_cols)
    else:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / 448.0, 1.0 / (448.0 * 512.0))
        q = _to_e4m3(tl.clamp(y / scale, -448.0, 448.0), HAND_ROUND)
        tl.store(q_row + cols, q.to(q_dtype), mask=mask)
        tl.store(s_row, scale)


# stride_part is rows x hidden, so it changes with the batch: not specialised on.
@triton.jit(do_not_specialize=["stride_part"])
def rms_norm_quant_kernel(
    x_ptr, residual_ptr, weight_ptr, q_ptr, s_ptr, static_ptr, residual_out_ptr,
    stride_x, stride_residual, stride_q, stride_s, stride_residual_out, stride_part, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PARTS: tl.constexpr, GROUP: tl.constexpr,
    STATIC: tl.constexpr, HAND_ROUND: tl.constexpr, PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
):  # fmt: skip
    """rms_norm_kernel (one program per row, the whole row in one tile, parts and residual
    alike, PDL and TRIGGER too), its output rounded to x's dtype and then quantized
    (_quantize_store) instead of stored."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(PDL, TRIGGER)
    y = norm_row(
        x_ptr, residual_ptr, residual_out_ptr, w, row, cols, mask, stride_x, stride_residual,
        stride_residual_out, stride_part, n_cols, eps, HAS_RESIDUAL, PARTS,
    )  # fmt: skip
    y = _rounded(y, x_ptr.dtype.element_ty)
    _quantize_store(
        y, 0, cols, mask, q_ptr + row * stride_q, s_ptr + row * stride_s, static_ptr, n_cols,
        BLOCK, GROUP, STATIC, HAND_ROUND,
    )  # fmt: skip


@triton.jit
def _silu_row(x_row, cols, mask, n_cols, DTYPE: tl.constexpr):
    """silu(gate) * up at columns cols of a row holding gate then up, rounded to DTYPE as
    silu_and_mul_kernel stores it; fp32."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    return _rounded(silu_times(gate, up, DTYPE), DTYPE)


@triton.jit
def silu_and_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, stride_x, stride_q, stride_s, n_cols,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, STATIC: tl.constexpr, ONE_TILE: tl.constexpr,
    HAND_ROUND: tl.constexpr, TRIGGER: tl.constexpr = False,
):  # fmt: skip
    """silu_and_mul_kernel's output quantized (TRIGGER too). Grid (rows, column blocks) where a
    block's scales need only its own columns (GROUP > 0, dividing BLOCK; STATIC); per token one
    program a row: the whole row in one tile (ONE_TILE), else two passes over BLOCK-column
    tiles, the absmax first, then the values again (from L2) to quantize."""
    pdl_start(False, TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    s_row = s_ptr + row * stride_s
    dtype = x_ptr.dtype.element_ty
    if STATIC or GROUP > 0 or ONE_TILE:
        col0 = tl.program_id(1) * BLOCK
        cols = col0 + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = _silu_row(x_row, cols, mask, n_cols, dtype)
        _quantize_store(
            y, col0, cols, mask, q_row, s_row, static_ptr, n_cols, BLOCK, GROUP, STATIC,
            HAND_ROUND,
        )  # fmt: skip
    else:
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, n_cols, BLOCK):
            mask = k0 + offs < n_cols
            amax = tl.maximum(amax, tl.abs(_silu_row(x_row, k0 + offs, mask, n_cols, dtype)))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.0 / (448.0 * 512.0))
        for k0 in range(0, n_cols, BLOCK):
            mask = k0 + offs < n_cols
            y = _silu_row(x_row, k0 + offs, mask, n_cols, dtype)
            q = _to_e4m3(tl.clamp(y / scale, -448.0, 448.0), HAND_ROUND)
            tl.store(q_row + k0 + offs, q.to(q_row.dtype.element_ty), mask=mask)
        tl.store(s_row, scale)


def fusable(granularity: str, group: int) -> bool:
    """Whether these kernels quantize this way: per token, static, or per group of a power of
    two columns (a group is a reshaped tile's row)."""
    if granularity == "group":
        return group > 0 and group & (group - 1) == 0
    return granularity in ("token", "static")


def scales_for(
    rows: int, cols: int, granularity: str, group: int, static: torch.Tensor | None, device
) -> tuple[torch.Tensor, int]:
    """(the scale tensor the kernels write, its row stride): [rows, 1] per token, [rows,
    ceil(cols / group)] per group, the static [1, 1] itself (read, never written)."""
    if granularity == "static":
        assert static is not None
        return static.reshape(1, 1), 0
    width = triton.cdiv(cols, group) if granularity == "group" else 1
    scale = torch.empty((rows, width), dtype=torch.float32, device=device)
    return scale, scale.stride(0)


def silu_and_mul_quant(
    x: torch.Tensor,
    granularity: str,
    group: int = 0,
    static: torch.Tensor | None = None,
    interpret: bool = False,
    trigger: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, 2I] (gate then up, unit column stride) -> (e4m3 [rows, I], float32 scales as
    scales_for). interpret: under Triton's interpreter (the e4m3 rounding by hand). trigger:
    the GEMV after it may launch now (inferx_kernels_cuda.pdl)."""
    rows, half = x.shape[0], x.shape[1] // 2
    q = torch.empty((rows, half), dtype=FP8, device=x.device)
    scale, stride_s = scales_for(rows, half, granularity, group, static, x.device)
    if not rows or not half:
        return q, scale
    one_tile = granularity == "token" and triton.next_power_of_2(half) <= SILU_ONE_TILE_MAX
    if granularity == "token":
        block = triton.next_power_of_2(half) if one_tile else SILU_LOOP_BLOCK
        grid: tuple[int, ...] = (rows,)
    else:
        block = max(SILU_BLOCK, group)
        grid = (rows, triton.cdiv(half, block))
    silu_and_mul_quant_kernel[grid](
        x, q, scale, scale, x.stride(0), q.stride(0), stride_s, half,
        BLOCK=block, GROUP=group if granularity == "group" else 0,
        STATIC=granularity == "static", ONE_TILE=one_tile, HAND_ROUND=interpret,
        TRIGGER=trigger, num_warps=4 if block <= 1024 else (8 if block <= 4096 else 16),
    )  # fmt: skip
    return q, scale
