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
"""

from __future__ import annotations

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
):
    """Grid (sequences, splits). q's latent part at q_ptr, its rope part at q_pe_ptr (two
    tensors, or two views of one row). Every head of sequence b against context positions [lo, hi)
    of its split; writes part_o [b, head, split, RANK] (normalised, float32) and part_lse
    [b, head, split] (log2 units; _NO_MAX for an empty split). ROPE_PAD: the rope width
    widened (with zeros) to the 16 a GPU dot needs. KV_FP8: an e4m3 cache holding row /
    *k_scale_ptr; each tile is cast to q's dtype (exact), the scale folded into the softmax
    scale and (the latent being the value too) into the output."""
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

    m = tl.full([BLOCK_H], _NO_MAX, tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(block_table_ptr + b * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
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
    [b, head, RANK] (a sequence of no context writes nothing)."""
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
    w = tl.exp2(lse - tl.max(lse, 0))
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    dst = out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + r
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=(r < tl.where(ctx > 0, RANK, 0)))


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
) -> torch.Tensor:
    """Absorbed MLA decode: q [B, H, rank + rope] (q_nope @ W_UK, then the rotated q_pe), or
    q [B, H, rank] and q_pe [B, H, rope] apart (no copy into one row), one query a sequence,
    over cache [num_blocks, block_size, 1, rank + rope] by block_table [B, max_blocks] int32
    and context_len [B] int32 -> the latent-space output [B, H, rank] in q's dtype (W_UV still
    to apply). rank and rope are powers of two (512 and 64 for DeepSeek-V2). num_splits:
    context splits per sequence (the grid's second axis), each at least min_split_len tokens.
    An e4m3 cache holds rows / k_scale ([1] float32, read by pointer so CUDA graphs replay
    with its value; None: 1.0)."""
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
    interp = _interpreting()
    upcast = interp or q.dtype == torch.float32
    part_o = torch.empty(bsz, heads, num_splits, rank, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(heads))
    fp8 = {}
    if cache.dtype == torch.float8_e4m3fn:
        fp8 = {"k_scale_ptr": _scale(k_scale, q.device), "KV_FP8": True}
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
) -> torch.Tensor:
    """A decode step of one MLA layer in the absorbed form: q [B, H, nope + rope] (rope part
    rotated) -> [B, H, v_head_dim], as inferx_core.attention_torch.mla_absorbed computes it per
    sequence: W_UK folded into the query, mla_decode over the latent cache (k_scale: an e4m3
    cache's, as mla_decode takes it), W_UV after."""
    assert mla.w_uk is not None and mla.w_uv is not None, "MLA weights not loaded"
    nope = mla.qk_nope_head_dim
    q_lat = torch.einsum("bhn,hnr->bhr", q[..., :nope], mla.w_uk.to(q.dtype))
    rank = mla.w_uk.shape[-1]
    o_lat = mla_decode(
        q_lat, cache, block_table, context_len, scale, rank, num_splits, min_split_len,
        k_scale=k_scale, q_pe=q[..., nope:],
    )  # fmt: skip
    return torch.einsum("bhr,hvr->bhv", o_lat, mla.w_uv.to(q.dtype))


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
