"""A decode GEMM that reads its weight through Hopper's tensor memory accelerator (TMA).

The Triton GEMVs with pointer loads hit a limit: Triton pipelines the weight through cp.async,
every thread issuing its share of each tile, and the tiles of a small-M product came in slower
than cuBLAS (TMA and warp-specialised loads) reads them. Every fusion that needs our own GEMV
(the MLP in one launch, the norm folded in) lost that way. `tma_linear_parts` is the same
product with the weight and x read through tensor descriptors: one thread issues each tile's
bulk copy, the hardware zero-fills what lies past the tensor's edges (no masks), and Triton
pipelines the copies num_stages deep. That reads the decode projections faster than cuBLAS or
the split bmm, and it makes a fusion pay: `tma_norm_linear` (below) runs the norm before
gate_up, gate_up and SiLU-and-mul in one launch. TritonOps runs both by default at decode sizes
(linear_parts / linear_split / linear_silu_and_mul / rms_norm_linear_silu_and_mul).

The output is QuantLinear.forward_parts' form, [S, M, N] partial products over S equal slices
of K, each rounded to x's dtype (S = 1: F.linear; a bias goes into part 0). A program owns
BLOCK_N weight rows of one slice; x is padded to BLOCK_M >= 16 rows for the tensor cores by the
descriptor's zero fill, so no padding is read from memory.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from inferx_core.interfaces.attention import SplitAttention
from inferx_kernels_cuda.fused_kernels import _rounded, silu_times
from inferx_kernels_cuda.pdl import gemv_launch, pdl_late, pdl_start
from inferx_kernels_cuda.triton_kernels import _seq_split_len

# Rows of x a launch takes (TritonOps runs them to tma_gemv_max_rows, 64 by default; 65-128 are
# for A/B runs until measured).
MAX_ROWS = 128
# Shared memory an SM has on Hopper (and on sm_100): 228 KB.
SM_SHARED_BYTES = 228 * 1024
# The most weight one program loads before its PDL wait (tma_reduce_linear's `whole`): 64 KB,
# so that two programs and a decode program share an SM.
WHOLE_BYTES = 64 * 1024
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def has_tma(device: torch.device) -> bool:
    """Hopper or newer: the TMA kernels' tensor descriptors and wgmma were written and measured
    for sm_90 (older GPUs keep the cuBLAS paths)."""
    return torch.cuda.get_device_capability(device)[0] >= 9


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
def _store_part(out_ptr, y, pid_s, n0, m, n, stride_os, stride_om, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """y [BLOCK_N weight rows from n0, BLOCK_M rows of x] into out[pid_s] [m, n] (rows of x
    stride_om apart), those past m and n left out."""
    rows = n0 + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_M)
    out = out_ptr + pid_s * stride_os + cols[None, :] * stride_om + rows[:, None]
    mask = (rows[:, None] < n) & (cols[None, :] < m)
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _products(w_desc, x, acc, acc_up, n0, col, up_row, GATED: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One K step: acc += W[n0:, col:] @ x.T for the weight tile TMA loads at (n0, col), and
    with GATED acc_up += the up rows' tile (up_row further on) @ x.T. x [BLOCK_M, BLOCK_K]."""
    w = w_desc.load([n0, col])  # [BLOCK_N, BLOCK_K]
    if UPCAST:  # the interpreter's bf16 dot would round the products to bf16
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    else:  # an e4m3 weight with half-precision x (weight-only FP8): cast in registers
        w = w.to(x.dtype)
    acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    if GATED:
        wu = w_desc.load([up_row + n0, col])
        wu = wu.to(x.dtype)
        acc_up = tl.dot(wu, tl.trans(x), acc_up, input_precision=DOT_PRECISION)
    return acc, acc_up


# m only masks the stores: not specialised on (m == 1, m % 16), so one compile serves every
# row count of a BLOCK_M (the graph ladder's 1, 2-8 and 16 share one).
@triton.jit(do_not_specialize=["m"])
def tma_gemv_kernel(
    x_desc,
    w_desc,
    out_ptr,
    m,
    n,
    k_per_split,
    up_row,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    LATE: tl.constexpr = False,
    bias_ptr=None,
    HAS_BIAS: tl.constexpr = False,
):
    """Grid (row blocks, splits): out[s, :, rows] = x[:, ks] @ W[rows, ks].T, ks = split s's
    k_per_split columns (a multiple of BLOCK_K; the last split's run past K reads zeros), with
    HAS_BIAS bias[rows] added to split 0's in fp32 before its rounding.
    GATED (one split, no bias): W holds gate rows, then up rows from up_row; out [m, n] =
    silu(gate) * up for gate rows n, each rounded as silu_and_mul after the GEMM rounds them.
    PDL, TRIGGER, LATE: inferx_kernels_cuda.pdl."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_s * k_per_split
    pdl_start(PDL, TRIGGER)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        x = x_desc.load([0, k0 + kk])  # [BLOCK_M, BLOCK_K], rows past m zero
        acc, acc_up = _products(w_desc, x, acc, acc_up, n0, k0 + kk, up_row, GATED, UPCAST,
                                DOT_PRECISION)  # fmt: skip
    pdl_late(LATE)
    if GATED:
        dtype = out_ptr.dtype.element_ty
        acc = silu_times(_rounded(acc, dtype), _rounded(acc_up, dtype), dtype)
    if HAS_BIAS:
        rows = n0 + tl.arange(0, BLOCK_N)
        b = tl.load(bias_ptr + rows, mask=rows < n, other=0.0).to(tl.float32)
        acc += tl.where(pid_s == 0, b, 0.0)[:, None]
    _store_part(out_ptr, acc, pid_s, n0, m, n, stride_os, stride_om, BLOCK_N, BLOCK_M)


def input_problem(
    x: torch.Tensor, weight: torch.Tensor, parts: int = 1, name: str = "tma_linear_parts"
) -> str | None:
    """Why `name` (tma_linear_parts, or tma_norm_linear of x's rows) cannot take these inputs,
    or None when it can."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return (
            f"{name}: x [M, K] and weight [N, K] must agree on K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS or parts < 1:
        return f"{name}: takes 1 to {MAX_ROWS} rows and parts >= 1, got {x.shape[0]}, {parts}"
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return (
            f"{name}: x and weight must share float16, bfloat16 or float32, got "
            f"{x.dtype} and {weight.dtype}"
        )
    return _alignment_problem(x, weight, name)


def _alignment_problem(x: torch.Tensor, weight: torch.Tensor, name: str) -> str | None:
    """TMA's rule for x and weight: 16-byte aligned base and row strides, unit stride along K."""
    for arg, t in (("x", x), ("weight", weight)):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return (
                f"{name}: {arg} needs a unit K stride and 16-byte aligned rows "
                f"(strides {t.stride()}, {t.element_size()}-byte elements, address "
                f"{t.data_ptr()})"
            )
    return None


def tma_linear_parts(
    x: torch.Tensor,
    weight: torch.Tensor,
    parts: int = 1,
    config: TmaGemvConfig | None = None,
    trigger: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[parts, M, N] partial products of x [M <= MAX_ROWS, K] and weight [N, K] over equal
    slices of K (their sum is F.linear(x, weight, bias) up to rounding; the bias [N], in x's
    dtype, goes into part 0), in x's dtype. trigger: let the next kernel launch early (PDL)
    whatever the rows."""
    return _launch(x, weight, parts, False, config or TmaGemvConfig(), trigger, bias)


def tma_linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, config: TmaGemvConfig | None = None
) -> torch.Tensor:
    """silu(gate) * up as [M, I] for x [M <= MAX_ROWS, K] and weight [2I, K] (gate rows, then
    up rows): silu_and_mul(F.linear(x, weight)) in one launch. Each program reads BLOCK_N gate
    rows and the BLOCK_N up rows I further on."""
    if weight.dim() == 2 and weight.shape[0] % 2:
        raise ValueError(
            f"tma_linear_silu_and_mul: weight needs gate then up rows (an even count), got "
            f"{weight.shape[0]}"
        )
    return _launch(x, weight, 1, True, config or TmaGemvConfig(64, 128, 4, 3))


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    parts: int,
    gated: bool,
    cfg: TmaGemvConfig,
    trigger: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    name = "tma_linear_silu_and_mul" if gated else "tma_linear_parts"
    problem = input_problem(x, weight, parts, name)
    if problem:
        raise ValueError(problem)
    if bias is not None and (
        bias.shape != weight.shape[:1] or bias.dtype != x.dtype or bias.stride(0) != 1
    ):
        raise ValueError(
            f"{name}: bias must be [{weight.shape[0]}] contiguous in {x.dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    out = torch.empty((m, n) if gated else (parts, m, n), dtype=x.dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, block_shape=[block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[cfg.block_n, cfg.block_k])
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    tma_gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x_desc, w_desc, out, m, n, k_per_split, n, 0 if gated else out.stride(0),
        out.stride(-2),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated,
        UPCAST=interpret and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **gemv_launch(x.device, m, trigger), bias_ptr=bias, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return out


# --- FP8 weights (per-row scales) --------------------------------------------------------------
#
# The same decode GEMM for an e4m3 weight [N, K] with a float32 scale per output row (per channel,
# or a per-tensor scale repeated over its part's rows): x either e4m3 with a scale per row (or
# one for the tensor), so the dot runs e4m3 x e4m3 on the tensor cores, or half precision
# (weight-only), the weight tile cast to it in registers. The accumulator is fp32 and takes both
# scales once after the K loop; the bias goes into part 0. Block-scaled weights (a scale per
# 128 x 128 block) stay on fp8_gemm's pointer kernel.

FP8 = torch.float8_e4m3fn


@triton.jit(do_not_specialize=["m"])
def tma_fp8_gemv_kernel(
    x_desc,
    w_desc,
    x_scale_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k_per_split,
    up_row,
    stride_xs,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    X_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    LATE: tl.constexpr = False,
):
    """tma_gemv_kernel's grid and parts for W e4m3 with w_scale [N] (gated: [2I], up rows from
    up_row): out[s, :, rows] = (x[:, ks] @ W[rows, ks].T) * w_scale[rows] * x_scale (X_SCALED:
    x e4m3, row r's scale at x_scale_ptr[r * stride_xs]; else x half precision), + bias[rows]
    in part 0. GATED (one split): out [m, n] = silu(gate) * up of the scaled (and biased)
    gate and up rows, each rounded to out's dtype first as silu_and_mul reads them."""
    tl.assume(k_per_split > 0)  # else ptxas may serialize the wgmma (moe_gemm_kernel's note)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_s * k_per_split
    pdl_start(PDL, TRIGGER)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kk in range(0, k_per_split, BLOCK_K):
        x = x_desc.load([0, k0 + kk])  # [BLOCK_M, BLOCK_K], rows past m zero
        acc, acc_up = _products(w_desc, x, acc, acc_up, n0, k0 + kk, up_row, GATED, UPCAST,
                                "tf32")  # fmt: skip
    pdl_late(LATE)
    rows = n0 + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    xs = tl.full([BLOCK_M], 1.0, tl.float32)
    if X_SCALED:
        cols = tl.arange(0, BLOCK_M)
        xs = tl.load(x_scale_ptr + cols * stride_xs, mask=cols < m, other=0.0)
    ws = tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0)
    acc = acc * ws[:, None] * xs[None, :]
    if HAS_BIAS:
        b = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_s == 0, b, 0.0)[:, None]
    if GATED:
        dtype = out_ptr.dtype.element_ty
        ws_up = tl.load(w_scale_ptr + up_row + rows, mask=row_ok, other=0.0)
        acc_up = acc_up * ws_up[:, None] * xs[None, :]
        if HAS_BIAS:
            b_up = tl.load(bias_ptr + up_row + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc_up += b_up[:, None]
        acc = silu_times(_rounded(acc, dtype), _rounded(acc_up, dtype), dtype)
    _store_part(out_ptr, acc, pid_s, n0, m, n, stride_os, stride_om, BLOCK_N, BLOCK_M)


def fp8_input_problem(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    parts: int = 1,
    name: str = "tma_fp8_linear_parts",
) -> str | None:
    """Why the FP8 TMA GEMM cannot take these inputs, or None when it can: weight e4m3 [N, K]
    with float32 w_scale [N]; x [M <= MAX_ROWS, K] e4m3 with float32 x_scale [M, 1] or [1, 1],
    or float16 / bfloat16 with x_scale None; TMA-readable rows (16-byte aligned)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return (
            f"{name}: x [M, K] and weight [N, K] must agree on K, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS or parts < 1:
        return f"{name}: takes 1 to {MAX_ROWS} rows and parts >= 1, got {x.shape[0]}, {parts}"
    if weight.dtype != FP8 or w_scale.dtype != torch.float32 or w_scale.shape != weight.shape[:1]:
        return (
            f"{name}: weight must be float8_e4m3fn with a float32 scale per row [N], got "
            f"{weight.dtype} and {w_scale.dtype} {tuple(w_scale.shape)}"
        )
    if x_scale is None and x.dtype not in (torch.float16, torch.bfloat16):
        return f"{name}: x without a scale (weight-only) must be float16 or bfloat16, got {x.dtype}"
    if x_scale is not None and (
        x.dtype != FP8
        or x_scale.dtype != torch.float32
        or x_scale.dim() != 2
        or x_scale.shape[1] != 1
        or x_scale.shape[0] not in (1, x.shape[0])
    ):
        return (
            f"{name}: scaled x must be float8_e4m3fn with a float32 scale per row [M, 1] or "
            f"per tensor [1, 1], got {x.dtype} and {x_scale.dtype} {tuple(x_scale.shape)}"
        )
    return _alignment_problem(x, weight, name)


def tma_fp8_linear_parts(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    parts: int = 1,
    config: TmaGemvConfig | None = None,
    out_dtype: torch.dtype | None = None,
    gated: bool = False,
    trigger: bool = False,
) -> torch.Tensor:
    """[parts, M, N] K-slice parts of (x * x_scale) @ (weight * w_scale[:, None]).T, the bias
    in part 0, in out_dtype (x's for weight-only; needed for e4m3 x): fp8_input_problem says
    what it takes. gated (parts 1; weight [2I, K], gate rows then up rows): silu(gate) * up
    as [M, I]. trigger: let the next kernel launch early (PDL)."""
    problem = fp8_input_problem(x, x_scale, weight, w_scale, parts)
    if problem:
        raise ValueError(problem)
    if gated and (parts != 1 or weight.shape[0] % 2):
        raise ValueError(
            f"tma_fp8_linear_parts: gated takes parts=1 and an even weight row count (gate "
            f"then up), got parts={parts} and {weight.shape[0]} rows"
        )
    if out_dtype is None:
        if x_scale is not None:
            raise ValueError("tma_fp8_linear_parts: e4m3 x needs an out_dtype")
        out_dtype = x.dtype
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(
            f"tma_fp8_linear_parts: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    cfg = config or plain_config(n, parts, 132, m, gated, x.element_size())
    block_m = max(16, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    out = torch.empty((m, n) if gated else (parts, m, n), dtype=out_dtype, device=x.device)
    x_desc = TensorDescriptor.from_tensor(x, block_shape=[block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[cfg.block_n, cfg.block_k])
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    scaled = x_scale is not None
    stride_xs = x_scale.stride(0) if scaled and x_scale.shape[0] > 1 else 0
    tma_fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x_desc, w_desc, x_scale if scaled else w_scale, w_scale,
        bias if bias is not None else w_scale, out, m, n, k_per_split, n, stride_xs,
        0 if gated else out.stride(0), out.stride(-2),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GATED=gated,
        X_SCALED=scaled, HAS_BIAS=bias is not None,
        UPCAST=interpret, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **gemv_launch(x.device, m, trigger),
    )  # fmt: skip
    return out


def fp8_parts(n: int, k: int, rows: int, num_sms: int, block_k: int = 256) -> int:
    """K-slices of an FP8 decode GEMM of n weight rows: doubled from 1 (up to 8) while the
    programs (plain_config's row blocks x slices) are fewer than two an SM and each slice
    keeps a K tile: a 3B gate_up whole, its QKV, o_proj and down_proj in 8 (`fp8_gemm.py
    --sweep`, docs/BENCHMARKS.md)."""
    parts = 1
    while parts < 8 and k >= 2 * parts * block_k:
        programs = triton.cdiv(n, plain_config(n, parts, num_sms, rows, elem_bytes=1).block_n)
        if programs * parts >= 2 * num_sms:
            break
        parts *= 2
    return parts


# --- The norm before a decode GEMM, in the GEMM ------------------------------------------------
#
# A decode layer runs add + RMSNorm (rms_norm_kernel: the K-slice parts of the GEMM before, summed,
# plus the residual) and then a GEMM on the normed rows. tma_norm_linear does both in the GEMM's
# launch: each program builds its x tiles from the parts and the residual (a few KB, from L2)
# while TMA streams its weight tiles, keeps the rows' sums of squares, and scales its products
# by 1 / rms at the end, so a layer loses two launches and the gaps beside them. Every program
# reads the whole row of every part for the sums of squares (all S_OUT slices at the offset of
# its own); column block 0 of each slice writes that slice of the new residual.
#
# Rounding differs from rms_norm + GEMM in one place: the reference rounds h / rms * weight to
# the dtype before the product, here h * weight is rounded and 1 / rms applied to the fp32 sum.


@triton.jit
def _repeat_rows(x, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, COLS: tl.constexpr):
    """[ROWS, COLS] -> [BLOCK_M, COLS] (BLOCK_M a multiple of ROWS), row j = x[j % ROWS]: the dot
    wants at least 16 rows, and the copies past ROWS only fill output columns never stored."""
    if ROWS == 1:
        x = tl.broadcast_to(x, (BLOCK_M, COLS))
    elif ROWS < BLOCK_M:
        copies = tl.broadcast_to(x[None, :, :], (BLOCK_M // ROWS, ROWS, COLS))
        x = tl.reshape(copies, (BLOCK_M, COLS))
    return x


@dataclass(frozen=True)
class TmaNormConfig(TmaGemvConfig):
    """TmaGemvConfig plus how a program gets its own split's x columns: select_own takes them
    out of the all-splits tile it loads for the squares, else it loads them again (from L2).
    (A third knob, loading the next K step's x tiles by hand before this step's products, was
    never the fastest: e4a1cb8.)"""

    select_own: bool = False

    def __str__(self) -> str:
        return super().__str__() + (" sel" if self.select_own else "")


@triton.jit
def _summed_rows(parts_ptr, residual_ptr, offs, mask, stride_in_part, S_IN: tl.constexpr, dtype):
    """rms_norm_kernel's h at offs: the S_IN parts summed in fp32 and rounded once, plus the
    residual, rounded."""
    h = tl.load(parts_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, S_IN):
        h += tl.load(parts_ptr + p * stride_in_part + offs, mask=mask, other=0.0).to(tl.float32)
    if S_IN > 1:
        h = _rounded(h, dtype)
    r = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    return _rounded(h + r.to(tl.float32), dtype)


@triton.jit
def _norm_tiles(
    parts_ptr, residual_ptr, norm_w_ptr, rows, cols, slices, m, k, k0, kk, k_per_split,
    stride_in_part, pid_s, S_IN: tl.constexpr, SELECT_OWN: tl.constexpr, dtype,
):  # fmt: skip
    """h at columns kk.. of every split [S_OUT, ROWS, BLOCK_K] and of this program's own
    [ROWS, BLOCK_K], and the norm weight there."""
    kcols = slices[:, None, None] * k_per_split + kk + cols[None, None, :]
    mask = (rows[None, :, None] < m) & (kcols < k)
    h = _summed_rows(parts_ptr, residual_ptr, rows[None, :, None] * k + kcols, mask,
                     stride_in_part, S_IN, dtype)  # fmt: skip
    own_cols = k0 + kk + cols
    in_split = own_cols < k
    if SELECT_OWN:
        own = tl.sum(tl.where(slices[:, None, None] == pid_s, h, 0.0), axis=0)
    else:
        own_mask = (rows[:, None] < m) & in_split[None, :]
        own = _summed_rows(parts_ptr, residual_ptr, rows[:, None] * k + own_cols[None, :],
                           own_mask, stride_in_part, S_IN, dtype)  # fmt: skip
    nw = tl.load(norm_w_ptr + own_cols, mask=in_split, other=0.0).to(tl.float32)
    return h, own, nw


@triton.jit(do_not_specialize=["m"])
def tma_norm_gemv_kernel(
    parts_ptr,
    residual_ptr,
    norm_w_ptr,
    residual_out_ptr,
    w_desc,
    out_ptr,
    m,
    n,
    k,
    k_per_split,
    up_row,
    stride_in_part,
    stride_os,
    stride_om,
    eps,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    S_IN: tl.constexpr,
    S_OUT: tl.constexpr,
    GATED: tl.constexpr,
    SELECT_OWN: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    LATE: tl.constexpr = False,
):
    """Grid (row blocks, S_OUT splits). h = sum of the S_IN parts [S_IN, m, k] (rounded once)
    + residual [m, k] (rounded), as rms_norm_kernel; x = h * norm weight; out[s, :, rows] =
    (x[:, ks] @ W[rows, ks].T) / rms(h) for split s's columns ks. GATED (S_OUT 1): W holds gate
    rows then up rows from up_row, out [m, n] = silu(gate) * up for gate rows n. Rows are
    loaded ROWS (>= m, a power of two) at a time, repeated to BLOCK_M (>= 16) for the dot.
    PDL, TRIGGER, LATE: inferx_kernels_cuda.pdl."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    k0 = pid_s * k_per_split
    pdl_start(PDL, TRIGGER)
    dtype = parts_ptr.dtype.element_ty
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    slices = tl.arange(0, S_OUT)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    # squares summed element-wise in the loop, across threads once after it
    squares = tl.zeros([S_OUT, ROWS, BLOCK_K], tl.float32)
    store_rows = tl.where(pid_n == 0, m, 0)  # column block 0 writes the new residual
    for kk in range(0, k_per_split, BLOCK_K):
        h, own, nw = _norm_tiles(
            parts_ptr, residual_ptr, norm_w_ptr, rows, cols, slices, m, k, k0, kk, k_per_split,
            stride_in_part, pid_s, S_IN, SELECT_OWN, dtype,
        )  # fmt: skip
        squares += h * h
        own_cols = k0 + kk + cols
        own_mask = (rows[:, None] < m) & (own_cols[None, :] < k)
        tl.store(
            residual_out_ptr + rows[:, None] * k + own_cols[None, :],
            own.to(dtype),
            mask=own_mask & (rows[:, None] < store_rows),
        )
        x = _repeat_rows((own * nw[None, :]).to(dtype), ROWS, BLOCK_M, BLOCK_K)
        acc, acc_up = _products(w_desc, x, acc, acc_up, n0, k0 + kk, up_row, GATED, UPCAST,
                                DOT_PRECISION)  # fmt: skip
    pdl_late(LATE)
    sumsq = tl.sum(tl.sum(squares, axis=2), axis=0)
    inv_rms = tl.rsqrt(sumsq / k + eps)[:, None]
    inv_rms = tl.reshape(_repeat_rows(inv_rms, ROWS, BLOCK_M, 1), (BLOCK_M,))
    y = acc * inv_rms[None, :]
    if GATED:
        gate = _rounded(y, dtype)
        up = _rounded(acc_up * inv_rms[None, :], dtype)
        y = silu_times(gate, up, dtype)
    _store_part(out_ptr, y, pid_s, n0, m, n, stride_os, stride_om, BLOCK_N, BLOCK_M)


def norm_config(rows: int, parts: int, gated: bool) -> TmaNormConfig:
    """tma_norm_linear's tiles for `rows` rows, the fastest of bench_tma_gemv.py --norm
    (docs/BENCHMARKS.md). Gated (gate_up, one split): 64 x 128 tiles 3 deep at up
    to 4 rows, 64 x 64 4 deep past that; x from the all-splits tile (select_own).
    Otherwise (K-split parts: QKV) every program holds each tile's columns in all `parts`
    splits of every part and the residual, num_stages deep, so K narrows as rows * parts grow
    to keep that in shared memory."""
    if gated:
        if rows <= 4:
            return TmaNormConfig(64, 128, 4, 3, select_own=True)
        return TmaNormConfig(64, 64, 4, 4, select_own=True)
    return TmaNormConfig(64, 128 if rows * parts <= 8 else 64, 4, 3)


def plain_config(
    n: int, parts: int, num_sms: int, rows: int = 1, gated: bool = False, elem_bytes: int = 2
) -> TmaGemvConfig:
    """tma_linear_parts' tiles for `rows` rows of x and a weight of n rows in `parts` K-slices
    (gated: tma_linear_silu_and_mul's for n output rows, a gate and an up tile a program) of
    elem_bytes elements (float32's 4 halve the stages that fit):
    the deepest pipeline (up to 4 stages, 128 K columns a tile, else 64) that keeps every
    program resident at once, each SM's shared memory split between the programs it must hold.
    64-row weight tiles, 128 for a whole gate_up at up to 16 rows of x. From bench_tma_gemv.py
    (docs/BENCHMARKS.md): a second wave of programs costs more than a shallower pipeline.
    One-byte elements (e4m3 x and weight): 64-row tiles of 256 K columns first, a bf16 tile's
    bytes (`fp8_gemm.py --sweep`)."""
    block_m = max(16, triton.next_power_of_2(rows))
    block_n = 128 if parts == 1 and block_m == 16 and not gated and elem_bytes > 1 else 64
    tile_rows = (2 if gated else 1) * block_n + block_m  # weight and x rows a stage holds
    programs = triton.cdiv(n, block_n) * parts
    return resident_config(block_n, tile_rows, programs, num_sms, elem_bytes)


def resident_config(
    block_n: int, tile_rows: int, programs: int, num_sms: int, elem_bytes: int = 2
) -> TmaGemvConfig:
    """BLOCK_N-row tiles in the deepest pipeline (up to 4 stages of tile_rows rows, 128 K
    columns a tile, else 64; one-byte elements 256 first) that keeps all `programs` resident
    at once, each SM's shared memory split between the programs it must hold; 2 stages of 64
    if even 3 of 64 do not fit."""
    programs_per_sm = triton.cdiv(programs, num_sms)
    budget = SM_SHARED_BYTES // programs_per_sm - 1024  # the driver keeps 1 KB a program
    for block_k in (256, 128, 64) if elem_bytes == 1 else (128, 64):
        stages = min(4, budget // (tile_rows * block_k * elem_bytes))
        if stages >= 3:
            return TmaGemvConfig(block_n, block_k, 4, stages)
    return TmaGemvConfig(block_n, 64, 4, 2)  # alone it fits: (2 x 64 + 128) x 64 x 4 B x 2 = 128 KB


def tma_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    parts: int = 1,
    gated: bool = False,
    config: TmaNormConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x, norm_weight, eps, residual, parts=True) then the GEMM with weight [N, K], in
    one launch: (out, new residual). x: [S_in, M, K] partial results summed into the residual
    [M, K]. out: [parts, M, N] K-slice parts (tma_linear_parts' form), or with `gated` (weight
    [2I, K], gate rows then up rows; parts 1) silu(gate) * up as [M, I]."""
    cfg = config or TmaNormConfig()
    if x.dim() != 3 or residual.shape != x.shape[1:] or norm_weight.shape != x.shape[2:]:
        raise ValueError(
            f"tma_norm_linear: x [S, M, K] needs residual [M, K] and norm weight [K], got "
            f"{tuple(x.shape)}, {tuple(residual.shape)} and {tuple(norm_weight.shape)}"
        )
    problem = input_problem(residual, weight, parts, "tma_norm_linear")
    if problem:
        raise ValueError(problem)
    if x.dtype != weight.dtype or norm_weight.dtype != weight.dtype:
        raise ValueError(
            f"tma_norm_linear: x, norm weight and weight must share a dtype, got {x.dtype}, "
            f"{norm_weight.dtype} and {weight.dtype}"
        )
    if gated and (parts != 1 or weight.shape[0] % 2):
        raise ValueError(
            f"tma_norm_linear: gated takes parts=1 and an even weight row count (gate then up), "
            f"got parts={parts} and {weight.shape[0]} rows"
        )
    s_in, m, k = x.shape
    x, residual = x.contiguous(), residual.contiguous()
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    rows = triton.next_power_of_2(m)
    k_per_split = triton.cdiv(triton.cdiv(k, parts), cfg.block_k) * cfg.block_k
    out_shape = (m, n) if gated else (parts, m, n)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty_like(residual)
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[cfg.block_n, cfg.block_k])
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    tma_norm_gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x, residual, norm_weight.contiguous(), new_residual, w_desc, out, m, n, k, k_per_split,
        n, x.stride(0), 0 if gated else out.stride(0), out.stride(-2), eps,
        ROWS=rows, BLOCK_M=max(16, rows), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        S_IN=s_in, S_OUT=parts,
        GATED=gated, SELECT_OWN=cfg.select_own,
        UPCAST=interpret and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **gemv_launch(x.device, m),
    )  # fmt: skip
    return out, new_residual


# --- The decode attention's split reduce, in o_proj -----------------------------------------
#
# With its context split, the decode kernel leaves each (row, head) as `splits` partial outputs
# and their log2-sum-exp2s (a SplitAttention), and decode_reduce_kernel combines them before
# o_proj reads the heads. tma_reduce_linear does that combine in o_proj's x tiles instead: a
# K-slice of o_proj is a whole number of heads, so each program combines the splits of its own
# heads (a few KB from L2). Alone that is level with reduce + GEMM. What it
# buys is adjacency: o_proj then follows the decode kernel, which lets it launch early (PDL),
# and with `whole` each program loads its whole weight slice (one TMA copy of BLOCK_N rows x
# the slice's heads) before it waits. At a few rows the decode kernel runs on a handful of SMs
# for a while; o_proj's weight arrives on the others meanwhile, and after the wait only the
# combine, the product from shared memory and the store are left.

# Rows tma_reduce_linear takes: its x tiles are built in registers (rows x a slice's heads x
# head_dim), and the fp32 values of one chunk of splits it combines at once.
MAX_REDUCE_ROWS = 8
REDUCE_TILE = 8192


@triton.jit(do_not_specialize=["m"])
def tma_reduce_gemv_kernel(
    part_o_ptr,
    part_lse_ptr,
    context_len_ptr,
    w_desc,
    out_ptr,
    m,
    n,
    heads,
    num_splits,
    split_len,
    stride_os,
    stride_om,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SLICE_HEADS: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    SEQ_SPLIT: tl.constexpr,
    TILE: tl.constexpr,
    WHOLE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    LATE: tl.constexpr = False,
):
    """Grid (row blocks, K-slices of SLICE_HEADS heads): out[s, :, rows] = x[:, ks] @ W[rows,
    ks].T with x the combined attention output (decode_reduce_kernel's: the splits weighted by
    exp2 of their lse, rounded to out's dtype). WHOLE: the slice's weight is one [BLOCK_N,
    SLICE_HEADS * HEAD_DIM] tile, loaded before the PDL wait, and one product; otherwise a K
    step is one head, TMA-pipelined after the combine. The combine takes SPLIT_CHUNK splits at
    a time up to the most any of the m rows uses (a loop left unpipelined). PDL, TRIGGER,
    LATE: inferx_kernels_cuda.pdl."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    h0 = pid_s * SLICE_HEADS
    # The weight and the contexts (the step's metadata) come from no earlier kernel: both are
    # in flight before the wait.
    if WHOLE:
        w = w_desc.load([n0, h0 * HEAD_DIM])  # [BLOCK_N, SLICE_HEADS * HEAD_DIM]
    r = tl.arange(0, ROWS)
    ctx = tl.load(context_len_ptr + r, mask=r < m, other=0)
    pdl_start(PDL, TRIGGER)
    dtype = out_ptr.dtype.element_ty
    j = tl.arange(0, SLICE_HEADS)
    d = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, SPLIT_CHUNK)
    if SEQ_SPLIT:
        split_len = _seq_split_len(ctx, num_splits, split_len, TILE)
    used = tl.cdiv(ctx, split_len)  # [ROWS]; 0 past m
    first = ((r[:, None] * heads + h0 + j[None, :]) * num_splits)[:, :, None]  # [R, H, 1]
    top = tl.full([ROWS, SLICE_HEADS], -1.0e30, tl.float32)
    total = tl.zeros([ROWS, SLICE_HEADS], tl.float32)
    summed = tl.zeros([ROWS, SLICE_HEADS, HEAD_DIM], tl.float32)
    for s0 in tl.range(0, tl.max(used, 0), SPLIT_CHUNK, num_stages=1):
        s = s0 + c[None, None, :]
        ok = (s < used[:, None, None]) & (j[None, :, None] < SLICE_HEADS)  # [R, H, C]
        lse = tl.load(part_lse_ptr + first + s, mask=ok, other=float("-inf"))
        o = tl.load(part_o_ptr + (first + s)[:, :, :, None] * HEAD_DIM + d[None, None, None, :],
                    mask=ok[:, :, :, None], other=0.0)  # fmt: skip
        new_top = tl.maximum(top, tl.max(lse, 2))
        scale = tl.exp2(top - new_top)
        wt = tl.exp2(lse - new_top[:, :, None])
        total = total * scale + tl.sum(wt, 2)
        summed = summed * scale[:, :, None] + tl.sum(o * wt[:, :, :, None], 2)
        top = new_top
    # rounded as decode_reduce_kernel stores it; unused rows 0
    x_all = _rounded(summed / tl.where(total > 0, total, 1.0)[:, :, None], dtype)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if WHOLE:
        x = tl.reshape(x_all, (ROWS, SLICE_HEADS * HEAD_DIM)).to(dtype)
        x = _repeat_rows(x, ROWS, BLOCK_M, SLICE_HEADS * HEAD_DIM)
        if UPCAST:  # the interpreter's bf16 dot would round the products to bf16
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    else:
        for jj in range(0, SLICE_HEADS):
            x = tl.sum(tl.where(j[None, :, None] == jj, x_all, 0.0), 1).to(dtype)  # head h0 + jj
            x = _repeat_rows(x, ROWS, BLOCK_M, HEAD_DIM)
            acc, _ = _products(w_desc, x, acc, acc, n0, (h0 + jj) * HEAD_DIM, 0, False, UPCAST,
                               DOT_PRECISION)  # fmt: skip
    pdl_late(LATE)
    _store_part(out_ptr, acc, pid_s, n0, m, n, stride_os, stride_om, BLOCK_N, BLOCK_M)


def reduce_input_problem(splits: SplitAttention, weight: torch.Tensor, parts: int) -> str | None:
    """Why tma_reduce_linear cannot take these inputs, or None when it can."""
    m, heads, dim = splits.rows, splits.heads, splits.head_dim
    if weight.dim() != 2 or weight.shape[1] != heads * dim:
        return (
            f"tma_reduce_linear: weight must be [N, {heads} heads x {dim}], got "
            f"{tuple(weight.shape)}"
        )
    slice_heads = heads // parts if parts >= 1 else 0
    if (
        not 1 <= m <= MAX_REDUCE_ROWS
        or parts < 1
        or heads % parts
        or slice_heads & (slice_heads - 1)
        or dim & (dim - 1)
    ):
        return (
            f"tma_reduce_linear: takes 1 to {MAX_REDUCE_ROWS} rows, a power-of-two head dim "
            f"and K-slices of a power-of-two count of whole heads; got {m} rows, head dim "
            f"{dim}, {heads} heads in {parts} slices"
        )
    want = m * heads * splits.splits
    if splits.part_o.numel() < want * dim or splits.part_lse.numel() < want:
        return f"tma_reduce_linear: part_o / part_lse hold fewer than {want} splits"
    if splits.part_o.dtype != torch.float32 or splits.part_lse.dtype != torch.float32:
        return "tma_reduce_linear: part_o and part_lse must be float32"
    return input_problem(weight[:1], weight, 1, "tma_reduce_linear")  # the weight's layout


def reduce_config(splits: SplitAttention, weight: torch.Tensor, parts: int) -> TmaGemvConfig:
    """64 weight rows a program; block_k = the slice's width when the slice's weight fits in
    WHOLE_BYTES (`whole`: one tile, loaded before the wait), else one head (pipelined 3 deep)."""
    width = splits.heads // parts * splits.head_dim
    if 64 * width * weight.element_size() <= WHOLE_BYTES:
        return TmaGemvConfig(64, width, 4, 1)
    return TmaGemvConfig(64, splits.head_dim, 4, 3)


def tma_reduce_linear(
    splits: SplitAttention,
    weight: torch.Tensor,
    parts: int = 1,
    config: TmaGemvConfig | None = None,
    split_chunk: int | None = None,
) -> torch.Tensor:
    """[parts, rows, N] K-slice parts of splits' combined output @ weight.T, weight [N, heads *
    head_dim], in weight's dtype: decode_reduce_kernel then tma_linear_parts, in one launch.
    Rows 1..MAX_REDUCE_ROWS; each K-slice a power-of-two count of whole heads. config's block_k
    is the slice's width (the whole slice's weight in one tile, loaded before the PDL wait) or
    one head (a K step a head); by default reduce_config. split_chunk (a power of two): splits
    combined at a time, by default as many as keep the chunk within REDUCE_TILE values."""
    problem = reduce_input_problem(splits, weight, parts)
    if problem:
        raise ValueError(problem)
    cfg = config or reduce_config(splits, weight, parts)
    m, heads, dim = splits.rows, splits.heads, splits.head_dim
    slice_heads = heads // parts
    if cfg.block_k not in (dim, slice_heads * dim):
        raise ValueError(
            f"tma_reduce_linear: block_k must be the head dim ({dim}) or the slice's width "
            f"({slice_heads * dim}), got {cfg.block_k}"
        )
    rows = triton.next_power_of_2(m)
    # [rows, slice heads, chunk, head_dim] fp32 values a chunk: at most REDUCE_TILE
    chunk = split_chunk or max(1, REDUCE_TILE // (rows * slice_heads * dim))
    chunk = min(chunk, triton.next_power_of_2(splits.splits))
    out = torch.empty((parts, m, weight.shape[0]), dtype=weight.dtype, device=weight.device)
    w_desc = TensorDescriptor.from_tensor(weight, block_shape=[cfg.block_n, cfg.block_k])
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    n = weight.shape[0]
    tma_reduce_gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        splits.part_o, splits.part_lse, splits.context_len, w_desc, out, m, n, heads,
        splits.splits, splits.split_len, out.stride(0), out.stride(1),
        ROWS=rows, BLOCK_M=max(16, rows), BLOCK_N=cfg.block_n, HEAD_DIM=dim,
        SLICE_HEADS=slice_heads, SPLIT_CHUNK=chunk, SEQ_SPLIT=splits.seq_split, TILE=splits.tile,
        WHOLE=cfg.block_k == slice_heads * dim,
        UPCAST=interpret and weight.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **gemv_launch(weight.device, m),
    )  # fmt: skip
    return out
