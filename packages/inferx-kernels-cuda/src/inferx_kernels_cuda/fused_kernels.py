"""Triton kernels for the small fused ops between GEMMs: add + RMSNorm, SiLU-and-mul, rotary.

Each kernel reproduces the rounding points of the torch reference (inferx_core.ops_torch): values
are widened to fp32 for arithmetic and rounded back to the input dtype wherever torch would have
materialised a tensor of that dtype. In fp32 the roundings are no-ops; in fp16/bf16 they make the
result match torch's to the last bit or one ulp, instead of drifting by the extra precision that
keeping fp32 throughout would give. No kernel here calls tl.dot, so bf16 is safe under the
interpreter too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inferx_kernels_cuda.fp8_gemm import _to_e4m3
from inferx_kernels_cuda.pdl import pdl_start


@triton.jit
def _rounded(x, DTYPE: tl.constexpr):
    """x (fp32) rounded to DTYPE and widened again: a torch op's output in DTYPE."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def silu_times(gate, up, DTYPE: tl.constexpr):
    """silu(gate) * up in fp32 from gate and up in fp32, silu rounded to DTYPE before the
    product as torch rounds it. Shared with gemv's gated epilogue."""
    return _rounded(gate / (1.0 + tl.exp(-gate)), DTYPE) * up


@triton.jit
def norm_row(
    x_ptr, residual_ptr, residual_out_ptr, w, row, cols, mask, stride_x, stride_residual,
    stride_residual_out, stride_part, n_cols, eps, HAS_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
):  # fmt: skip
    """rms_norm_kernel's row: its parts summed, the residual added (and stored), normalised,
    times the weight w (fp32, loaded by the caller); fp32, not yet rounded to the output."""
    dtype = x_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:
        for p in tl.static_range(1, PARTS):
            part = tl.load(x_ptr + p * stride_part + row * stride_x + cols, mask=mask, other=0.0)
            h += part.to(tl.float32)
        h = _rounded(h, dtype)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        h = _rounded(h + r.to(tl.float32), dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, h.to(dtype), mask=mask)
    # Masked columns load as 0 and add nothing to the sum of squares.
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    normed = _rounded(h * rstd, dtype)
    return w * normed


# stride_part is rows x hidden, so it changes with the batch: not specialised on.
@triton.jit(do_not_specialize=["stride_part"])
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    stride_part,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
):
    """One program per row, the whole row in one tile (hidden sizes fit: BLOCK = next power of
    two). With a residual, writes x + residual (rounded to x's dtype) as the new residual and
    normalises that sum. PARTS > 1: x is that many partial results stride_part apart, summed
    in fp32 and rounded once (to what one GEMM would have written) before the residual.
    PDL (launched early, inferx_kernels_cuda.pdl): the norm weight is read before the wait,
    everything else after it. TRIGGER: the GEMV after it may launch now."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is loaded first: after the residual's store the compiler could not move its
    # load up (the pointers might alias), and it would start only after the row's sum.
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_start(PDL, TRIGGER)
    y = norm_row(
        x_ptr, residual_ptr, residual_out_ptr, w, row, cols, mask, stride_x, stride_residual,
        stride_residual_out, stride_part, n_cols, eps, HAS_RESIDUAL, PARTS,
    )  # fmt: skip
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n_cols,
    BLOCK: tl.constexpr,
    TRIGGER: tl.constexpr = False,
):
    """Grid (rows, column blocks): row r of x holds gate then up, n_cols each. TRIGGER
    (inferx_kernels_cuda.pdl): the GEMV after it (down_proj's W4A16 GEMV) may launch now."""
    pdl_start(False, TRIGGER)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, silu_times(gate, up, dtype).to(dtype), mask=mask)


@triton.jit
def embedding_kernel(
    ids_ptr, weight_ptr, out_ptr, stride_w, stride_out, hidden, BLOCK: tl.constexpr
):
    """Grid (rows, column blocks): out[r] = weight[ids[r]], BLOCK columns a program."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    token = tl.load(ids_ptr + row).to(tl.int64)
    values = tl.load(weight_ptr + token * stride_w + cols, mask=mask)
    tl.store(out_ptr + row * stride_out + cols, values, mask=mask)


@triton.jit
def rotate_into(
    src_ptr,
    stride_src_head,
    dst_ptr,
    stride_dst_head,
    num_heads,
    cos,
    sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    HAND_ROUND: tl.constexpr = False,
):
    """Rotate every head of one token, [num_heads, 2 * HALF] at src_ptr, into dst_ptr (which may
    be src_ptr), rounding like the reference in src's dtype and storing in dst's (KV_FP8: an
    e4m3 cache, see to_cache)."""
    dtype = src_ptr.dtype.element_ty
    d = tl.arange(0, HALF_PAD)[None, :]
    for h0 in range(0, num_heads, HEADS_BLOCK):
        h = h0 + tl.arange(0, HEADS_BLOCK)[:, None]
        mask = (h < num_heads) & (d < HALF)
        src = src_ptr + h * stride_src_head + d
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        # Each product and the sum are rounded like the separate torch ops they replace.
        lo = _rounded(x1 * cos, dtype) - _rounded(x2 * sin, dtype)
        hi = _rounded(x2 * cos, dtype) + _rounded(x1 * sin, dtype)
        dst = dst_ptr + h * stride_dst_head + d
        tl.store(dst, to_cache(lo.to(dtype), scale_ptr, dst_ptr, KV_FP8, HAND_ROUND), mask=mask)
        tl.store(
            dst + HALF, to_cache(hi.to(dtype), scale_ptr, dst_ptr, KV_FP8, HAND_ROUND), mask=mask
        )


@triton.jit
def to_cache(x, scale_ptr, cache_ptr, KV_FP8: tl.constexpr, HAND_ROUND: tl.constexpr):
    """x as a KV cache at cache_ptr stores it: cast to its dtype, or (KV_FP8, an e4m3 cache)
    x / *scale_ptr in fp32, clamped to +-448 and rounded to nearest e4m3 (HAND_ROUND: under
    the interpreter, see fp8_gemm._to_e4m3). The division is IEEE's, as torch's: Triton's `/`
    is the GPU's approximate one, a rounding boundary apart from the reference now and then."""
    if KV_FP8:
        x = tl.clamp(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)), -448.0, 448.0)
        x = _to_e4m3(x, HAND_ROUND)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos_sin,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
):
    """One program per token: its cos/sin row is read once and rotates all its q and k heads
    in place. q and k may be strided views (the head dim itself contiguous)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + d, mask=d < HALF, other=0.0)
    sin = tl.load(row + HALF + d, mask=d < HALF, other=0.0)
    # The reference casts the table to q's dtype before using it.
    dtype = q_ptr.dtype.element_ty
    cos = _rounded(cos, dtype)
    sin = _rounded(sin, dtype)
    q_row = q_ptr + t * stride_qt
    k_row = k_ptr + t * stride_kt
    rotate_into(q_row, stride_qh, q_row, stride_qh, num_q_heads, cos, sin, HALF, HALF_PAD,
                HEADS_BLOCK)  # fmt: skip
    rotate_into(k_row, stride_kh, k_row, stride_kh, num_k_heads, cos, sin, HALF, HALF_PAD,
                HEADS_BLOCK)  # fmt: skip


@triton.jit
def segment_argmax_kernel(
    x_ptr,
    seg_max_ptr,
    seg_arg_ptr,
    stride_x,
    n,
    BLOCK: tl.constexpr,
):
    """Grid (rows, segments of BLOCK columns): each segment's maximum (fp32) and the first
    column holding it, into [rows, segments] buffers for argmax_kernel."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    cols = s * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * stride_x + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    best = tl.max(x, 0)
    first = tl.min(tl.where(x == best, cols, n), 0)
    out = r * tl.num_programs(1) + s
    tl.store(seg_max_ptr + out, best)
    tl.store(seg_arg_ptr + out, first)


@triton.jit
def argmax_kernel(seg_max_ptr, seg_arg_ptr, out_ptr, segments, SEGMENTS_PAD: tl.constexpr):
    """One program per row: the first of its segments holding the row's maximum, and that
    segment's column (so the row's first maximum, as torch's argmax picks it)."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SEGMENTS_PAD)
    m = tl.load(seg_max_ptr + r * segments + s, mask=s < segments, other=float("-inf"))
    best = tl.max(m, 0)
    first = tl.min(tl.where(m == best, s, SEGMENTS_PAD), 0)
    tl.store(out_ptr + r, tl.load(seg_arg_ptr + r * segments + first).to(tl.int64))


@triton.jit
def _load_parts(src, stride_s, mask, PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """The sum of PARTS partial values (src, src + stride_s, ...) in fp32, rounded once to DTYPE
    (and widened back to fp32) as summed_parts rounds it; one part is loaded as it is."""
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, PARTS):
        x += tl.load(src + s * stride_s, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1:
        x = x.to(DTYPE).to(tl.float32)
    return x


@triton.jit
def _rotate_pairs(src, dst, cos, sin, mask, i, stride_s, PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """Rotate the interleaved pairs (2i, 2i + 1) at src (the sum of PARTS parts stride_s apart)
    into dst (pointers offset by the rows the caller broadcasts i against): in fp32, rounded
    once to DTYPE as rotate_interleaved."""
    even = _load_parts(src + 2 * i, stride_s, mask, PARTS, DTYPE)
    odd = _load_parts(src + 2 * i + 1, stride_s, mask, PARTS, DTYPE)
    tl.store(dst + 2 * i, (even * cos - odd * sin).to(DTYPE), mask=mask)
    tl.store(dst + 2 * i + 1, (even * sin + odd * cos).to(DTYPE), mask=mask)


@triton.jit
def mla_rope_norm_kernel(
    q_ptr, kv_ptr, weight_ptr, positions_ptr, cos_sin_ptr, q_out_ptr, k_out_ptr, stride_qs,
    stride_qt, stride_qh, stride_kvs, stride_kv, stride_cos_sin, stride_k_out, num_heads, eps,
    NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    RANK: tl.constexpr, RANK_PAD: tl.constexpr, HEADS_BLOCK: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """MLA's glue after its projections (KernelOps.mla_rope_norm). Grid (tokens, 1 + head
    blocks): program 0 of a token writes its k row (the latent RMS-normed, then the rope key
    rotated), each other one HEADS_BLOCK heads of q (the nope part copied, the rope part
    rotated) into the contiguous q_out [T, heads, NOPE + 2 * HALF]. q and kv may be strided
    views with a unit last stride, each PARTS partial sums (stride_qs, stride_kvs apart: the
    K-slices of the GEMM before) added up first. Rounds where the torch reference does."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + i, mask=i < HALF, other=0.0)
    sin = tl.load(row + HALF + i, mask=i < HALF, other=0.0)
    if g == 0:
        # (Names differ from the other branch's: Triton merges those defined in both.)
        c = tl.arange(0, RANK_PAD)
        in_rank = c < RANK
        w = tl.load(weight_ptr + c, mask=in_rank, other=0.0).to(tl.float32)
        kv_row = kv_ptr + t * stride_kv
        k_row = k_out_ptr + t * stride_k_out
        latent = _load_parts(kv_row + c, stride_kvs, in_rank, PARTS, dtype)
        # Masked columns load as 0 and add nothing to the sum of squares.
        rstd = tl.rsqrt(tl.sum(latent * latent, axis=0) / RANK + eps)
        tl.store(k_row + c, (w * _rounded(latent * rstd, dtype)).to(dtype), mask=in_rank)
        _rotate_pairs(kv_row + RANK, k_row + RANK, cos, sin, i < HALF, i, stride_kvs, PARTS,
                      dtype)  # fmt: skip
    else:
        head = (g - 1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)[:, None]
        src = q_ptr + t * stride_qt + head * stride_qh
        dst = q_out_ptr + (t * num_heads + head) * (NOPE + 2 * HALF)
        if NOPE > 0:
            d = tl.arange(0, NOPE_PAD)[None, :]
            in_nope = (head < num_heads) & (d < NOPE)
            if PARTS == 1:
                tl.store(dst + d, tl.load(src + d, mask=in_nope), mask=in_nope)
            else:
                nope = _load_parts(src + d, stride_qs, in_nope, PARTS, dtype)
                tl.store(dst + d, nope.to(dtype), mask=in_nope)
        in_rope = (head < num_heads) & (i[None, :] < HALF)
        _rotate_pairs(src + NOPE, dst + NOPE, cos[None, :], sin[None, :], in_rope, i[None, :],
                      stride_qs, PARTS, dtype)  # fmt: skip
