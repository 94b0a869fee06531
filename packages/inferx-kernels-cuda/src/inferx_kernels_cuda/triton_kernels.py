"""Triton kernels for paged attention: KV-cache write, split-K decode and its reduce, prefill.

The cache of one layer is K and V, each [num_blocks, block_size, num_kv_heads, head_dim] with the
head dim contiguous; a token at position p of a sequence lives in block table[p // block_size] at
offset p % block_size. Softmax runs in base 2: scores are pre-multiplied by scale * log2(e), so
every log-sum-exp here is a log2-sum-exp2.

UPCAST turns operands to fp32 before tl.dot: Triton's interpreter computes bf16 dots wrongly
(see LESSONS.md), while on the GPU fp16/bf16 dots run on tensor cores as they are.
DOT_PRECISION is "ieee" for fp32 caches (exact fp32, not tf32) and ignored for half types.

SEQ_SPLIT (decode and its reduce): the split length is derived per sequence from its context
(see _seq_split_len) rather than fixed for the step, so that one grid, captured once in a CUDA
graph, serves every context length; the split_len argument is then the shortest split.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inferx_kernels_cuda.fused_kernels import _rounded, rotate_into, to_cache
from inferx_kernels_cuda.pdl import pdl_start

# A finite floor for the running max: a row that has seen no key yet keeps it, and exp2 of the
# difference to a real score is 0 instead of the NaN that -inf - -inf would give.
_NO_MAX = tl.constexpr(-1.0e30)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    k_scale_ptr=None,
    v_scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    HAND_ROUND: tl.constexpr = False,
):
    """One program per new token: all its KV heads into its slot. A negative slot is padding.
    KV_FP8: an e4m3 cache, k / *k_scale_ptr and v / *v_scale_ptr stored (to_cache)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    # A padding row writes no head (a scalar & tensor mask trips the interpreter).
    mask = h < tl.where(slot >= 0, num_kv_heads, 0)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = slot * stride_cache_slot + h * stride_cache_head + d
    k = to_cache(k, k_scale_ptr, k_cache_ptr, KV_FP8, HAND_ROUND)
    v = to_cache(v, v_scale_ptr, v_cache_ptr, KV_FP8, HAND_ROUND)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


@triton.jit
def rotary_kv_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    stride_cos_sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_IN_PLACE: tl.constexpr = False,
    k_scale_ptr=None,
    v_scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    HAND_ROUND: tl.constexpr = False,
):
    """One program per new token: rotate its q heads in place, and write its k heads rotated
    and its v heads into its cache slot (rotary and KV write in one launch; the rotation
    rounds as fused_kernels.rotary_kernel does). A negative slot is padding: q only.
    K_IN_PLACE: rotate the k heads in place too (for attention that reads k, not the cache).
    KV_FP8: an e4m3 cache, as kv_write_kernel."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    dh = tl.arange(0, HALF_PAD)[None, :]
    row = cos_sin_ptr + pos * stride_cos_sin
    dtype = q_ptr.dtype.element_ty
    cos = _rounded(tl.load(row + dh, mask=dh < HALF, other=0.0), dtype)
    sin = _rounded(tl.load(row + HALF + dh, mask=dh < HALF, other=0.0), dtype)
    q_row = q_ptr + t * stride_qt
    rotate_into(q_row, stride_qh, q_row, stride_qh, num_q_heads, cos, sin, HALF, HALF_PAD,
                HEADS_BLOCK)  # fmt: skip
    slot = tl.load(slot_ptr + t).to(tl.int64)
    kv_heads = tl.where(slot >= 0, num_kv_heads, 0)
    dst = slot * stride_cache_slot
    rotate_into(k_ptr + t * stride_kt, stride_kh, k_cache_ptr + dst, stride_cache_head, kv_heads,
                cos, sin, HALF, HALF_PAD, HEADS_BLOCK, k_scale_ptr, KV_FP8,
                HAND_ROUND)  # fmt: skip
    if K_IN_PLACE:  # after the cache's copy, which read k unrotated
        rotate_into(k_ptr + t * stride_kt, stride_kh, k_ptr + t * stride_kt, stride_kh,
                    num_kv_heads, cos, sin, HALF, HALF_PAD, HEADS_BLOCK)  # fmt: skip
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    mask = h < kv_heads
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    cache_v = v_cache_ptr + dst + h * stride_cache_head + d
    tl.store(cache_v, to_cache(v, v_scale_ptr, v_cache_ptr, KV_FP8, HAND_ROUND), mask=mask)


@triton.jit
def _kv_tile(
    k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_table, kv_head, stride_cache_block,
    stride_cache_token, stride_cache_head, start, hi, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One KV head's tile of a sequence's cache at context positions start.. (MASKED: those
    from hi on read as zeros): (positions [BLOCK_N], K^T [HEAD_DIM, BLOCK_N], V [BLOCK_N,
    HEAD_DIM])."""
    d = tl.arange(0, HEAD_DIM)
    pos = start + tl.arange(0, BLOCK_N)
    table = block_table_ptr + seq * stride_table + pos // BLOCK_SIZE
    if MASKED:
        valid = pos < hi
        block = tl.load(table, mask=valid, other=0)
    else:
        block = tl.load(table)
    off = (
        block.to(tl.int64) * stride_cache_block
        + (pos % BLOCK_SIZE) * stride_cache_token
        + kv_head * stride_cache_head
    )
    if MASKED:
        k_t = tl.load(k_cache_ptr + off[None, :] + d[:, None], mask=valid[None, :], other=0.0)
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    else:
        k_t = tl.load(k_cache_ptr + off[None, :] + d[:, None])
        v = tl.load(v_cache_ptr + off[:, None] + d[None, :])
    return pos, k_t, v


@triton.jit
def _attend_range(
    q,
    m,
    row_sum,
    acc,
    lo,
    hi,
    q_pos,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq,
    stride_table,
    kv_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    scale_log2,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    """Online softmax of the rows of q over context positions [lo, hi) of one sequence, read
    from its blocks in BLOCK_N-token tiles; returns the updated (max, sum, unnormalised output).

    Without MASKED every tile must be whole and visible to every row: callers run their full
    tiles that way and only the ragged or diagonal rest with masks. CAUSAL (with MASKED) hides
    positions past each row's q_pos; WINDOW > 0 (with MASKED and CAUSAL) also those at or
    before q_pos - WINDOW.
    """
    for start in range(lo, hi, BLOCK_N):
        pos, k_t, v = _kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_table, kv_head,
            stride_cache_block, stride_cache_token, stride_cache_head, start, hi, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, MASKED,
        )  # fmt: skip
        m, row_sum, acc = _attend_tile(q, m, row_sum, acc, pos, k_t, v, hi, q_pos, scale_log2,
                                       MASKED, CAUSAL, UPCAST, DOT_PRECISION, WINDOW)  # fmt: skip
    return m, row_sum, acc


@triton.jit
def _attend_tile(
    q, m, row_sum, acc, pos, k_t, v, hi, q_pos, scale_log2, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):  # fmt: skip
    """One tile of _attend_range: the rows of q against keys k_t at positions pos and their
    values v, folded into the running (max, sum, unnormalised output)."""
    if UPCAST:
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    # An e4m3 cache's tiles go to q's dtype (exact; its scales fold in outside): a no-op else.
    k_t = k_t.to(q.dtype)
    v = v.to(q.dtype)
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        valid = pos < hi
        if CAUSAL:
            seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                seen = seen & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
    return _softmax_step(s, v, m, row_sum, acc, DOT_PRECISION)


@triton.jit
def _query(q, scale_log2, k_cache_ptr, k_scale_ptr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr):
    """A query tile as _attend_tile takes it, and the softmax scale: q in the cache's dtype (an
    e4m3 cache's tiles go to q's instead, its k_scale folded into scale_log2), float32 with
    UPCAST."""
    if not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if UPCAST:
        q = q.to(tl.float32)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    return q, scale_log2


@triton.jit
def _with_sinks(m, row_sum, acc, sinks_ptr, head, mask):
    """Fold each row's learned sink logit (sinks_ptr[head], natural log units) into the
    running (max, sum, unnormalised output) as one more softmax column with no value."""
    sink = tl.load(sinks_ptr + head, mask=mask, other=0.0).to(tl.float32) * _LOG2E
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.exp2(sink - m_new)
    return m_new, row_sum, acc * alpha[:, None]


@triton.jit
def _window_ranges(lo, first_pos, kv_end, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key ranges of a query tile whose rows sit at positions first_pos .. kv_end - 1 under
    a sliding window: (start, head_end, full), where [start, head_end) needs the window mask,
    [head_end, full) is whole tiles every row sees, and [full, kv_end) needs the causal mask.
    lo: the first key the caller has (0, or a split's start)."""
    start = tl.maximum(lo, first_pos - WINDOW + 1)
    all_see = kv_end - WINDOW  # keys from here on are in every row's window
    mid = start + tl.maximum(tl.cdiv(all_see - start, BLOCK_N), 0) * BLOCK_N
    head_end = tl.minimum(mid, kv_end)
    full = tl.maximum(head_end, head_end + (first_pos + 1 - head_end) // BLOCK_N * BLOCK_N)
    return start, head_end, full


@triton.jit
def _softmax_step(s, v, m, row_sum, acc, DOT_PRECISION: tl.constexpr):
    """One tile of the online softmax: fold scores s (log2 domain, -inf where hidden) and the
    tile's values v into the running (max, sum, unnormalised output)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, row_sum, acc


@triton.jit
def _seq_split_len(ctx, num_splits, min_len, BLOCK_N: tl.constexpr):
    """Context tokens per split for one sequence: its context over the grid's splits, at least
    min_len, whole tiles. A short context leaves the later splits empty."""
    per = tl.maximum(tl.cdiv(ctx, num_splits), min_len)
    return tl.cdiv(per, BLOCK_N) * BLOCK_N


@triton.jit
def _split_range(ctx, split, split_len, SEQ_SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the context positions of a decode program's split (SEQ_SPLIT: split_len is the
    shortest split, the sequence's own derived from its context)."""
    if SEQ_SPLIT:
        split_len = _seq_split_len(ctx, tl.num_programs(2), split_len, BLOCK_N)
    lo = split * split_len
    return lo, tl.minimum(lo + split_len, ctx)


@triton.jit
def _decode_row(i, seq_ids_ptr, query_start_ptr, context_len_ptr, ALL_DECODE: tl.constexpr):
    """Decode i's sequence, its query row and its context length. ALL_DECODE: every sequence of
    the batch is a decode, so sequence i is decode i and its query is row i (one dependent load
    fewer before the KV reads)."""
    if ALL_DECODE:
        seq = i
        row = i
    else:
        seq = tl.load(seq_ids_ptr + i)
        row = tl.load(query_start_ptr + seq)
    ctx = tl.load(context_len_ptr + seq)
    return seq, row, ctx


@triton.jit
def _summed(ptr, offs, mask, part_stride, bias_ptr, bias_offs, PARTS: tl.constexpr,
            HAS_BIAS: tl.constexpr):  # fmt: skip
    """The projection's output at ptr + offs in fp32: with PARTS > 1 the sum of that many
    partial results part_stride apart (QuantLinear.forward_split), with HAS_BIAS plus the bias
    at bias_ptr + bias_offs, summed in fp32 and rounded once to ptr's dtype, as the unsplit
    GEMM would have written it."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for p in tl.static_range(1, PARTS):
        x += tl.load(ptr + p * part_stride + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + bias_offs, mask=mask, other=0.0).to(tl.float32)
    if PARTS > 1 or HAS_BIAS:
        x = _rounded(x, ptr.dtype.element_ty)
    return x


@triton.jit
def _rotated(ptr, offs, cos, sin, sign, partner_offs, mask, part_stride, bias_ptr, bias_offs,
             bias_partner_offs, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """The rows at ptr + offs (summed as _summed does) rotated (rotate-half) as
    fused_kernels.rotate_into rounds them, in ptr's dtype. partner_offs point at each element's
    rotate-half partner; cos and sin are per element (the table's halves repeated), sign is -1
    on the first half and +1 on the second."""
    dtype = ptr.dtype.element_ty
    x = _summed(ptr, offs, mask, part_stride, bias_ptr, bias_offs, PARTS, HAS_BIAS)
    xp = _summed(ptr, partner_offs, mask, part_stride, bias_ptr, bias_partner_offs, PARTS,
                 HAS_BIAS)  # fmt: skip
    return (_rounded(x * cos, dtype) + sign * _rounded(xp * sin, dtype)).to(dtype)


# Ints that change from step to step are not specialised on (Triton would compile a variant for
# values of 1 and multiples of 16): every variant a step can need is compiled at start-up.
@triton.jit(do_not_specialize=["split_len", "stride_table", "stride_qp", "stride_kp", "stride_vp"])
def decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    block_table_ptr,
    context_len_ptr,
    query_start_ptr,
    seq_ids_ptr,
    scale_log2,
    split_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SEQ_SPLIT: tl.constexpr,
    ALL_DECODE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_sin,
    ROTARY: tl.constexpr,
    stride_qp=0,
    stride_kp=0,
    stride_vp=0,
    q_bias_ptr=None,
    k_bias_ptr=None,
    v_bias_ptr=None,
    PARTS: tl.constexpr = 1,
    HAS_BIAS: tl.constexpr = False,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    PRELOAD: tl.constexpr = False,
    sinks_ptr=None,
    SINKS: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
    k_scale_ptr=None,
    v_scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    HAND_ROUND: tl.constexpr = False,
):
    """Grid (decode sequences, KV heads, splits): the one query token of a sequence, all query
    heads of one KV group (rows of one tl.dot, padded to GROUP_PAD), over one split of the
    context. With SPLIT the normalised partial output and its lse go to part_o / part_lse
    ([seq, q_head, split, dim] and [seq, q_head, split]) for decode_reduce_kernel; without, the
    result goes straight to out. ALL_DECODE: every sequence of the batch is a decode, so
    sequence i is decode i and its query is row i (one dependent load fewer before the KV reads).

    ROTARY (decode-only steps): q and the new token's k arrive unrotated, and k and v are not
    in the cache yet (rotary_kv_write_kernel did not run). Every program rotates its q heads
    in registers; the one program per (sequence, KV head) whose split holds the new position
    rotates k, writes k and v to the token's slot (none for a negative slot: padding), and
    syncs its threads before reading the cache. One launch a layer fewer.

    With ROTARY, q, k and v may also arrive as PARTS partial results of the QKV GEMM split
    along K (stride_qp, stride_kp, stride_vp apart) and without their bias (HAS_BIAS: the
    q/k/v_bias_ptr vectors, [heads * HEAD_DIM] each): they are summed and rounded once before
    the rotation, as the unsplit GEMM would have written them.

    PDL, TRIGGER: inferx_kernels_cuda.pdl; the kernel after it is the reduce, or o_proj's GEMV.
    EARLY (with PDL, launched early behind the QKV GEMV): the step's metadata (the row's
    context, position and the rotary's cos and sin) loads before the wait, q, k and v after.
    PRELOAD (with EARLY and ROTARY): the split's first K/V tile loads before the wait too (no
    kernel of the step writes the cached context; the new token's row, which this kernel
    writes, is taken from its k and v), so that its latency overlaps the QKV GEMV's.

    WINDOW > 0 (a sliding layer): the query sees only the last WINDOW positions of its context;
    a split wholly before them reads nothing (an empty split: lse -inf). SINKS: each query
    head's learned sink logit (sinks_ptr, float32) joins the softmax as a column with no value:
    here without SPLIT, else once in decode_reduce_kernel's combine.

    KV_FP8: an e4m3 cache holding k / *k_scale_ptr and v / *v_scale_ptr (the new token written
    so, see to_cache). q stays in its dtype, each tile is cast to it, k_scale multiplies
    scale_log2 and v_scale the (partial) output.
    """
    if not EARLY:
        pdl_start(PDL, TRIGGER)
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq, row, ctx = _decode_row(i, seq_ids_ptr, query_start_ptr, context_len_ptr, ALL_DECODE)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    g_valid = g < GROUP
    # An empty row (a mixed graph's unused decode slot, context 0) reads no query and stores
    # nothing: its row is one past the step's when the step fills its graph. g_valid, or none
    # ((g < GROUP) & (ctx > 0) would be an int tensor under the interpreter, not a mask).
    live = g < tl.where(ctx > 0, GROUP, 0)
    q_offs = row * stride_qt + head[:, None] * stride_qh
    if ROTARY:
        half_d = d % (HEAD_DIM // 2)
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
        cs = cos_sin_ptr + tl.load(positions_ptr + row).to(tl.int64) * stride_cos_sin
        rot_dtype = q_ptr.dtype.element_ty
        cos = _rounded(tl.load(cs + half_d), rot_dtype)
        sin = _rounded(tl.load(cs + HEAD_DIM // 2 + half_d), rot_dtype)
    lo, hi = _split_range(ctx, split, split_len, SEQ_SPLIT, BLOCK_N)
    if WINDOW > 0:  # the query, at ctx - 1, sees keys from ctx - WINDOW on
        lo = tl.maximum(lo, ctx - WINDOW)
    tl.static_assert(ROTARY or not PRELOAD, "PRELOAD takes the new token's k and v (ROTARY)")
    if PRELOAD:
        first_pos, first_k, first_v = _kv_tile(
            k_cache_ptr, v_cache_ptr, block_table_ptr, seq, stride_table, kv_head,
            stride_cache_block, stride_cache_token, stride_cache_head, lo, hi, HEAD_DIM,
            BLOCK_SIZE, BLOCK_N, True,
        )  # fmt: skip
    if EARLY:  # the metadata above is loaded; q, k and v (the QKV GEMV's) come after the wait
        pdl_start(PDL, TRIGGER)
    if ROTARY:
        q_bias_offs = head[:, None] * HEAD_DIM
        q = _rotated(
            q_ptr, q_offs + d[None, :], cos[None, :], sin[None, :], sign[None, :],
            q_offs + partner[None, :], g_valid[:, None], stride_qp, q_bias_ptr,
            q_bias_offs + d[None, :], q_bias_offs + partner[None, :], PARTS, HAS_BIAS,
        )  # fmt: skip
    else:
        q = tl.load(q_ptr + q_offs + d[None, :], mask=live[:, None], other=0.0)
    q, scale_log2 = _query(q, scale_log2, k_cache_ptr, k_scale_ptr, UPCAST, KV_FP8)

    m = tl.full([GROUP_PAD], _NO_MAX, tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if ROTARY:
        slot = tl.load(slot_ptr + row).to(tl.int64)
        owner = (slot >= 0) & (lo <= ctx - 1) & (ctx - 1 < hi)
        # (d < HEAD_DIM) & owner would be an int tensor under the interpreter, not a mask.
        mine = d < tl.where(owner, HEAD_DIM, 0)
        k_offs = row * stride_kt + kv_head * stride_kh
        kv_bias_offs = kv_head * HEAD_DIM
        k = _rotated(
            k_new_ptr, k_offs + d, cos, sin, sign, k_offs + partner, mine, stride_kp,
            k_bias_ptr, kv_bias_offs + d, kv_bias_offs + partner, PARTS, HAS_BIAS,
        )  # fmt: skip
        v = _summed(
            v_new_ptr, row * stride_vt + kv_head * stride_vh + d, mine, stride_vp, v_bias_ptr,
            kv_bias_offs + d, PARTS, HAS_BIAS,
        )  # fmt: skip
        dst = slot * stride_cache_token + kv_head * stride_cache_head + d
        k = to_cache(k, k_scale_ptr, k_cache_ptr, KV_FP8, HAND_ROUND)
        v = to_cache(v, v_scale_ptr, v_cache_ptr, KV_FP8, HAND_ROUND)
        tl.store(k_cache_ptr + dst, k, mask=mine)
        tl.store(v_cache_ptr + dst, v, mask=mine)
        tl.debug_barrier()  # this program's reads below see the k and v it wrote
    rest = lo
    if PRELOAD:  # (ROTARY too) the new token's row of the preloaded tile: the k and v above
        new = first_pos == tl.where(owner, ctx - 1, -1)
        first_k = tl.where(new[None, :], k[:, None], first_k)
        first_v = tl.where(new[:, None], v[None, :], first_v)
        m, row_sum, acc = _attend_tile(q, m, row_sum, acc, first_pos, first_k, first_v, hi, 0,
                                       scale_log2, True, False, UPCAST, DOT_PRECISION)  # fmt: skip
        rest = lo + BLOCK_N
    # Whole tiles unmasked, then the ragged tail (if any) masked.
    full = tl.maximum(rest, rest + (hi - rest) // BLOCK_N * BLOCK_N)
    m, row_sum, acc = _attend_range(
        q, m, row_sum, acc, rest, full, 0, k_cache_ptr, v_cache_ptr, block_table_ptr, seq,
        stride_table, kv_head, stride_cache_block, stride_cache_token, stride_cache_head,
        scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    m, row_sum, acc = _attend_range(
        q, m, row_sum, acc, full, hi, 0, k_cache_ptr, v_cache_ptr, block_table_ptr, seq,
        stride_table, kv_head, stride_cache_block, stride_cache_token, stride_cache_head,
        scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, False, UPCAST, DOT_PRECISION,
    )  # fmt: skip

    if SINKS and not SPLIT:
        m, row_sum, acc = _with_sinks(m, row_sum, acc, sinks_ptr, head, g_valid)
    # An empty split (past this sequence's context, or before its window) has no keys: it
    # reports lse -inf and a zero output, never 0/0.
    has_keys = row_sum > 0
    sum_safe = tl.where(has_keys, row_sum, 1.0)
    o = acc / sum_safe[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    if SPLIT:
        num_q_heads = tl.num_programs(1) * GROUP
        num_splits = tl.num_programs(2)
        part = (i * num_q_heads + head) * num_splits + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=g_valid[:, None])
        lse = tl.where(has_keys, m + tl.log2(sum_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_valid)
    else:
        dst = out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit(do_not_specialize=["split_len", "num_splits"])
def decode_reduce_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    context_len_ptr,
    query_start_ptr,
    seq_ids_ptr,
    split_len,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEADS: tl.constexpr,
    SEQ_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ALL_DECODE: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    sinks_ptr=None,
    SINKS: tl.constexpr = False,
):
    """Grid (decode sequences, query heads / HEADS): weights each split's output by exp2 of its
    lse, for HEADS consecutive query heads of one sequence. BLOCK_N is the decode kernel's
    tile, needed only with SEQ_SPLIT. SINKS: each head's learned sink logit (sinks_ptr) joins
    the denominator once, as a split with no value."""
    pdl_start(PDL, TRIGGER)  # after the decode kernel, before o_proj's GEMV
    i = tl.program_id(0)
    num_q_heads = tl.num_programs(1) * HEADS
    seq, row, ctx = _decode_row(i, seq_ids_ptr, query_start_ptr, context_len_ptr, ALL_DECODE)
    if SEQ_SPLIT:
        split_len = _seq_split_len(ctx, num_splits, split_len, BLOCK_N)
    used = tl.cdiv(ctx, split_len)

    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    s_valid = (s < used)[None, :]
    part = (i * num_q_heads + head)[:, None] * num_splits + s[None, :]  # [HEADS, SPLITS_PAD]
    lse = tl.load(part_lse_ptr + part, mask=s_valid, other=float("-inf"))
    o = tl.load(
        part_o_ptr + part[:, :, None] * HEAD_DIM + d[None, None, :],
        mask=s_valid[:, :, None],
        other=0.0,
    )
    top = tl.max(lse, 1)
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        top = tl.maximum(top, sink)
    w = tl.exp2(lse - top[:, None])
    weighted = tl.sum(o * w[:, :, None], 1)
    total = tl.sum(w, 1)
    if SINKS:
        total += tl.exp2(sink - top)
    res = weighted / total[:, None]
    dst = out_ptr + row * stride_ot + head[:, None] * stride_oh + d[None, :]
    stored = head < tl.where(ctx > 0, num_q_heads, 0)  # every head, or none: an empty row
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=stored[:, None])


@triton.jit
def _prefill_tile(tile_seq_ptr, tile_start_ptr, query_start_ptr):
    """The program's query tile (axis 0): its sequence, first query within it, and the
    sequence's first query row and query count."""
    tile = tl.program_id(0)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    return seq, first, q_begin, tl.load(query_start_ptr + seq + 1) - q_begin


@triton.jit(do_not_specialize=["stride_table"])
def prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_table_ptr,
    context_len_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    sinks_ptr=None,
    SINKS: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
    k_scale_ptr=None,
    v_scale_ptr=None,
    KV_FP8: tl.constexpr = False,
    HAND_ROUND: tl.constexpr = False,
):
    """Grid (query tiles, KV heads). A tile is BLOCK_Q consecutive queries of one sequence times
    the GROUP query heads of one KV head, flattened into BLOCK_M >= BLOCK_Q * GROUP rows (row r:
    query r // GROUP, head r % GROUP), so each K/V tile loaded serves the whole group.
    tile_seq / tile_start give each tile's sequence and first query index within it. Query i of
    a sequence with q queries and c context tokens sits at position c - q + i and sees keys at
    positions <= that, read from the cache after this step's write. WINDOW > 0 (a sliding
    layer): and > that - WINDOW. SINKS: each query head's learned sink logit (sinks_ptr)
    joins the softmax as a column with no value. KV_FP8: an e4m3 cache, read as decode_kernel
    reads it (HAND_ROUND unused: it writes nothing).
    """
    kv_head = tl.program_id(1)
    seq, first, q_begin, q_len = _prefill_tile(tile_seq_ptr, tile_start_ptr, query_start_ptr)
    ctx = tl.load(context_len_ptr + seq)
    prefix = ctx - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    qi = first + r // GROUP
    head = kv_head * GROUP + r % GROUP
    r_valid = (r < BLOCK_Q * GROUP) & (qi < q_len)
    q_rows = (q_begin + qi) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=r_valid[:, None], other=0.0)
    q, scale_log2 = _query(q, scale_log2, k_cache_ptr, k_scale_ptr, UPCAST, KV_FP8)
    q_pos = prefix + qi

    m = tl.full([BLOCK_M], _NO_MAX, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys before the tile's first query position are visible to all its rows: those whole
    # tiles run unmasked; the rest, up to the last query's own position, masked and causal.
    full = (prefix + first) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(ctx, prefix + first + BLOCK_Q)
    if WINDOW > 0:  # and keys before the first row's window are skipped, its edge masked
        start, head_end, full = _window_ranges(0, prefix + first, kv_end, WINDOW, BLOCK_N)
        m, row_sum, acc = _attend_range(
            q, m, row_sum, acc, start, head_end, q_pos, k_cache_ptr, v_cache_ptr,
            block_table_ptr, seq, stride_table, kv_head, stride_cache_block, stride_cache_token,
            stride_cache_head, scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True, UPCAST,
            DOT_PRECISION, WINDOW,
        )  # fmt: skip
        m, row_sum, acc = _attend_range(
            q, m, row_sum, acc, head_end, full, q_pos, k_cache_ptr, v_cache_ptr,
            block_table_ptr, seq, stride_table, kv_head, stride_cache_block, stride_cache_token,
            stride_cache_head, scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, UPCAST,
            DOT_PRECISION,
        )  # fmt: skip
    else:
        m, row_sum, acc = _attend_range(
            q, m, row_sum, acc, 0, full, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, seq,
            stride_table, kv_head, stride_cache_block, stride_cache_token, stride_cache_head,
            scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, False, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    m, row_sum, acc = _attend_range(
        q, m, row_sum, acc, full, kv_end, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, seq,
        stride_table, kv_head, stride_cache_block, stride_cache_token, stride_cache_head,
        scale_log2, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, True, UPCAST, DOT_PRECISION, WINDOW,
    )  # fmt: skip
    if SINKS:
        m, row_sum, acc = _with_sinks(m, row_sum, acc, sinks_ptr, head, r_valid)

    # Padding rows never see a key; every real row sees at least position 0.
    o = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    o_rows = (q_begin + qi) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_valid[:, None],
    )


@triton.jit
def _dense_kv(k_desc, v_desc, row, kv_head, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              UPCAST: tl.constexpr):  # fmt: skip
    """BLOCK_N consecutive tokens' K and V of one KV head, from token `row` of the step."""
    k = k_desc.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = v_desc.load([row, kv_head, 0]).reshape(BLOCK_N, HEAD_DIM)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _dense_softmax_step(s, v, m, row_sum, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """_softmax_step over raw scores s (-inf where hidden): the scale folds into the max and
    the exponent's one multiply-add, and the P @ V product accumulates into acc in place."""
    m_new = tl.maximum(m, tl.max(s, 1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, row_sum, acc


@triton.jit
def dense_prefill_kernel(
    q_desc,
    k_desc,
    v_desc,
    out_ptr,
    query_start_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    scale_log2,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    sinks_ptr=None,
    SINKS: tl.constexpr = False,
    WINDOW: tl.constexpr = 0,
):
    """Grid (query tiles, KV heads): causal attention of fresh prompts (no cached prefix: query
    i of a sequence sits at position i) over the step's own q, k and v, read by TMA from
    descriptors over [tokens, heads, head_dim] (q: blocks of [BLOCK_Q, GROUP, HEAD_DIM], k and
    v: [BLOCK_N, 1, HEAD_DIM]). k must hold what the cache holds (rotated). Tiles as in
    prefill_kernel: BLOCK_Q queries of one sequence times the GROUP query heads of one KV head,
    row r = query r // GROUP, head r % GROUP. A tile reaching past its sequence reads the next
    sequence's rows (or zeros past the step): those keys lie after every real query and are
    masked by causality, those queries are never stored. WINDOW and SINKS as in
    prefill_kernel.
    """
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP
    kv_head = tl.program_id(1)
    _, first, q_begin, q_len = _prefill_tile(tile_seq_ptr, tile_start_ptr, query_start_ptr)

    q = q_desc.load([q_begin + first, kv_head * GROUP, 0]).reshape(BLOCK_M, HEAD_DIM)
    if UPCAST:
        q = q.to(tl.float32)
    r = tl.arange(0, BLOCK_M)
    qi = first + r // GROUP
    m = tl.full([BLOCK_M], _NO_MAX, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys before the tile's first query are visible to all its rows: whole tiles, unmasked.
    full = first // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(q_len, first + BLOCK_Q)
    if WINDOW > 0:  # keys before the first row's window skipped, its edge masked
        lo, head_end, full = _window_ranges(0, first, kv_end, WINDOW, BLOCK_N)
        for start in range(lo, head_end, BLOCK_N):
            k, v = _dense_kv(k_desc, v_desc, q_begin + start, kv_head, BLOCK_N, HEAD_DIM, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            pos = start + tl.arange(0, BLOCK_N)
            seen = (pos[None, :] < head_end) & (pos[None, :] <= qi[:, None])
            seen = seen & (pos[None, :] > qi[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
            m, row_sum, acc = _dense_softmax_step(s, v, m, row_sum, acc, scale_log2,
                                                  DOT_PRECISION)  # fmt: skip
        for start in range(head_end, full, BLOCK_N):
            k, v = _dense_kv(k_desc, v_desc, q_begin + start, kv_head, BLOCK_N, HEAD_DIM, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            m, row_sum, acc = _dense_softmax_step(s, v, m, row_sum, acc, scale_log2,
                                                  DOT_PRECISION)  # fmt: skip
    else:
        for start in range(0, full, BLOCK_N):
            k, v = _dense_kv(k_desc, v_desc, q_begin + start, kv_head, BLOCK_N, HEAD_DIM, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            m, row_sum, acc = _dense_softmax_step(s, v, m, row_sum, acc, scale_log2,
                                                  DOT_PRECISION)  # fmt: skip
    for start in range(full, kv_end, BLOCK_N):
        k, v = _dense_kv(k_desc, v_desc, q_begin + start, kv_head, BLOCK_N, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        pos = start + tl.arange(0, BLOCK_N)
        seen = pos[None, :] <= qi[:, None]
        if WINDOW > 0:
            seen = seen & (pos[None, :] > qi[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
        m, row_sum, acc = _dense_softmax_step(s, v, m, row_sum, acc, scale_log2, DOT_PRECISION)
    head = kv_head * GROUP + r % GROUP
    if SINKS:  # the max is in log2 units already (scale folded in): the sink joins it there
        m, row_sum, acc = _with_sinks(m, row_sum, acc, sinks_ptr, head, qi < q_len)

    # Every real row sees its own position, so row_sum > 0 (padding rows are not stored).
    o = acc / row_sum[:, None]
    o_rows = (q_begin + qi).to(tl.int64) * stride_ot + head * stride_oh
    d = tl.arange(0, HEAD_DIM)
    tl.store(
        out_ptr + o_rows[:, None] + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=(qi < q_len)[:, None],
    )
