"""Triton MLA decode over the paged latent cache: the absorbed form of multi-head latent attention
(DeepSeek-V2), one program per (sequence, context split) holding all its query heads.

The cache of one MLA layer is [num_blocks, block_size, 1, RANK + ROPE] (TorchAttention's MLA
layout): a token's latent (RANK) then its rope key (ROPE), the row every head reads. A query row
comes absorbed, [heads, RANK + ROPE]: q_nope @ W_UK, then the rotated q_pe. Scores are the dot of
that row with the cache row; values are the rows' latents; the output stays in latent space
([heads, RANK]) for W_UV after it. Softmax runs in base 2 (scores times scale * log2(e)).

Long contexts split along the context: each split writes its normalised output and log2-sum-exp,
and mla_reduce_kernel combines them. A sequence's split length comes from its own context
(at least min_split_len, whole tiles), so one grid serves every context length.

mla_decode_absorbed's fused form puts W_UK and W_UV in Triton too: mla_absorb_q_kernel writes
the absorbed query (q_nope @ W_UK), and mla_reduce_uv_kernel combines the splits and applies
W_UV in one launch, writing [B, heads, v_head_dim] contiguous (the caller's reshape to
[B, heads * v_head_dim] is a view). Three launches a layer instead of two cuBLAS bmms, the
decode and reduce kernels and a copy.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from inferx_core.interfaces.attention import MLAWeights
from inferx_kernels_cuda.fused_kernels import to_cache
from inferx_kernels_cuda.triton_kernels import _NO_MAX, _seq_split_len, _softmax_step


@triton.jit(do_not_specialize=["min_split_len", "stride_table"])
def mla_decode_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    context_len_ptr,
    part_o_ptr,
    part_lse_ptr,
    num_heads,
    min_split_len,
    scale_log2,
    stride_qb,
    stride_qh,
    q_pe_ptr,
    stride_pb,
    stride_ph,
    stride_table,
    stride_row,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    k_scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    row_seq_ptr=None,
    ROW_SEQ: tl.constexpr = False,
):
    """Grid (sequences, splits). q's latent part at q_ptr, its rope part at q_pe_ptr (two
    tensors, or two views of one row). Every head of sequence b against context positions [lo, hi)
    of its split; writes part_o [b, head, split, RANK] (normalised, float32) and part_lse
    [b, head, split] (log2 units; _NO_MAX for an empty split). ROPE_PAD: the rope width
    widened (with zeros) to the 16 a GPU dot needs. KV_FP8: an e4m3 cache holding row /
    *k_scale_ptr; each tile is cast to q's dtype (exact), the scale folded into the softmax
    scale and (the latent being the value too) into the output. ROW_SEQ: query row b reads
    block-table row row_seq[b] (rows of one sequence share its table: a mixed graph's chunk
    rows over their cached prefix) and an empty split stores nothing (the reduce reads only
    the splits a row's context uses)."""
    b = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    ctx = tl.load(context_len_ptr + b)
    split_len = _seq_split_len(ctx, num_splits, min_split_len, BLOCK_N)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    h = tl.arange(0, BLOCK_H)
    head_ok = h < num_heads
    r = tl.arange(0, RANK)
    e = tl.arange(0, ROPE_PAD)
    e_ok = e < ROPE
    q_row = q_ptr + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=head_ok[:, None], other=0.0)
    pe_row = q_pe_ptr + b.to(tl.int64) * stride_pb + h[:, None] * stride_ph
    q_pe = tl.load(pe_row + e[None, :], mask=head_ok[:, None] & e_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    table = block_table_ptr + b * stride_table
    if ROW_SEQ:
        table = block_table_ptr + tl.load(row_seq_ptr + b) * stride_table
    m = tl.full([BLOCK_H], _NO_MAX, tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * stride_row
        latent = tl.load(cache_ptr + row[:, None] + r[None, :], mask=valid[:, None], other=0.0)
        k_pe = tl.load(
            cache_ptr + row[:, None] + RANK + e[None, :],
            mask=valid[:, None] & e_ok[None, :],
            other=0.0,
        )
        if UPCAST or KV_FP8:
            latent = latent.to(q_lat.dtype)
            k_pe = k_pe.to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m, row_sum, acc = _softmax_step(s, latent, m, row_sum, acc, DOT_PRECISION)

    out = acc / tl.maximum(row_sum, 1e-30)[:, None]
    if KV_FP8:
        out = out * tl.load(k_scale_ptr)
    lse = tl.where(row_sum > 0, m + tl.log2(tl.maximum(row_sum, 1e-30)), _NO_MAX)
    part = (b * num_heads + h) * num_splits + split  # [BLOCK_H]
    if ROW_SEQ:  # (a scalar condition as a bound: scalar & tensor trips the interpreter)
        head_ok = h < tl.where(lo < hi, num_heads, 0)
    tl.store(part_lse_ptr + part, lse, mask=head_ok)
    tl.store(part_o_ptr + part[:, None] * RANK + r[None, :], out, mask=head_ok[:, None])


@triton.jit
def mla_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    context_len_ptr,
    min_split_len,
    stride_ob,
    stride_oh,
    RANK: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Grid (sequences, heads): one head's splits weighted by exp2 of their lse, into out
    [b, head, RANK] (a sequence of no context, a mixed graph's unused decode slot, writes
    zeros)."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    ctx = tl.load(context_len_ptr + b)
    used = tl.cdiv(ctx, _seq_split_len(ctx, SPLITS, min_split_len, BLOCK_N))
    s = tl.arange(0, SPLITS_PAD)
    r = tl.arange(0, RANK)
    s_ok = s < used
    part = (b * num_heads + head) * SPLITS + s
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    o = tl.load(part_o_ptr + part[:, None] * RANK + r[None, :], mask=s_ok[:, None], other=0.0)
    top = tl.where(used > 0, tl.max(lse, 0), 0.0)  # no NaN for a sequence of no splits
    w = tl.exp2(lse - top)
    res = tl.sum(o * w[:, None], 0) / tl.where(used > 0, tl.sum(w, 0), 1.0)
    dst = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + r
    tl.store(dst, res.to(out_ptr.dtype.element_ty))


@triton.jit
def mla_absorb_q_kernel(
    q_ptr,
    w_ptr,
    out_ptr,
    batch,
    stride_qb,
    stride_qh,
    stride_wh,
    stride_wn,
    stride_wr,
    NOPE: tl.constexpr,
    NOPE_PAD: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (heads, RANK / BLOCK_R): out[b, head, r] = q[b, head, :NOPE] @ W_UK[head][:, r]
    for r in the program's tile and every sequence b, BLOCK_B sequences a tl.dot. q: rows of
    [B, heads, NOPE + rope] (strides stride_qb, stride_qh; the rope part not read); W_UK
    [heads, NOPE, RANK] by its strides (a view of kv_b_proj's weight), its [NOPE, BLOCK_R]
    tile loaded once, before the loop over the batch, and rounded to q's dtype as
    w_uk.to(q.dtype) is. float32 accumulation; out contiguous [B, heads, RANK] in q's dtype."""
    head = tl.program_id(0)
    num_heads = tl.num_programs(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.arange(0, NOPE_PAD)
    n_ok = n < NOPE
    dtype = out_ptr.dtype.element_ty
    w_tile = w_ptr + head * stride_wh + n[:, None] * stride_wn + r[None, :] * stride_wr
    w = tl.load(w_tile, mask=n_ok[:, None], other=0.0).to(dtype)
    if UPCAST:
        w = w.to(tl.float32)
    i = tl.arange(0, BLOCK_B)
    for b0 in range(0, batch, BLOCK_B):
        b = (b0 + i).to(tl.int64)
        b_ok = b < batch
        rows = q_ptr + b[:, None] * stride_qb + head * stride_qh + n[None, :]
        x = tl.load(rows, mask=b_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        acc = tl.dot(x, w, input_precision=DOT_PRECISION)
        dst = out_ptr + (b[:, None] * num_heads + head) * RANK + r[None, :]
        tl.store(dst, acc.to(dtype), mask=b_ok[:, None])


@triton.jit(do_not_specialize=["min_split_len"])
def mla_reduce_uv_kernel(
    part_o_ptr,
    part_lse_ptr,
    context_len_ptr,
    w_ptr,
    out_ptr,
    batch,
    min_split_len,
    stride_wh,
    stride_wv,
    stride_wr,
    RANK: tl.constexpr,
    V: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    piece_o_ptr=None,
    piece_lse_ptr=None,
    merge_row_ptr=None,
    stride_piece=0,
    MERGE: tl.constexpr = False,
):
    """Grid (heads, cdiv(V, BLOCK_V), groups): mla_reduce_kernel and W_UV in one launch.
    Program (head, v tile, g) takes the blocks of BLOCK_B sequences g, g + groups, ...; for
    each, RANK in BLOCK_R-wide slices: the splits of part_o [B, heads, SPLITS, RANK] weighted
    by exp2(lse - max) over their sum as mla_reduce_kernel weighs them (all splits of a
    slice in one load), that combined latent rounded to out's dtype (where the unfused form
    stores it), then times the slice of W_UV[head] [V, RANK] (by its strides, rounded to
    out's dtype as w_uv.to(q.dtype) is) into a float32 [BLOCK_B, BLOCK_V] accumulator: a
    tl.dot at BLOCK_B 16, a broadcast product summed over the slice below 16 (the tensor
    cores' smallest M is 16, and one or a few sequences a program is what batch 1 needs).
    Writes out contiguous [B, heads, V]; a sequence of no context writes zeros.

    The trade the host (_uv_tiles) picks the tiles by: every v tile reads its sequences'
    part_o again, every sequence group its W_UV tiles again; at batch 1 narrow v tiles give
    the programs that W_UV's bytes need, at larger batches sequence groups do.

    MERGE: row b's attention has a second part, attended elsewhere over other keys: the
    normalised output and log2-sum-exp at row merge_row[b] (-1: none) of piece_o [rows, heads,
    stride_piece] and piece_lse [rows, heads] (float32; mla_prefill's pieces: a chunk's own
    rows in the plain form, while this kernel's splits hold its cached prefix). Both parts are
    weighted by exp2 of their log2-sum-exp (the absorbed part's after W_UV, which is linear)
    in float32 before the one rounding to out's dtype."""
    head = tl.program_id(0)
    num_heads = tl.num_programs(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V
    dtype = out_ptr.dtype.element_ty
    i = tl.arange(0, BLOCK_B)
    s = tl.arange(0, SPLITS_PAD)
    r = tl.arange(0, BLOCK_R)
    w_rows = w_ptr + head * stride_wh + v[:, None] * stride_wv  # [BLOCK_V, 1]
    for b0 in range(tl.program_id(2) * BLOCK_B, batch, tl.num_programs(2) * BLOCK_B):
        b = (b0 + i).to(tl.int64)
        b_ok = b < batch
        ctx = tl.load(context_len_ptr + b, mask=b_ok, other=0)
        used = tl.cdiv(ctx, _seq_split_len(ctx, SPLITS, min_split_len, BLOCK_N))
        part = (b * num_heads + head) * SPLITS  # [BLOCK_B]: split 0 of (b, head)
        s_ok = s[None, :] < used[:, None]
        lse = tl.load(part_lse_ptr + part[:, None] + s[None, :], mask=s_ok, other=float("-inf"))
        top = tl.where(used > 0, tl.max(lse, 1), 0.0)  # no NaN for a sequence of no splits
        weight = tl.exp2(lse - top[:, None])  # [BLOCK_B, SPLITS_PAD], 0 past used
        total = tl.where(used > 0, tl.sum(weight, 1), 1.0)  # (so 0 for no splits)
        rows = (part[:, None] + s[None, :]) * RANK  # [BLOCK_B, SPLITS_PAD]
        acc = tl.zeros([BLOCK_B, BLOCK_V], tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            o = tl.load(
                part_o_ptr + rows[:, :, None] + r0 + r[None, None, :],
                mask=s_ok[:, :, None],
                other=0.0,
            )
            lat = (tl.sum(o * weight[:, :, None], 1) / total[:, None]).to(dtype)
            w = tl.load(w_rows + (r0 + r)[None, :] * stride_wr, mask=v_ok[:, None], other=0.0)
            w = w.to(dtype)
            if BLOCK_B >= 16:
                if UPCAST:
                    lat = lat.to(tl.float32)
                    w = w.to(tl.float32)
                acc += tl.dot(lat, tl.trans(w), input_precision=DOT_PRECISION)
            else:
                prod = lat.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
                acc += tl.sum(prod, 2)
        if MERGE:
            src = tl.load(merge_row_ptr + b, mask=b_ok, other=-1)
            has = src >= 0
            piece = src.to(tl.int64) * num_heads + head  # [BLOCK_B]
            lse_p = tl.load(piece_lse_ptr + piece, mask=has, other=float("-inf"))
            lse_a = tl.where(used > 0, top + tl.log2(total), float("-inf"))
            both = tl.maximum(lse_a, lse_p)
            both = tl.where(both > float("-inf"), both, 0.0)  # neither part: no NaN
            w_a = tl.exp2(lse_a - both)
            w_p = tl.exp2(lse_p - both)
            o_p = tl.load(
                piece_o_ptr + piece[:, None] * stride_piece + v[None, :],
                mask=has[:, None] & v_ok[None, :],
                other=0.0,
            )
            acc = acc * w_a[:, None] + o_p * w_p[:, None]
            acc = acc / tl.maximum(w_a + w_p, 1e-30)[:, None]
        dst = out_ptr + (b[:, None] * num_heads + head) * V + v[None, :]
        tl.store(dst, acc.to(dtype), mask=b_ok[:, None] & v_ok[None, :])


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: torch.Tensor,
    scale: float,
    rank: int,
    num_splits: int = 1,
    min_split_len: int = 256,
    block_n: int = 32,
    k_scale: torch.Tensor | None = None,
    q_pe: torch.Tensor | None = None,
    row_seq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, rank + rope] (q_nope @ W_UK, then the rotated q_pe), or
    q [B, H, rank] and q_pe [B, H, rope] apart (no copy into one row), one query a sequence,
    over cache [num_blocks, block_size, 1, rank + rope] by block_table [B, max_blocks] int32
    and context_len [B] int32 -> the latent-space output [B, H, rank] in q's dtype (W_UV still
    to apply; zeros for a sequence of no context). rank and rope are powers of two (512 and 64
    for DeepSeek-V2). num_splits: context splits per sequence (the grid's second axis), each
    at least min_split_len tokens. An e4m3 cache holds rows / k_scale ([1] float32, read by
    pointer so CUDA graphs replay with its value; None: 1.0). row_seq [B] int32: row b's
    block-table row (None: row b), so rows of one sequence share its table."""
    part_o, part_lse = _split_parts(
        q, cache, block_table, context_len, scale, rank, num_splits, min_split_len, block_n,
        k_scale, q_pe, row_seq,
    )  # fmt: skip
    bsz, heads = q.shape[:2]
    out = torch.empty(bsz, heads, rank, dtype=q.dtype, device=q.device)
    mla_reduce_kernel[(bsz, heads)](
        part_o,
        part_lse,
        out,
        context_len,
        min_split_len,
        out.stride(0),
        out.stride(1),
        RANK=rank,
        SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_N=block_n,
    )
    return out


def _split_parts(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: torch.Tensor,
    scale: float,
    rank: int,
    num_splits: int,
    min_split_len: int,
    block_n: int,
    k_scale: torch.Tensor | None,
    q_pe: torch.Tensor | None,
    row_seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_decode's checks and its mla_decode_kernel launch: (part_o [B, H, num_splits, rank],
    part_lse [B, H, num_splits]), float32, for a reduce kernel to combine."""
    if q_pe is not None:
        if q.shape[-1] != rank or q_pe.shape[:2] != q.shape[:2] or q_pe.dtype != q.dtype:
            raise ValueError(
                f"MLA decode: q [B, H, {rank}] and q_pe [B, H, rope] of one dtype, got "
                f"{tuple(q.shape)} {q.dtype} and {tuple(q_pe.shape)} {q_pe.dtype}"
            )
        width = rank + q_pe.shape[-1]
    else:
        width = q.shape[-1]
        q_pe = q[..., rank:]
    bsz, heads = q.shape[:2]
    rope = width - rank
    if any(n <= 0 or n & (n - 1) for n in (rank, rope)) or cache.shape[-2:] != (1, width):
        raise ValueError(
            f"MLA decode needs a power-of-two latent ({rank}) and rope key ({rope}) in one KV "
            f"head: q {tuple(q.shape)}, cache {tuple(cache.shape)}"
        )
    if not (
        q.stride(-1) == 1
        and q_pe.stride(-1) == 1
        and cache.stride(-1) == 1
        and cache[0, 0].is_contiguous()
    ):
        raise ValueError("MLA decode needs q and the cache rows contiguous in their last dim")
    block_size = cache.shape[1]
    upcast = _interpreting() or q.dtype == torch.float32
    part_o = torch.empty(bsz, heads, num_splits, rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(heads))
    fp8 = {}
    if cache.dtype == torch.float8_e4m3fn:
        fp8 = {"k_scale_ptr": _scale(k_scale, q.device), "KV_FP8": True}
    if row_seq is not None:
        if row_seq.shape != (bsz,) or row_seq.dtype != torch.int32:
            got = f"{tuple(row_seq.shape)} {row_seq.dtype}"
            raise ValueError(f"MLA decode: row_seq must be [{bsz}] int32; got {got}")
        fp8.update(row_seq_ptr=row_seq, ROW_SEQ=True)
    mla_decode_kernel[(bsz, num_splits)](
        q,
        cache,
        block_table,
        context_len,
        part_o,
        part_lse,
        heads,
        min_split_len,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        q_pe,
        q_pe.stride(0),
        q_pe.stride(1),
        block_table.stride(0),
        cache.stride(1),
        RANK=rank,
        ROPE=rope,
        ROPE_PAD=max(16, rope),
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if upcast else "tf32",
        **fp8,
    )
    return part_o, part_lse


def mla_decode_absorbed(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: torch.Tensor,
    mla: MLAWeights,
    scale: float,
    num_splits: int = 1,
    min_split_len: int = 256,
    k_scale: torch.Tensor | None = None,
    fused: bool = True,
    row_seq: torch.Tensor | None = None,
    merge: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A decode step of one MLA layer in the absorbed form: q [B, H, nope + rope] (rope part
    rotated, last dim contiguous) -> [B, H, v_head_dim] in q's dtype, as
    inferx_core.attention_torch.mla_absorbed computes it per sequence: W_UK folded into the
    query, mla_decode's kernel over the latent cache (k_scale: an e4m3 cache's, as mla_decode
    takes it), W_UV after. Rounded to q's dtype where the torch form rounds: the absorbed
    query, the combined latent, the output (float32 sums between).

    fused: W_UK by mla_absorb_q_kernel and the split combine with W_UV by
    mla_reduce_uv_kernel, the output contiguous; else torch einsums around mla_decode (a
    permuted view out). A sequence of no context gets zeros either way. The fused kernels
    read w_uk and w_uv through their strides (views of kv_b_proj's weight), in their own
    float dtype, each tile cast to q's: no copy a call.

    row_seq [B] int32: row b's block-table row, as mla_decode takes it. merge (fused only):
    (piece_o [T, H, >= v_head_dim], piece_lse [T, H], merge_row [B] int32), row b's other part
    of its attention (mla_prefill's pieces, a chunk's own rows in the plain form, the context
    here being its cached prefix), merged into its output by log-sum-exp where merge_row[b] >= 0
    (mla_reduce_uv_kernel's MERGE)."""
    assert mla.w_uk is not None and mla.w_uv is not None, "MLA weights not loaded"
    nope = mla.qk_nope_head_dim
    rank = mla.w_uk.shape[-1]
    if not fused:
        if merge is not None:
            raise ValueError("MLA decode: merging a plain part takes the fused form")
        q_lat = torch.einsum("bhn,hnr->bhr", q[..., :nope], mla.w_uk.to(q.dtype))
        o_lat = mla_decode(
            q_lat, cache, block_table, context_len, scale, rank, num_splits, min_split_len,
            k_scale=k_scale, q_pe=q[..., nope:], row_seq=row_seq,
        )  # fmt: skip
        return torch.einsum("bhr,hvr->bhv", o_lat, mla.w_uv.to(q.dtype))
    bsz, heads = q.shape[:2]
    v_dim = mla.w_uv.shape[1]
    if mla.w_uk.shape != (heads, nope, rank) or mla.w_uv.shape != (heads, v_dim, rank):
        raise ValueError(
            f"MLA decode: w_uk [{heads}, {nope}, rank] and w_uv [{heads}, v, rank] for q "
            f"{tuple(q.shape)}; got {tuple(mla.w_uk.shape)} and {tuple(mla.w_uv.shape)}"
        )
    if q.stride(-1) != 1:
        raise ValueError("MLA decode needs q contiguous in its last dim")
    pieces: dict[str, object] = {}
    if merge is not None:
        piece_o, piece_lse, merge_row = merge
        if (
            piece_o.dtype != torch.float32
            or piece_lse.dtype != torch.float32
            or piece_o.shape[:2] != (piece_lse.shape[0], heads)
            or piece_lse.shape[1] != heads
            or piece_o.shape[2] < v_dim
            or not piece_o.is_contiguous()
            or not piece_lse.is_contiguous()
            or merge_row.shape != (bsz,)
            or merge_row.dtype != torch.int32
        ):
            raise ValueError(
                f"MLA decode: merge takes piece_o [T, {heads}, >= {v_dim}] and piece_lse "
                f"[T, {heads}] float32 contiguous, merge_row [{bsz}] int32; got "
                f"{tuple(piece_o.shape)} {piece_o.dtype}, {tuple(piece_lse.shape)} "
                f"{piece_lse.dtype}, {tuple(merge_row.shape)} {merge_row.dtype}"
            )
        pieces = {
            "piece_o_ptr": piece_o,
            "piece_lse_ptr": piece_lse,
            "merge_row_ptr": merge_row,
            "stride_piece": piece_o.shape[2],
            "MERGE": True,
        }
    upcast = _interpreting() or q.dtype == torch.float32
    precision = "ieee" if upcast else "tf32"
    w_uk = mla.w_uk
    q_lat = torch.empty(bsz, heads, rank, dtype=q.dtype, device=q.device)
    block_r = _uk_block(heads, nope, rank)
    mla_absorb_q_kernel[(heads, rank // block_r)](
        q,
        w_uk,
        q_lat,
        bsz,
        q.stride(0),
        q.stride(1),
        *w_uk.stride(),
        NOPE=nope,
        NOPE_PAD=max(16, triton.next_power_of_2(nope)),
        RANK=rank,
        BLOCK_R=block_r,
        BLOCK_B=16,
        UPCAST=upcast,
        DOT_PRECISION=precision,
    )
    block_n = 32  # mla_decode's tile
    part_o, part_lse = _split_parts(
        q_lat, cache, block_table, context_len, scale, rank, num_splits, min_split_len,
        block_n, k_scale, q[..., nope:], row_seq,
    )  # fmt: skip
    w_uv = mla.w_uv
    out = torch.empty(bsz, heads, v_dim, dtype=q.dtype, device=q.device)
    block_b, block_v, block_r, groups = _uv_tiles(
        bsz, heads, v_dim, rank, num_splits, w_uv.element_size()
    )
    mla_reduce_uv_kernel[(heads, triton.cdiv(v_dim, block_v), groups)](
        part_o,
        part_lse,
        context_len,
        w_uv,
        out,
        bsz,
        min_split_len,
        *w_uv.stride(),
        RANK=rank,
        V=v_dim,
        SPLITS=num_splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_N=block_n,
        BLOCK_B=block_b,
        BLOCK_V=block_v,
        BLOCK_R=block_r,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=_UV_WARPS,
        **pieces,
    )
    return out


# Programs a launch of the fused absorbed form aims for (about one wave of an H100's 132 SMs:
# the two kernels are bound by memory, not by arithmetic), the most elements of one tile a
# program holds in registers (64 a thread at 4 warps), and mla_reduce_uv_kernel's warps (8:
# up to three such tiles live at once, the splits', W_UV's and their product).
_PROGRAMS = 128
_TILE = 8192
_UV_WARPS = 8
# _uv_tiles' cost model: bytes a second the programs read at (an H100's L2, roughly), and
# the time of one step of a program's serial loop (a load's latency, roughly).
_UV_BYTES_PER_S = 5e12
_UV_STEP_S = 5e-7


@functools.lru_cache(maxsize=256)  # (per call, without a CUDA graph: host time)
def _uk_block(heads: int, nope: int, rank: int) -> int:
    """mla_absorb_q_kernel's BLOCK_R: the widest W_UK tile (NOPE rows, at most _TILE
    elements, 16 columns or more) that still gives heads * rank / BLOCK_R >= _PROGRAMS."""
    block_r = rank
    nope_pad = max(16, triton.next_power_of_2(nope))
    while block_r > 16 and (heads * (rank // block_r) < _PROGRAMS or nope_pad * block_r > _TILE):
        block_r //= 2
    return block_r


@functools.lru_cache(maxsize=1024)
def _uv_tiles(
    batch: int, heads: int, v_dim: int, rank: int, splits: int, w_size: int
) -> tuple[int, int, int, int]:
    """mla_reduce_uv_kernel's (BLOCK_B, BLOCK_V, BLOCK_R, sequence groups) for a batch: the
    pick of least estimated time, where bytes read are part_o's once per v tile plus
    W_UV's once per sequence group (spread over the programs, up to _PROGRAMS of them), and
    each step of a program's loop (a RANK slice of a block of sequences) costs a latency.
    BLOCK_R: the widest slice whose tiles (the splits' [BLOCK_B, SPLITS, BLOCK_R], W_UV's
    [BLOCK_V, BLOCK_R], the broadcast product below BLOCK_B 16) stay within _TILE, and 16 at
    least (tl.dot's K); picks whose 16 is past _TILE only where none fits (over 512 splits)."""
    splits_pad = max(2, triton.next_power_of_2(splits))
    part_bytes = batch * heads * splits * rank * 4
    w_bytes = heads * v_dim * rank * w_size
    best: tuple[float, int, int, int, int] | None = None
    for block_b in (16, 8, 4, 2, 1):
        if block_b > triton.next_power_of_2(batch):
            continue
        for block_v in (16, 32, 64, 128):
            if block_v > max(16, triton.next_power_of_2(v_dim)):
                continue
            widest = max(block_b * splits_pad, block_v, block_b * block_v if block_b < 16 else 1)
            block_r = min(rank, 1 << max(4, (_TILE // widest).bit_length() - 1))  # >= 16
            v_tiles = triton.cdiv(v_dim, block_v)
            blocks = triton.cdiv(batch, block_b)
            groups = min(blocks, triton.cdiv(_PROGRAMS, heads * v_tiles))
            programs = heads * v_tiles * groups
            read = part_bytes * v_tiles + w_bytes * groups
            steps = triton.cdiv(blocks, groups) * (rank // block_r)
            cost = read / (_UV_BYTES_PER_S * min(1.0, programs / _PROGRAMS)) + steps * _UV_STEP_S
            if widest * block_r > _TILE:
                cost += 1.0  # tiles past _TILE (spills) only where no pick fits
            if best is None or cost < best[0]:
                best = (cost, block_b, block_v, block_r, groups)
    assert best is not None
    return best[1:]


@triton.jit
def mla_write_kernel(
    row_ptr,
    cache_ptr,
    slot_ptr,
    stride_row,
    stride_slot,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    k_scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    HAND_ROUND: tl.constexpr = False,
):
    """One program per new token: its cache row (latent + rope key) into its slot. A negative
    slot is padding (a CUDA graph's rows past the batch) and writes nothing. KV_FP8: an e4m3
    cache, row / *k_scale_ptr stored as the KV write stores k (fused_kernels.to_cache)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, WIDTH_PAD)
    mask = d < tl.where(slot >= 0, WIDTH, 0)  # a scalar & tensor mask trips the interpreter
    row = tl.load(row_ptr + t.to(tl.int64) * stride_row + d, mask=mask)
    row = to_cache(row, k_scale_ptr, cache_ptr, KV_FP8, HAND_ROUND)
    tl.store(cache_ptr + slot * stride_slot + d, row, mask=mask)


def write_latent(
    rows: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
) -> None:
    """rows [T, RANK + ROPE] (last dim contiguous) into an MLA layer's cache [num_blocks,
    block_size, 1, RANK + ROPE] at slot_mapping [T] int64 (-1: skip). An e4m3 cache stores
    rows / k_scale ([1] float32; None: 1.0), clamped to +-448, rounded to nearest."""
    width = cache.shape[-1]
    if rows.shape != (slot_mapping.shape[0], width) or rows.stride(-1) != 1:
        raise ValueError(
            f"MLA cache write: rows must be [{slot_mapping.shape[0]}, {width}] with the last dim "
            f"contiguous; got {tuple(rows.shape)}"
        )
    if not cache[0, 0].is_contiguous() or cache.stride(1) != width:
        raise ValueError("MLA cache write: the cache rows must be contiguous")
    if rows.shape[0] == 0:
        return
    fp8 = {}
    if cache.dtype == torch.float8_e4m3fn:
        fp8 = {
            "k_scale_ptr": _scale(k_scale, rows.device),
            "KV_FP8": True,
            "HAND_ROUND": _interpreting(),
        }
    mla_write_kernel[(rows.shape[0],)](
        rows,
        cache,
        slot_mapping,
        rows.stride(0),
        width,
        WIDTH=width,
        WIDTH_PAD=triton.next_power_of_2(width),
        **fp8,
    )


def _scale(k_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """An e4m3 cache's scale as the kernels read it: [1] float32 on the device."""
    if k_scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    return k_scale.to(device, torch.float32)
