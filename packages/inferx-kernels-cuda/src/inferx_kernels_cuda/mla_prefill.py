"""Triton MLA prefill: prompt chunks of multi-head latent attention (DeepSeek-V2) in the plain
form, their context's latents expanded to per-head keys and values and attended causally.

Per layer and pass: the pass's context rows (latent + rope key, the cache's rows: the step's own
rows for fresh prompts, else gathered from the paged cache) go through kv_b_proj (the layer's
MLAWeights.expand, one GEMM) to [rows, heads, nope + v]; mla_prefill_kernel then attends each
query tile of one head over them: scores = q_nope . k_nope + q_pe . k_pe (the rope key shared by
every head, read from the context rows), values the expanded v. Softmax runs in base 2 (scores
times scale * log2(e)).

Query i of a sequence with q queries and c context tokens sits at position c - q + i and sees
positions <= that. A context longer than the pass budget is attended in pieces over several
passes (each a gather, an expansion and a launch), the running output and log2-sum-exp of each
query row carried between passes in float32 and merged: expanded keys and values never exceed
the budget's rows, whatever the cached prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from inferx_core.attention_torch import from_fp8, to_fp8
from inferx_core.batch import pack_aligned, to_device
from inferx_core.interfaces.attention import MLAWeights
from inferx_kernels_cuda.triton_kernels import _NO_MAX, _dense_softmax_step


@triton.jit
def _rows(src, row, col, limit, stride, BLOCK: tl.constexpr, WIDTH: tl.constexpr,
          WIDTH_PAD: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Rows row.. row + BLOCK of a [rows, cols] source, columns col.. col + WIDTH (padded to
    WIDTH_PAD with zeros): by TMA from a descriptor (rows past the tensor read as zeros; WIDTH
    == WIDTH_PAD), else by pointer loads where row index < limit."""
    if TMA:
        x = src.load([row, col])
    else:
        r = row + tl.arange(0, BLOCK)
        d = tl.arange(0, WIDTH_PAD)
        mask = (r < limit)[:, None] & (d < WIDTH)[None, :]
        x = tl.load(src + r.to(tl.int64)[:, None] * stride + col + d[None, :], mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _mla_step(q_nope, q_pe, m, row_sum, acc, k_src, v_src, pe_src, head_col, row, limit,
              stride_kv, stride_pe, scale_log2, seen, key_ok, MASKED: tl.constexpr,
              NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, NOPE_PAD: tl.constexpr,
              ROPE_PAD: tl.constexpr, V_PAD: tl.constexpr, PE_COL: tl.constexpr,
              BLOCK_N: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr,
              DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One BLOCK_N-key tile from context row `row`: scores of the tile's queries (hidden where
    `seen` is false, when MASKED), folded into the running (max, sum, unnormalised output).
    MASKED: values of rows past the sequence's keys (key_ok false) are zeroed, as a hidden
    score's weight of 0 times a NaN there would still be NaN: in a mixed graph the rows after
    a step's last token are padding, whatever they hold."""
    k_nope = _rows(k_src, row, head_col, limit, stride_kv, BLOCK_N, NOPE, NOPE_PAD, TMA, UPCAST)
    k_pe = _rows(pe_src, row, PE_COL, limit, stride_pe, BLOCK_N, ROPE, ROPE_PAD, TMA, UPCAST)
    v = _rows(v_src, row, head_col + NOPE, limit, stride_kv, BLOCK_N, V, V_PAD, TMA, UPCAST)
    s = tl.dot(q_nope, tl.trans(k_nope), input_precision=DOT_PRECISION)
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
        v = tl.where(key_ok[:, None], v, tl.zeros_like(v))
    return _dense_softmax_step(s, v, m, row_sum, acc, scale_log2, DOT_PRECISION)


@triton.jit(do_not_specialize=["num_rows", "num_tokens"])
def mla_prefill_kernel(
    q_nope_src,
    q_pe_src,
    k_src,
    v_src,
    pe_src,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    query_start_ptr,
    context_len_ptr,
    tile_seq_ptr,
    tile_start_ptr,
    key_lo_ptr,
    key_hi_ptr,
    row0_ptr,
    scale_log2,
    num_rows,
    num_tokens,
    stride_q,
    stride_kv,
    stride_pe,
    stride_ot,
    stride_oh,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    V: tl.constexpr,
    NOPE_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    V_PAD: tl.constexpr,
    PE_COL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (heads, query tiles). A tile is BLOCK_M consecutive queries of one sequence
    (tile_seq, tile_start) in one head; it attends to context positions [key_lo, key_hi) of
    its sequence (this pass's piece), position p at row row0 + p of kv (the expanded context,
    [rows, heads * (NOPE + V)], head h's nope key then value at columns h * (NOPE + V)..) and
    of pe (the context rows, the rope key at column PE_COL); q is [tokens, heads * (NOPE +
    ROPE)]. Sources are TMA descriptors (TMA) or pointers with row strides. Rows whose whole
    context is in the pass write out [tokens, heads, V]; those of a context spread over several
    passes write the piece's normalised output and log2-sum-exp (part_o [tokens, heads, V_PAD],
    part_lse [tokens, heads], float32) for merge_pieces. One compiled variant serves both: the
    epilogue's stores are masked, and nothing is read back (a read-modify-write of the running
    state made the kernel spill)."""
    h = tl.program_id(0)
    num_heads = tl.num_programs(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    ctx = tl.load(context_len_ptr + seq)
    lo = tl.load(key_lo_ptr + seq)
    hi = tl.load(key_hi_ptr + seq)
    row0 = tl.load(row0_ptr + seq)
    first_pos = ctx - q_len + first

    r = tl.arange(0, BLOCK_M)
    qi = first + r
    q_ok = qi < q_len
    q_pos = first_pos + r
    q_col = h * (NOPE + ROPE)
    q_row = q_begin + first
    q_nope = _rows(q_nope_src, q_row, q_col, num_tokens, stride_q, BLOCK_M, NOPE, NOPE_PAD, TMA,
                   UPCAST)  # fmt: skip
    q_pe = _rows(q_pe_src, q_row, q_col + NOPE, num_tokens, stride_q, BLOCK_M, ROPE, ROPE_PAD,
                 TMA, UPCAST)  # fmt: skip
    kv_col = h * (NOPE + V)

    # (the output's offsets before the loop: computed after it, ptxas allocated far more
    # registers for sm_90)
    rows = (q_begin + qi).to(tl.int64)
    part = rows * num_heads + h
    d = tl.arange(0, V_PAD)
    m = tl.full([BLOCK_M], _NO_MAX, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_PAD], tl.float32)
    # Keys before the tile's first query are visible to all its rows: whole tiles, unmasked;
    # the rest up to its last query's position masked and causal.
    full = lo + tl.maximum(tl.minimum(hi, first_pos) - lo, 0) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(hi, first_pos + BLOCK_M)
    for start in range(lo, full, BLOCK_N):
        m, row_sum, acc = _mla_step(
            q_nope, q_pe, m, row_sum, acc, k_src, v_src, pe_src, kv_col, row0 + start, num_rows,
            stride_kv, stride_pe, scale_log2, None, None, False, NOPE, ROPE, V, NOPE_PAD, ROPE_PAD,
            V_PAD, PE_COL, BLOCK_N, TMA, UPCAST, DOT_PRECISION,
        )  # fmt: skip
    for start in range(full, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        seen = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        m, row_sum, acc = _mla_step(
            q_nope, q_pe, m, row_sum, acc, k_src, v_src, pe_src, kv_col, row0 + start, num_rows,
            stride_kv, stride_pe, scale_log2, seen, key_ok, True, NOPE, ROPE, V, NOPE_PAD, ROPE_PAD,
            V_PAD, PE_COL, BLOCK_N, TMA, UPCAST, DOT_PRECISION,
        )  # fmt: skip

    o = acc / tl.maximum(row_sum, 1e-30)[:, None]
    # The whole context in this pass: the output. A piece of it: the piece's normalised output
    # and log2-sum-exp, for the host to merge (a scalar condition as a mask of its own: scalar
    # & tensor trips the interpreter).
    whole = r < tl.where((lo == 0) & (hi == ctx), BLOCK_M, 0)
    piece = q_ok & ~whole
    lse = tl.where(row_sum > 0, m + tl.log2(tl.maximum(row_sum, 1e-30)), _NO_MAX)
    tl.store(part_lse_ptr + part, lse, mask=piece)
    tl.store(part_o_ptr + part[:, None] * V_PAD + d[None, :], o, mask=piece[:, None])
    o_dst = out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(o_dst, o.to(out_ptr.dtype.element_ty), mask=(q_ok & whole)[:, None] & (d < V)[None, :])


@dataclass
class PrefillPass:
    """One pass of a step's MLA prefill: which context rows it expands and which query tiles
    attend to them. slots: the rows' cache slots, gathered from the paged cache (None: the
    step's own rows, token t at row t). key_lo / key_hi / row0 ([num_seqs] int32): each
    sequence's piece of its context in this pass, positions [key_lo, key_hi), position p at row
    row0 + p (sequences outside the pass have no tiles in it). merge_rows: the query rows of
    sequences spread over several passes that this pass attends (their pieces to merge), and
    merge_at their places among the plan's split_rows."""

    slots: torch.Tensor | None
    num_rows: int  # rows expanded (None slots: the step's tokens)
    key_lo: torch.Tensor
    key_hi: torch.Tensor
    row0: torch.Tensor
    tile_seq: torch.Tensor  # [tiles] int32
    tile_start: torch.Tensor  # [tiles] int32, the tile's first query within its sequence
    tiles: int
    merge_rows: torch.Tensor | None = None  # [rows] int64
    merge_at: torch.Tensor | None = None


@dataclass
class PrefillPlan:
    """A step's MLA prefill: its passes (several only when a context outgrows the budget) and
    split_rows, the query rows of sequences spread over several passes (int64)."""

    passes: list[PrefillPass]
    block_m: int
    split_rows: torch.Tensor | None = None
    # a mixed graph's plan: its chunks over a cached prefix attend only their own rows here
    # (key_lo the prefix), and their pieces are kept for the caller to merge with the prefix's
    chunks: bool = False

    @property
    def pieces(self) -> bool:
        return len(self.passes) > 1


def query_tiles(
    query_lens: list[int], seqs: list[int], block_m: int
) -> tuple[list[int], list[int]]:
    """Query tiles of `seqs`, those with later first queries (more keys to see) first."""
    tiles = [(i, s) for i in seqs for s in range(0, query_lens[i], block_m)]
    tiles.sort(key=lambda t: -t[1])
    return [i for i, _ in tiles], [s for _, s in tiles]


def plan_prefill(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    block_m: int,
    max_rows: int,
    device: torch.device,
) -> PrefillPlan | None:
    """The prefill of the step's sequences of more than one query (None if it has none).

    If every one is a fresh prompt (no cached prefix), one pass over the step's own rows.
    Otherwise their contexts, concatenated in step order, are gathered from the cache in passes
    of at most max_rows rows."""
    prompts = [i for i, q in enumerate(query_lens) if q > 1]
    if not prompts:
        return None
    n = len(query_lens)
    if all(query_lens[i] == context_lens[i] for i in prompts):
        starts = np.cumsum([0, *query_lens[:-1]]).tolist()
        fresh = (None, sum(query_lens), [0] * n, list(context_lens), starts)
        return PrefillPlan([_pass(*fresh, query_lens, prompts, block_m, device)], block_m)

    total = sum(context_lens[i] for i in prompts)
    passes = []
    seqs_of: list[list[int]] = []  # each pass's sequences
    for lo in range(0, total, max_rows):
        hi = min(lo + max_rows, total)
        key_lo, key_hi, row0 = [0] * n, [0] * n, [0] * n
        slots, seqs = [], []
        at = 0  # the sequence's first row in the concatenation
        for i in prompts:
            c = context_lens[i]
            a, b = max(lo, at), min(hi, at + c)
            if a < b:
                key_lo[i], key_hi[i], row0[i] = a - at, b - at, at - lo
                pos = np.arange(a - at, b - at)
                table = np.asarray(block_tables[i], dtype=np.int64)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
                seqs.append(i)
            at += c
        gather = to_device(torch.from_numpy(np.concatenate(slots)), device)
        passes.append(
            _pass(gather, hi - lo, key_lo, key_hi, row0, query_lens, seqs, block_m, device)
        )
        seqs_of.append(seqs)
    if len(passes) == 1:
        return PrefillPlan(passes, block_m)
    # Sequences in several passes: where their query rows sit among the split rows.
    starts = np.cumsum([0, *query_lens]).tolist()
    split = [i for i in prompts if sum(i in seqs for seqs in seqs_of) > 1]
    at, rows = {}, []
    for i in split:
        at[i] = len(rows)
        rows += range(starts[i], starts[i + 1])
    for p, seqs in zip(passes, seqs_of, strict=True):
        mine = [i for i in seqs if i in at]
        if mine:
            p.merge_rows = _rows_of(mine, [starts[i] for i in mine], query_lens, device)
            p.merge_at = _rows_of(mine, [at[i] for i in mine], query_lens, device)
    return PrefillPlan(passes, block_m, to_device(torch.tensor(rows, dtype=torch.int64), device))


def _rows_of(
    seqs: list[int], firsts: list[int], query_lens: list[int], device: torch.device
) -> torch.Tensor:
    """query_lens[i] consecutive indices from each first, for the sequences i of seqs."""
    idx = [np.arange(f, f + query_lens[i]) for i, f in zip(seqs, firsts, strict=True)]
    return to_device(torch.from_numpy(np.concatenate(idx).astype(np.int64)), device)


def _pass(
    slots: torch.Tensor | None,
    num_rows: int,
    key_lo: list[int],
    key_hi: list[int],
    row0: list[int],
    query_lens: list[int],
    seqs: list[int],
    block_m: int,
    device: torch.device,
) -> PrefillPass:
    tile_seq, tile_start = query_tiles(query_lens, seqs, block_m)
    parts = [key_lo, key_hi, row0, tile_seq, tile_start]
    packed, at = pack_aligned(parts, torch.int32)
    packed = to_device(packed, device)
    got = [packed[o : o + len(p)] for o, p in zip(at, parts, strict=True)]
    return PrefillPass(slots, num_rows, *got, tiles=len(tile_seq))


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def can_tma(nope: int, rope: int, v: int) -> bool:
    """Whether the TMA loads take these widths (each a power of two of at least 16)."""
    return _pow2(nope) and _pow2(rope) and _pow2(v)


def mla_prefill(
    q: torch.Tensor,
    rows: torch.Tensor,
    cache: torch.Tensor,
    mla: MLAWeights,
    scale: float,
    plan: PrefillPlan,
    query_start: torch.Tensor,
    context_len: torch.Tensor,
    out: torch.Tensor,
    block_n: int = 64,
    launch: dict[str, Any] | None = None,
    tma: bool = False,
    k_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's prompt rows of out [T, H, v_head_dim] from q [T, H, nope + rope] (rope part
    rotated): rows [T, rank + rope] are the step's cache rows (already written to cache
    [num_blocks, block_size, 1, rank + rope]); query_start [num_seqs + 1] and context_len
    [num_seqs] int32 the step's. tma: read q, keys and values through TMA descriptors (a
    Hopper GPU, power-of-two widths: can_tma). An e4m3 cache holds rows / k_scale ([1]
    float32; None: 1.0): attention then reads the latents it holds, dequantized to q's dtype
    as TorchAttention does, the step's own rows too (quantized as the cache write does), so a
    prompt sees what later decodes will.

    Returns the pieces (part_o [T, H, V_PAD], part_lse [T, H], float32): sized T only where
    the plan has several passes or keeps chunks' pieces (plan.chunks: rows whose context this
    pass does not hold whole write them instead of out, for the caller to merge)."""
    tokens, heads, qk = q.shape
    nope, v_dim = mla.qk_nope_head_dim, mla.v_head_dim
    rope = qk - nope
    width = rows.shape[-1]
    rank = width - rope
    if rows.shape[0] != tokens or cache.shape[-1] != width or out.shape != (tokens, heads, v_dim):
        raise ValueError(
            f"MLA prefill: q {tuple(q.shape)}, rows {tuple(rows.shape)}, cache "
            f"{tuple(cache.shape)}, out {tuple(out.shape)} do not fit together"
        )
    if tma and not can_tma(nope, rope, v_dim):
        raise ValueError(f"MLA prefill: TMA loads need power-of-two widths >= 16; got "
                         f"nope {nope}, rope {rope}, v {v_dim}")  # fmt: skip
    interp = _interpreting()
    upcast = interp and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    q2 = q.reshape(tokens, heads * qk)
    if q2.stride(-1) != 1 or (tma and not q2.is_contiguous()):
        q2 = q2.contiguous()
    block_m = plan.block_m
    pads = {
        "NOPE_PAD": max(16, triton.next_power_of_2(nope)),
        "ROPE_PAD": max(16, triton.next_power_of_2(rope)),
        "V_PAD": max(16, triton.next_power_of_2(v_dim)),
    }
    v_pad = pads["V_PAD"]
    part = (tokens, heads) if plan.pieces or plan.chunks else (1, 1)  # 1: never written
    part_o = torch.empty(*part, v_pad, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(part, dtype=torch.float32, device=q.device)
    run = None
    if plan.split_rows is not None:
        n = plan.split_rows.shape[0]
        run = (
            torch.zeros(n, heads, v_pad, dtype=torch.float32, device=q.device),
            torch.full((n, heads), float("-inf"), dtype=torch.float32, device=q.device),
        )
    flat = cache.view(-1, width)
    fp8 = cache.dtype == torch.float8_e4m3fn
    if fp8:
        rows = from_fp8(to_fp8(rows, k_scale), k_scale, q.dtype)
    for p in plan.passes:
        if p.slots is None:
            context = rows
        elif fp8:  # moved as bytes, as TorchAttention does
            picked = flat.view(torch.uint8).index_select(0, p.slots).view(cache.dtype)
            context = from_fp8(picked, k_scale, q.dtype)
        else:
            context = flat.index_select(0, p.slots)
        if context.stride(-1) != 1:
            context = context.contiguous()
        kv = mla.expand(context[:, :rank]).reshape(context.shape[0], heads * (nope + v_dim))
        if kv.stride(-1) != 1 or (tma and not kv.is_contiguous()):
            kv = kv.contiguous()
        if tma:
            srcs = tuple(
                TensorDescriptor.from_tensor(t, block_shape=shape)
                for t, shape in (
                    (q2, [block_m, nope]),
                    (q2, [block_m, rope]),
                    (kv, [block_n, nope]),
                    (kv, [block_n, v_dim]),
                    (context, [block_n, rope]),
                )
            )
        else:
            srcs = (q2, q2, kv, kv, context)
        mla_prefill_kernel[(heads, p.tiles)](
            *srcs,
            out,
            part_o,
            part_lse,
            query_start,
            context_len,
            p.tile_seq,
            p.tile_start,
            p.key_lo,
            p.key_hi,
            p.row0,
            scale * 1.4426950408889634,
            context.shape[0],
            tokens,
            q2.stride(0),
            kv.stride(0),
            context.stride(0),
            out.stride(0),
            out.stride(1),
            NOPE=nope,
            ROPE=rope,
            V=v_dim,
            PE_COL=rank,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            TMA=tma,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            **pads,
            **(launch or {}),
        )
        if run is not None and p.merge_rows is not None and p.merge_at is not None:
            merge_pieces(run, part_o, part_lse, p.merge_rows, p.merge_at)
    if run is not None and plan.split_rows is not None:
        out.index_copy_(0, plan.split_rows, run[0][..., :v_dim].to(out.dtype))
    return part_o, part_lse


def merge_pieces(
    run: tuple[torch.Tensor, torch.Tensor],
    part_o: torch.Tensor,
    part_lse: torch.Tensor,
    rows: torch.Tensor,
    at: torch.Tensor,
) -> None:
    """Fold a pass's pieces (part_o / part_lse at query rows `rows`) into the running
    normalised outputs and log2-sum-exps (run, at places `at`; -inf before a row's first)."""
    run_o, run_lse = run
    o_new, lse_new = part_o.index_select(0, rows), part_lse.index_select(0, rows)
    o_old, lse_old = run_o.index_select(0, at), run_lse.index_select(0, at)
    top = torch.maximum(lse_old, lse_new)
    w_old, w_new = torch.exp2(lse_old - top), torch.exp2(lse_new - top)
    total = w_old + w_new
    o = (o_old * w_old[..., None] + o_new * w_new[..., None]) / total[..., None]
    run_o.index_copy_(0, at, o)
    run_lse.index_copy_(0, at, top + torch.log2(total))
