"""FP8 (e4m3) linear layers on the GPU: activation quantization and the scaled GEMMs.

`fp8_linear(x, w, w_scale, ...)` computes x @ dequant(w).T + bias for the layouts inferx-quant
loads: weight scales per output row ([N]: per channel, or a per-tensor scale repeated over its
part's rows) or per block ([ceil(N/bn), ceil(K/bk)], DeepSeek-V3 / Qwen3-FP8 style, with
activations quantized per token per group of bk columns); activations quantized per token
(dynamic), per tensor (dynamic or a static input_scale), or not at all (weight-only).

Three GEMMs:
- `tma_fp8_gemm` (tma_gemv.tma_fp8_linear_parts) for per-row weight scales at decode sizes on
  Hopper: the weight (and x) read through TMA tensor descriptors, e4m3 x e4m3 on tensor cores
  (weight-only: the weight tile cast to x's dtype in registers), both scales and the bias in
  the epilogue, K split into parts summed by split_sum_kernel;
- `torch._scaled_mm` (cuBLASLt) for per-row weight scales with quantized activations: row-wise
  scales on both sides, the bias in its epilogue;
- `fp8_gemm_kernel`, a Triton GEMM for every layout: the e4m3 tiles go to tensor cores as they
  are (or, weight-only, the weight tile is cast to the activations' dtype), accumulation in
  fp32; per-row scales multiply the accumulator once at the end, block scales each K tile
  (BLOCK_K divides the block's bk). For few rows it splits K over programs so that a decode
  step's GEMM reads the weight with enough SMs, and sums the [SPLIT_K, M, N] fp32 partials in a
  second launch (deterministic, no atomics, no host sync: graph-capturable).

Which runs for per-row layouts is `pick_gemm`'s rule (`gemm="auto"`), from
benchmarks/fp8_gemm.py (docs/BENCHMARKS.md); `gemm` ("tma", "triton", "cublas") forces one.
Block-scaled weights always take the Triton kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from inferx_kernels_cuda.pdl import pdl_enabled, pdl_start

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
_SMS = 132


def _tma_gemv():  # noqa: ANN202
    """inferx_kernels_cuda.tma_gemv, imported at first use: it imports fused_kernels, which
    imports this module."""
    from inferx_kernels_cuda import tma_gemv

    return tma_gemv


# Rows up to which auto takes the TMA decode GEMM (pick_gemm) on a Hopper or newer GPU.
TMA_MAX_ROWS = 64


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _to_e4m3(v, HAND_ROUND: tl.constexpr):
    """v (fp32, within +-448) rounded to e4m3, nearest with ties to even. The GPU's cast does
    it; Triton's interpreter drops the carry when the mantissa rounds up into the next binade
    (-127.46 -> -64), so there the rounding is done by hand and the cast gets exact values."""
    if HAND_ROUND:
        a = tl.abs(v)
        exp = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = tl.exp2((tl.maximum(exp, -6) - 3).to(tl.float32))  # e4m3: 3 mantissa bits
        t = a / step
        f = tl.floor(t)
        d = t - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f) * step
        v = tl.where(v < 0, -r, r)
    return v


@triton.jit
def quant_rows_kernel(
    x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, HAND_ROUND: tl.constexpr,
    TRIGGER: tl.constexpr = False,
):  # fmt: skip
    """One program per row. GROUP > 0: a scale per GROUP columns (BLOCK == GROUP); GROUP == 0:
    one scale for the row (two passes over it); STATIC: the scale is *static_ptr. TRIGGER: the
    GEMM after it may launch now (inferx_kernels_cuda.pdl)."""
    pdl_start(False, TRIGGER)
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    cols = tl.arange(0, BLOCK)
    if GROUP > 0 and not STATIC:
        for k0 in range(0, K, BLOCK):
            m = k0 + cols < K
            x = tl.load(x_row + k0 + cols, mask=m, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1.0 / (448.0 * 512.0))
            q = _to_e4m3(tl.clamp(x / scale, -448.0, 448.0), HAND_ROUND)
            tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=m)
            tl.store(s_ptr + row * stride_s + k0 // BLOCK, scale)
    else:  # one scale for the row: the static one, or from a first pass for its absmax
        if STATIC:
            scale = tl.load(static_ptr)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                m = k0 + cols < K
                x = tl.load(x_row + k0 + cols, mask=m, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1.0 / (448.0 * 512.0))
        for k0 in range(0, K, BLOCK):
            m = k0 + cols < K
            x = tl.load(x_row + k0 + cols, mask=m, other=0.0).to(tl.float32)
            q = _to_e4m3(tl.clamp(x / scale, -448.0, 448.0), HAND_ROUND)
            tl.store(q_row + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=m)
        if not STATIC:
            tl.store(s_ptr + row * stride_s, scale)


def quantize_rows(
    x: torch.Tensor,
    group: int = 0,
    static_scale: torch.Tensor | None = None,
    trigger: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales): [M, 1] per token (group 0), [M, ceil(K /
    group)] per token per group, or the static [1, 1] scale given. Scales are absmax / 448, at
    least 1 / (448 * 512), as inferx_quant.fp8.quantize_activations computes them. trigger:
    the GEMM after it may launch now (it then launches with PDL)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    if static_scale is not None:
        scale = static_scale.reshape(1, 1).float()
        block, stride_s = 1024, 0
    elif group:
        scale = torch.empty((m, triton.cdiv(k, group)), dtype=torch.float32, device=x.device)
        block, stride_s = group, scale.stride(0)
    else:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        block, stride_s = min(triton.next_power_of_2(k), 4096), 1
    if m:
        quant_rows_kernel[(m,)](
            x, q, scale, scale, k, x.stride(0), q.stride(0), stride_s,
            GROUP=group if static_scale is None else 0, STATIC=static_scale is not None,
            BLOCK=block, HAND_ROUND=_interpreting(), TRIGGER=trigger,
            num_warps=4 if block <= 1024 else 8,
        )  # fmt: skip
    return q, scale


@triton.jit
def fp8_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, k_per_split,
    stride_am, stride_bn, stride_cs, stride_cm,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    B_ROWS: tl.constexpr, GROUP_K: tl.constexpr, A_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c = (a * a_scale) @ (b * b_scale).T (+ bias). a [M, K] e4m3 (A_SCALED) or half
    precision (weight-only), b [N, K] e4m3. Scales: a's at as_ptr[m * stride_asm + (k //
    GROUP_K) * stride_ask] (strides 0 where a scale is shared), b's at bs_ptr[(n // B_ROWS) *
    stride_bsn + (k // GROUP_K) * stride_bsk]. GROUP_K == 0: scales do not vary along K and
    multiply the accumulator once; else each BLOCK_K tile (BLOCK_K divides GROUP_K).
    PARTIAL: program_id(2)'s K range goes to c[split] as fp32, unscaled by nothing more."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_start + rk)[None, :]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + (k_start + rk)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = k0 + rk < k_end
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong; fp32 operands are exact
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        elif not A_SCALED:
            b = b.to(a.dtype)
        part = tl.dot(a, b)
        if GROUP_K > 0:
            g = k0 // GROUP_K
            b_s = tl.load(bs_ptr + (rn // B_ROWS) * stride_bsn + g * stride_bsk, mask=n_ok)
            if A_SCALED:
                a_s = tl.load(as_ptr + rm * stride_asm + g * stride_ask, mask=m_ok)
                part = part * a_s[:, None]
            acc += part * b_s[None, :]
        else:
            acc += part
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if GROUP_K == 0:
        b_s = tl.load(bs_ptr + (rn // B_ROWS) * stride_bsn, mask=n_ok)
        acc = acc * b_s[None, :]
        if A_SCALED:
            a_s = tl.load(as_ptr + rm * stride_asm, mask=m_ok)
            acc = acc * a_s[:, None]
    c_ptrs = c_ptr + split * stride_cs + rm[:, None] * stride_cm + rn[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIAL:
        tl.store(c_ptrs, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def split_sum_kernel(
    p_ptr, bias_ptr, c_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """c = sum over splits of p [SPLIT_K, M*N] (fp32, in split order) + bias, cast once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=ok)


def _tiles(m: int, n: int, k: int, group_k: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split_k, num_warps, num_stages) for an [m, k] x [n, k] GEMM."""
    block_k = 128 if not group_k else min(128, group_k)
    if m <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        block_m, block_n, warps, stages = 64, 64, 4, 4
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 3
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    split = 1
    if tiles < _SMS:  # few output tiles: spread K over more programs, >= 4 K tiles each
        split = max(1, min(2 * _SMS // tiles, k_blocks // 4, 16))
    return block_m, block_n, block_k, split, warps, stages


def triton_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """a [M, K] (e4m3 with a_scale [M, 1], [1, 1] or [M, ceil(K/bk)]; or half precision with
    a_scale None), w [N, K] e4m3 with w_scale [N] or, with block=(bn, bk), [ceil(N/bn),
    ceil(K/bk)]. Returns [M, N] in out_dtype."""
    m, k = a.shape
    n = w.shape[0]
    group_k = block[1] if block else 0
    if a_scale is not None and a_scale.shape[1] > 1 and not group_k:
        raise ValueError("activation scales per group need block weight scales")
    bm, bn, bk, split, warps, stages = _tiles(m, n, k, group_k)
    # each split's K range starts on a tile boundary (so k0 // GROUP_K is its tiles' group)
    per = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, per)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    partial = split > 1
    c = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if partial else out
    dummy = w_scale
    asc = a_scale if a_scale is not None else dummy
    asm = a_scale.stride(0) if a_scale is not None and a_scale.shape[0] > 1 else 0
    ask = a_scale.stride(1) if a_scale is not None and a_scale.shape[1] > 1 else 0
    if block:
        b_rows, bsn, bsk = block[0], w_scale.stride(0), w_scale.stride(1)
    else:
        b_rows, bsn, bsk = 1, w_scale.stride(0), 0
    interpret = _interpreting()
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    fp8_gemm_kernel[grid](
        a, asc, w, w_scale, bias if bias is not None else dummy, c, m, n, k, per,
        a.stride(0), w.stride(0), c.stride(0) if partial else 0, c.stride(-2),
        asm, ask, bsn, bsk,
        B_ROWS=b_rows, GROUP_K=group_k, A_SCALED=a_scale is not None,
        HAS_BIAS=bias is not None, PARTIAL=partial,
        UPCAST=interpret and a_scale is None and a.dtype == torch.bfloat16,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if partial:
        _split_sum(c, bias, out)
    return out


def _split_sum(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [M, N] = the sum of parts [S, M, N] (fp32) + bias, by split_sum_kernel."""
    m, n = out.shape
    block = 1024
    split_sum_kernel[(triton.cdiv(m * n, block),)](
        parts, bias if bias is not None else parts, out, m * n, n,
        SPLIT_K=parts.shape[0], HAS_BIAS=bias is not None, BLOCK=block,
    )  # fmt: skip


def cublas_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: a [M, K] e4m3 with a_scale [M, 1] or [1, 1], w
    [N, K] e4m3 with w_scale [N]."""
    m = a.shape[0]
    scale_a = a_scale.expand(m, 1).contiguous() if a_scale.shape[0] != m else a_scale
    return torch._scaled_mm(
        a,
        w.t(),
        scale_a=scale_a,
        scale_b=w_scale.reshape(1, -1),
        bias=bias,
        out_dtype=out_dtype,
    )


def tma_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    slices: int | None = None,
    parts: bool = False,
    trigger: bool = False,
) -> torch.Tensor:
    """tma_gemv.tma_fp8_linear_parts: a [M <= its MAX_ROWS, K] e4m3 with a_scale [M, 1] or
    [1, 1], or half precision with a_scale None (weight-only); w [N, K] e4m3 with w_scale [N].
    K in tma_gemv.fp8_parts slices (or `slices`). parts: the [S, M, N] slices in out_dtype,
    the bias in slice 0, for a caller that sums them anyway; else one [M, N] result, more than
    one slice kept in fp32 and summed with the bias by split_sum_kernel. trigger: the kernel
    after the GEMM may launch early (PDL; not after a split_sum_kernel)."""
    tma_gemv = _tma_gemv()
    m, k = a.shape
    n = w.shape[0]
    sms = _SMS if _interpreting() else _num_sms(a.device)
    slices = slices or tma_gemv.fp8_parts(n, k, m, sms)
    elem = 1 if a_scale is not None else a.element_size()
    cfg = tma_gemv.plain_config(n, slices, sms, m, False, elem)
    if parts or slices == 1:
        out = tma_gemv.tma_fp8_linear_parts(
            a, a_scale, w, w_scale, bias, slices, cfg, out_dtype, trigger=trigger
        )
        return out if parts else out[0]
    p = tma_gemv.tma_fp8_linear_parts(a, a_scale, w, w_scale, None, slices, cfg, torch.float32)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    _split_sum(p, bias, out)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def tma_readable(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
                 w_scale: torch.Tensor) -> bool:  # fmt: skip
    """Whether tma_fp8_gemm runs here: a Hopper or newer GPU (TMA descriptors, as TritonOps'
    TMA GEMMs) and inputs it can read (tma_gemv.fp8_input_problem)."""
    if not (a.is_cuda and _capability(a.device)[0] >= 9):
        return False
    return _tma_gemv().fp8_input_problem(a, a_scale, w, w_scale) is None


def pick_gemm(m: int, n: int, k: int, tma: bool = False) -> str:
    """auto's GEMM for per-row layouts (benchmarks/fp8_gemm.py): the TMA decode GEMM at up to
    TMA_MAX_ROWS rows where it can read the inputs (`tma`: tma_readable); else the Triton
    kernel to 16 rows and cuBLASLt past them (weight-only: the Triton kernel, cuBLASLt takes
    no half-precision x with e4m3 weights)."""
    if tma and m <= TMA_MAX_ROWS:
        return "tma"
    return "triton" if m <= 16 else "cublas"


def fp8_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    activations: str = "token",
    block: tuple[int, int] | None = None,
    input_scale: torch.Tensor | None = None,
    gemm: str = "auto",
    parts: bool = False,
    trigger: bool = False,
) -> torch.Tensor:
    """x [M, K] in half precision -> x @ dequant(w).T + bias, [M, N] in x's dtype.
    activations: token / tensor (dynamic), static (input_scale), group (per token per block[1]
    columns; block weights), none (weight-only). parts: [S, M, N] K-slice parts that sum to
    it, the bias in part 0 (QuantLinear.forward_parts' form): S > 1 where the TMA GEMM splits
    K, else the result as one part. trigger: the kernel after the GEMM may launch early (PDL,
    where the TMA GEMM runs); the quantization kernel lets the GEMM launch early where PDL is
    on."""
    if activations == "none":
        if block is not None:
            return _as_parts(triton_fp8_gemm(x, None, w, w_scale, bias, x.dtype, block), parts)
        return _per_row(x, None, w, w_scale, bias, x.dtype, gemm, parts, trigger)
    early = pdl_enabled(x.device)
    if activations == "group":
        if block is None:
            raise ValueError("group activation scales come with block weight scales")
        xq, xs = quantize_rows(x, group=block[1])
    elif activations == "static":
        xq, xs = quantize_rows(x, static_scale=input_scale, trigger=early)
    elif activations == "tensor":
        xs = (x.abs().amax().float() / FP8_MAX).clamp(min=MIN_SCALE).reshape(1, 1)
        xq, _ = quantize_rows(x, static_scale=xs, trigger=early)
    else:
        xq, xs = quantize_rows(x, trigger=early)
    return fp8_scaled_linear(xq, xs, w, w_scale, bias, x.dtype, block, gemm, parts, trigger)


def fp8_scaled_linear(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    block: tuple[int, int] | None = None,
    gemm: str = "auto",
    parts: bool = False,
    trigger: bool = False,
) -> torch.Tensor:
    """fp8_linear's GEMM for activations already quantized: xq [M, K] e4m3 with xs [M, 1] or
    [1, 1] (per-row weight scales), or [M, ceil(K / block[1])] (block weight scales); from
    quantize_rows or a norm / activation kernel that quantized as it wrote (fp8_act)."""
    if block is not None:
        if xs.shape[1] == 1 and triton.cdiv(xq.shape[1], block[1]) > 1:
            raise ValueError("block weight scales take group activation scales")
        return _as_parts(triton_fp8_gemm(xq, xs, w, w_scale, bias, out_dtype, block), parts)
    if xs.shape[1] != 1:
        raise ValueError("activation scales per group need block weight scales")
    return _per_row(xq, xs, w, w_scale, bias, out_dtype, gemm, parts, trigger)


def _as_parts(y: torch.Tensor, parts: bool) -> torch.Tensor:
    return y.unsqueeze(0) if parts else y


def _per_row(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    gemm: str,
    parts: bool,
    trigger: bool = False,
) -> torch.Tensor:
    """A per-row-scaled GEMM by pick_gemm's choice (or `gemm`'s): a e4m3 with a_scale, or half
    precision with a_scale None (weight-only: the TMA GEMM or the Triton kernel). trigger:
    the TMA GEMM's (tma_fp8_gemm)."""
    if gemm not in ("auto", "tma", "triton", "cublas"):
        raise ValueError(f"gemm {gemm!r}: expected auto, tma, triton or cublas")
    n, k = w.shape
    choice = gemm
    if gemm == "auto":
        choice = pick_gemm(a.shape[0], n, k, tma_readable(a, a_scale, w, w_scale))
    if choice == "tma":
        return tma_fp8_gemm(a, a_scale, w, w_scale, bias, out_dtype, parts=parts, trigger=trigger)
    # cuBLASLt's rule: 16-aligned sizes, e4m3 on both sides
    if choice == "cublas" and a_scale is not None and a.is_cuda and n % 16 == 0 and k % 16 == 0:
        return _as_parts(cublas_fp8_gemm(a, a_scale, w, w_scale, bias, out_dtype), parts)
    return _as_parts(triton_fp8_gemm(a, a_scale, w, w_scale, bias, out_dtype), parts)
