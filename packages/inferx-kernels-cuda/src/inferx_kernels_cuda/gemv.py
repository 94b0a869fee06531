"""Skinny GEMM for decode: y = x @ W.T + b with 1..64 rows of x, streaming each weight byte once.

At batch-1 decode cuBLAS runs the small projections (QKV, o_proj: 8-10 MB of weights) well
short of the GPU's memory bandwidth. `skinny_linear` is a split-K / wide-N Triton GEMV: a program
owns BLOCK_N output columns (rows of W, which is [N, K] row-major as nn.Linear keeps it) and one
of SPLIT_K contiguous ranges of K, and reads that [BLOCK_N, K / SPLIT_K] slab of W exactly once,
BLOCK_K columns at a time, with every row of x against it. Accumulation is fp32 either way:

- the FMA path (use_dot=False) multiplies the [BLOCK_M, 1, BLOCK_K] x tile into a
  [BLOCK_M, BLOCK_N, BLOCK_K] accumulator and reduces over K once at the end (no cross-thread
  reduction per step: the classic GEMV), BLOCK_M = the next power of two of M;
- the dot path (use_dot=True) pads x to 16 rows (or the next power of two past 16, up to 64)
  and runs tl.dot on tensor cores; the padding costs nothing a memory-bound kernel would
  notice. The FMA path takes at most 16 rows (MAX_FMA_ROWS), the dot path 64 (MAX_ROWS).

prefetch=True issues the next K block's loads before the current block's products, so each
program keeps two blocks of W in flight. Triton pipelines only loads that feed tl.dot
(num_stages), so without it the FMA path waits on every block in turn.

SPLIT_K == 1 adds the bias and stores in x's dtype: one launch. SPLIT_K > 1 stores fp32 partial
sums in a [SPLIT_K, M, N] workspace and a second kernel sums them in split order, adds the bias
and casts: two launches, deterministic (no atomics), no host sync, all sizes given by the shapes,
so the call can be captured in a CUDA graph. Rounding matches F.linear's: one rounding of the
fp32 sum plus fp32 bias to the output dtype.

gated=True takes a fused gate_up weight and returns silu(gate) * up: each program's weight rows
are half gate rows and their up rows, and the activation runs in the epilogue (or in the split
reduce), so the decode step's SiLU-and-mul launch and its [M, 2I] intermediate go away.

Only the gated form is wired in (TritonOps.linear_silu_and_mul, steps of 5-32 rows, hidden size
at most 2048), where it measured faster than cuBLAS plus silu_and_mul; plain projections
stay on cuBLAS, which this kernel does not beat (benchmarks/bench_gemv.py, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from inferx_kernels_cuda.fused_kernels import _rounded, silu_times
from inferx_kernels_cuda.pdl import pdl_start

MAX_ROWS = 64
MAX_FMA_ROWS = 16
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Columns per program of the split reduce: small, so that a 2048-wide output still spreads over
# several SMs (the reduce reads only SPLIT_K * M * N * 4 bytes).
_REDUCE_BLOCK = 256
_H200_SMS = 132


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of `skinny_linear`: tile sizes, K split count, FMA or tensor-core path,
    and Triton's num_warps / num_stages."""

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    use_dot: bool = False
    num_warps: int = 4
    num_stages: int = 1
    prefetch: bool = False

    def __str__(self) -> str:
        path = "dot" if self.use_dot else "fma"
        return (
            f"{path} n{self.block_n} k{self.block_k} s{self.split_k} "
            f"w{self.num_warps} st{self.num_stages}" + (" pf" if self.prefetch else "")
        )

    def check(self) -> None:
        """Raise ValueError unless the sizes are ones the kernel accepts."""
        least = 16 if self.use_dot else 1  # tl.dot needs every dim >= 16
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < least or v & (v - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two >= {least}, got {v}")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"GemvConfig: split_k, num_warps, num_stages must be >= 1: {self}")


def split_for(blocks_n: int, k: int, block_k: int, num_sms: int = _H200_SMS) -> int:
    """The K split count: the smallest power of two that gives at least two programs per SM,
    stopping before a split would hold fewer than two BLOCK_K steps. 1 when N alone fills the
    GPU. (A guess: two programs per SM to cover the tail of the grid, and splits long enough
    for the loop to keep loads in flight; tune with benchmarks/bench_gemv.py.)"""
    split = 1
    while blocks_n * split < 2 * num_sms and k >= 4 * block_k * split:
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, num_sms: int = _H200_SMS) -> GemvConfig:
    """A default config for an [m, k] x [n, k]^T product (guesses, to be tuned on the GPU).

    Up to 4 rows the FMA path with 4096 accumulators per program (16 x 256 weights at one row,
    halved per doubling of the rows): compiled for sm_90 (triton 3.9, 4 warps) that is 56-80
    registers a thread and no spills, where 8192 took 112-220 and 4 rows x 32 x 256 spilled.
    From 5 rows the tensor-core path, 64 x 128 weight tiles, 3 stages (72 registers). The split
    from `split_for`. num_stages does nothing on the FMA path (triton pipelines only loads that
    feed tl.dot: the same PTX at 1-4 stages), so it stays 1 there.
    """
    rows = triton.next_power_of_2(max(m, 1))
    if m <= 4:
        cfg = GemvConfig(block_n=max(1, 16 // rows), block_k=256, use_dot=False, num_stages=1)
    else:
        cfg = GemvConfig(block_n=64, block_k=128, use_dot=True, num_stages=3)
    return replace(cfg, split_k=split_for(triton.cdiv(n, cfg.block_n), k, cfg.block_k, num_sms))


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _accumulate(
    acc, x, w, USE_DOT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr
):
    """acc + (x [BLOCK_M, BLOCK_K]) times (w [BLOCK_N, BLOCK_K]) transposed, in fp32: into
    [BLOCK_M, BLOCK_N] by tl.dot, or elementwise into [BLOCK_M, BLOCK_N, BLOCK_K] (FMA path)."""
    # One return at the end: the compiler (not the interpreter) would also build the FMA
    # expression after an early return inside a constexpr if, with the dot path's shapes.
    if USE_DOT:
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = acc + tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    else:
        acc = acc + x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit(do_not_specialize=["m"])
def skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_wn,
    stride_out_split,
    stride_om,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    SPLIT: tl.constexpr,
    GATED: tl.constexpr,
):
    """Grid (column blocks, splits): out[split] = x[:, ks] @ W[ns, ks].T (+ bias), columns
    ns = BLOCK_N of them, ks = this split's [k_start, k_start + k_per_split) clipped to k.
    k_per_split is a multiple of BLOCK_K, so only a K not a multiple of BLOCK_K leaves a partial
    block, in the last split: whole blocks load unmasked, that one tail block masked.

    GATED: W is gate rows then up rows (n of them in all) and the output is
    silu(gate) * up, n / 2 columns. A program's BLOCK_N weight rows are BLOCK_N / 2 gate rows
    and their up rows, interleaved, so the epilogue splits its tile into the two halves.
    Split partials keep W's row order ([split, m, n]) for split_k_reduce_kernel's epilogue."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if GATED:
        local = tl.arange(0, BLOCK_N)
        cols = pid_n * (BLOCK_N // 2) + local // 2  # output columns, each twice
        offs_n = cols % (n // 2) + (local % 2) * (n // 2)  # gate row, then its up row
        n_valid = cols < n // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_valid = offs_n < n
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past m and n read a real row again instead of being masked: whole-block loads stay
    # unmasked, and those rows' results are never stored.
    rows_x = offs_m % m
    rows_w = (offs_n % n).to(tl.int64)
    k_start = pid_k * k_per_split
    # 0 for a split that starts past k (more splits than K blocks): it stores zeros.
    k_len = tl.maximum(tl.minimum(k_per_split, k - k_start), 0)
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    full = k_len // BLOCK_K
    if PREFETCH:
        # Block j + 1 is loaded before block j's products. Block 0 loads as zeros when there
        # is no whole block, and the last whole block is accumulated after the loop.
        # (A scalar `full > 0` mask is an int under the interpreter, not a mask.)
        first = offs_k[None, :] < BLOCK_K * tl.minimum(full, 1)
        x = tl.load(x_ptrs, mask=first, other=0.0)
        w = tl.load(w_ptrs, mask=first, other=0.0)
        for _ in range(0, full - 1):
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
            x_next = tl.load(x_ptrs)
            w_next = tl.load(w_ptrs)
            acc = _accumulate(acc, x, w, USE_DOT, UPCAST, DOT_PRECISION)
            x = x_next
            w = w_next
        acc = _accumulate(acc, x, w, USE_DOT, UPCAST, DOT_PRECISION)
        x_ptrs += BLOCK_K * tl.minimum(full, 1)  # past the last whole block, to the tail
        w_ptrs += BLOCK_K * tl.minimum(full, 1)
    else:
        for _ in range(0, full):
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
            acc = _accumulate(acc, x, w, USE_DOT, UPCAST, DOT_PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    if full * BLOCK_K < k_len:
        k_mask = (full * BLOCK_K + offs_k)[None, :] < k_len
        x = tl.load(x_ptrs, mask=k_mask, other=0.0)
        w = tl.load(w_ptrs, mask=k_mask, other=0.0)
        acc = _accumulate(acc, x, w, USE_DOT, UPCAST, DOT_PRECISION)
    if not USE_DOT:
        acc = tl.sum(acc, axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    if GATED and not SPLIT:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        half = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + offs_m[:, None] * stride_om + half[None, :]
        mask = (offs_m[:, None] < m) & (half[None, :] < n // 2)
        tl.store(out, _silu_mul(gate, up, out_ptr.dtype.element_ty), mask=mask)
    else:
        out = out_ptr + pid_k * stride_out_split + offs_m[:, None] * stride_om + offs_n[None, :]
        mask = (offs_m[:, None] < m) & n_valid[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up in DTYPE from fp32 sums, rounded as the unfused path rounds: the GEMM's
    outputs to DTYPE, then silu_and_mul_kernel's arithmetic."""
    return silu_times(_rounded(gate, DTYPE), _rounded(up, DTYPE), DTYPE).to(DTYPE)


@triton.jit
def _split_sum(partial_ptr, bias_ptr, row, cols, mask, m, n, split_k, HAS_BIAS: tl.constexpr):
    """Columns `cols` of partial row `row` summed over the splits in order (+ bias), fp32."""
    acc = tl.zeros_like(cols).to(tl.float32)
    for s in range(0, split_k):
        acc += tl.load(partial_ptr + (s * m + row) * n + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit(do_not_specialize=["m", "split_k"])
def split_k_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    split_k,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    GATED: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
):
    """Grid (rows, column blocks): out[row] = sum over splits of partial[split, row] (+ bias),
    summed in fp32 in split order, rounded once to out's dtype. partial is [split_k, m, n].
    GATED: out's n / 2 columns are silu(gate) * up of the sums' two halves. PDL, TRIGGER:
    pdl.pdl_start at the start, before any load (w4a16.w4a16_linear's reduce)."""
    pdl_start(PDL, TRIGGER)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    if GATED:
        mask = cols < n // 2
        gate = _split_sum(partial_ptr, bias_ptr, row, cols, mask, m, n, split_k, HAS_BIAS)
        up = _split_sum(partial_ptr, bias_ptr, row, cols + n // 2, mask, m, n, split_k, HAS_BIAS)
        tl.store(out_ptr + row * stride_om + cols, _silu_mul(gate, up, dtype), mask=mask)
    else:
        mask = cols < n
        acc = _split_sum(partial_ptr, bias_ptr, row, cols, mask, m, n, split_k, HAS_BIAS)
        tl.store(out_ptr + row * stride_om + cols, acc.to(dtype), mask=mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"skinny_linear: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(
            f"skinny_linear: x has {x.shape[0]} rows; it handles at most {MAX_ROWS} (use "
            "F.linear for more)"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear: x is {tuple(x.shape)} but weight is {tuple(weight.shape)}; "
            "their last dims (K) must agree"
        )
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"skinny_linear: x and weight must share a dtype of float16, bfloat16 or float32, "
            f"got {x.dtype} and {weight.dtype}"
        )
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(
            "skinny_linear: x and weight need a contiguous K dim (any row stride is fine); "
            f"strides are {x.stride()} and {weight.stride()}"
        )
    if bias is not None and (
        bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1
    ):
        raise ValueError(
            f"skinny_linear: bias must be a contiguous ({weight.shape[0]},) {x.dtype} tensor, "
            f"got {tuple(bias.shape)} {bias.dtype} with strides {bias.stride()}"
        )
    devices = {t.device for t in (x, weight, bias) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"skinny_linear: inputs are on different devices: {devices}")
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"skinny_linear: runs on CUDA tensors (or anywhere under TRITON_INTERPRET=1), got "
            f"{x.device}"
        )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] with M <= 64 (16 on the FMA path): [M, N] in
    x's dtype.

    weight is [N, K] as nn.Linear holds it; x and weight need a unit stride along K (row strides
    are free, so row slices of a fused weight work). config defaults to pick_config(M, N, K).
    One launch, or two with config.split_k > 1; no host sync.

    gated: weight is a fused gate_up ([2I, K], gate rows first) and the result is
    silu(gate) * up, [M, I], as `silu_and_mul(F.linear(x, weight, bias))` rounds it, with no
    [M, 2I] tensor in between. config.block_n counts weight rows (gate and up) per program.
    """
    _check_inputs(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    if gated and n % 2:
        raise ValueError(f"skinny_linear: gated needs gate and up rows (an even N), got {n}")
    n_out = n // 2 if gated else n
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or pick_config(m, n, k, _num_sms(x.device))
    cfg.check()
    if not cfg.use_dot and m > MAX_FMA_ROWS:
        raise ValueError(
            f"skinny_linear: the FMA path takes at most {MAX_FMA_ROWS} rows, x has {m}: {cfg}"
        )
    if gated and cfg.block_n < 2:
        raise ValueError(f"skinny_linear: gated needs block_n >= 2 (gate and up rows): {cfg}")
    block_m = max(16, triton.next_power_of_2(m)) if cfg.use_dot else triton.next_power_of_2(m)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    split = cfg.split_k > 1
    consts = {
        "BLOCK_M": block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "USE_DOT": cfg.use_dot,
        # bf16 tl.dot is wrong under the interpreter only; there operands go to fp32 first.
        "UPCAST": interpret and x.dtype == torch.bfloat16,
        "DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "PREFETCH": cfg.prefetch,
        "SPLIT": split,
        "GATED": gated,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    # A gated program's block_n weight rows are block_n / 2 output columns: the same grid.
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    # The dummy pointer for an absent bias is never read: HAS_BIAS=False compiles it away.
    bias_arg = bias if bias is not None else weight
    if not split:
        skinny_linear_kernel[grid](
            x,
            weight,
            bias_arg,
            out,
            m,
            n,
            k,
            x.stride(0),
            weight.stride(0),
            0,
            out.stride(0),
            k_per_split,
            HAS_BIAS=bias is not None,
            **consts,
        )
        return out
    partial = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    skinny_linear_kernel[grid](
        x,
        weight,
        bias_arg,
        partial,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        partial.stride(0),
        partial.stride(1),
        k_per_split,
        HAS_BIAS=False,
        **consts,
    )
    split_k_reduce_kernel[(m, triton.cdiv(n_out, _REDUCE_BLOCK))](
        partial,
        bias_arg,
        out,
        m,
        n,
        cfg.split_k,
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK=_REDUCE_BLOCK,
        GATED=gated,
        num_warps=2,
    )
    return out
