"""Fused MoE on the GPU without a host synchronisation: top-k routing in one kernel, the token /
expert pairs grouped by expert on the device, and a grouped GEMM over the experts (gate_up with
its bias and activation in the epilogue, then down with its bias and the routing weight) over
dense (bf16 / fp16 / fp32), FP8 (per output channel), MXFP4 or W4A16 (GPTQ / AWQ) weights
dequantized in registers (dense fp16 / bf16 ones at decode sizes read through TMA descriptors
on Hopper: moe_tma_gemv_kernel; MXFP4's GEMV may read its weight words so too:
moe_gemv_tma_kernel), then each token's top-k outputs summed in a fixed order.

Every launch's grid depends only on the token count, which the host knows, so a step runs the
same launches under CUDA-graph capture and replay. The design and its reasons are in
docs/ARCHITECTURE.md's "Mixture of experts".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from inferx_core.interfaces.moe import ExpertsSpec, ExpertWeights, RouterSpec
from inferx_kernels_cuda.tma_gemv import has_tma, resident_config
from inferx_kernels_cuda.w4a16 import _dequantized as _w4_tile
from inferx_kernels_cuda.w4a16 import _group_shift

# --- routing -------------------------------------------------------------------------------------


# Per-step counts (tokens, pairs, tiles) are not specialised on: one compile serves every step.
@triton.jit(do_not_specialize=["num_tokens"])
def topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    stride_part,
    num_tokens,
    num_experts,
    scaling,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    K_PAD: tl.constexpr,
    SOFTMAX_ALL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    PARTS: tl.constexpr,
):
    """BLOCK_T tokens a program, all experts in one tile; the logits are the fp32 sum of PARTS
    partial logits stride_part apart (a split-K router GEMM's). Picks the TOP_K largest logits (the
    first index among equal ones), largest first; a pick's weight is exp(logit - max) over the
    softmax's denominator: the sum over all experts (SOFTMAX_ALL: softmax, then top-k, not
    renormalized) or over the picked ones (softmax after top-k, which equals softmax, top-k and
    renormalize); then times `scaling`. Rows of TOP_K + SHARED: after the picks, the SHARED
    shared experts num_experts + i with weight 1.0 (unscaled)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    kcols = tl.arange(0, K_PAD)
    row_ok = rows < num_tokens
    ptrs = logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < num_experts)
    x = tl.load(ptrs, mask=mask, other=-float("inf")).to(tl.float32)
    for p in tl.static_range(1, PARTS):
        x += tl.load(ptrs + p * stride_part, mask=mask, other=-float("inf")).to(tl.float32)
    top = tl.where(row_ok, tl.max(x, axis=1), 0.0)
    if SOFTMAX_ALL:
        denom = tl.sum(tl.exp(x - top[:, None]), axis=1)
    else:
        denom = tl.zeros([BLOCK_T], dtype=tl.float32)
    picked_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    picked_id = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        m = tl.max(x, axis=1)
        idx = tl.min(tl.where(x == m[:, None], cols[None, :], BLOCK_E), axis=1)
        # a NaN row matches nothing: keep its ids in range rather than index past the experts
        idx = tl.minimum(idx, num_experts - 1)
        w = tl.exp(tl.where(row_ok, m, 0.0) - top)
        if not SOFTMAX_ALL:
            denom += w
        picked_w = tl.where(kcols[None, :] == j, w[:, None], picked_w)
        picked_id = tl.where(kcols[None, :] == j, idx[:, None], picked_id)
        x = tl.where(cols[None, :] == idx[:, None], -float("inf"), x)
    picked_w = picked_w / tl.where(row_ok, denom, 1.0)[:, None] * scaling
    if SHARED:
        fixed = kcols[None, :] >= TOP_K
        picked_w = tl.where(fixed, 1.0, picked_w)
        picked_id = tl.where(fixed, num_experts - TOP_K + kcols[None, :], picked_id)
    out = rows[:, None].to(tl.int64) * (TOP_K + SHARED) + kcols[None, :]
    out_mask = row_ok[:, None] & (kcols[None, :] < TOP_K + SHARED)
    tl.store(weights_ptr + out, picked_w, mask=out_mask)
    tl.store(ids_ptr + out, picked_id.to(tl.int64), mask=out_mask)


def fusable_router(spec: RouterSpec, selection_bias: torch.Tensor | None) -> bool:
    """Whether topk_softmax runs this routing: softmax scoring (either order), no expert groups
    and no selection bias (DeepSeek's group-limited and biased routings stay on the torch one)."""
    return (
        spec.scoring == "softmax"
        and spec.num_groups == 1
        and not spec.selection_bias
        and selection_bias is None
    )


def topk_softmax(logits: torch.Tensor, spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """inferx_core.moe.route for a fusable_router spec in one launch: logits [T, E], or [S, T,
    E] partial logits summed in fp32 first -> (topk_weights [T, k + s] float32, topk_ids
    [T, k + s] int64): the picks largest weight first, then the spec's s shared experts
    (1.0, E + i), written by the same launch."""
    parts = logits if logits.dim() == 3 else logits.unsqueeze(0)
    if parts.dim() != 3 or parts.shape[2] != spec.num_experts:
        raise ValueError(
            f"topk_softmax: logits must be [tokens, {spec.num_experts}] or [parts, tokens, "
            f"{spec.num_experts}], got {tuple(logits.shape)}"
        )
    if parts.stride(2) != 1:
        parts = parts.contiguous()
    s, t, e, k = parts.shape[0], parts.shape[1], spec.num_experts, spec.top_k
    width = k + spec.shared
    weights = torch.empty(t, width, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, width, dtype=torch.int64, device=logits.device)
    if t:
        block_e = triton.next_power_of_2(e)
        block_t = max(1, min(16, 4096 // block_e))
        topk_softmax_kernel[(triton.cdiv(t, block_t),)](
            parts, weights, ids, parts.stride(1), parts.stride(0), t, e, float(spec.scaling),
            TOP_K=k, SHARED=spec.shared, K_PAD=triton.next_power_of_2(width),
            SOFTMAX_ALL=not (spec.softmax_after_topk or spec.renormalize),
            BLOCK_T=block_t, BLOCK_E=block_e, PARTS=s, num_warps=4,
        )  # fmt: skip
    return weights, ids


# --- grouping the (token, expert) pairs by expert ------------------------------------------------
#
# A pair is topk_ids' flat index i = token * top_k + j. sorted_ids lists the pairs expert by
# expert, each expert's segment padded to a multiple of BLOCK_M with the sentinel num_pairs, so
# that a BLOCK_M-row tile of it belongs to one expert (block_expert[tile]); num_padded is the
# segments' total length. Tiles past it are never read (the GEMMs stop there), so nothing is
# zeroed and no count reaches the host.


@triton.jit
def _chunk(ids_ptr, start, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Pairs start..start+CHUNK: (their indices, each one's one-hot expert row [CHUNK,
    BLOCK_E], the chunk's count per expert, each pair's rank among its expert's pairs here)."""
    i = start + tl.arange(0, CHUNK)
    expert = tl.load(ids_ptr + i, mask=i < num_pairs, other=-1).to(tl.int32)
    onehot = (expert[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    counts = tl.sum(onehot, axis=0)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    return i, onehot, counts, rank


@triton.jit
def _plan(
    counts,
    starts_ptr,
    block_expert_ptr,
    num_padded_ptr,
    sorted_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """From the pairs' count per expert: each expert's padded segment start (stored, and
    returned), the sentinels in each segment's padding, the expert of every tile up to
    max_blocks (-1 past the last segment) and the padded total."""
    experts = tl.arange(0, BLOCK_E)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    tl.store(starts_ptr + experts, starts, mask=experts < num_experts)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    pad = tl.arange(0, BLOCK_M)
    pad_pos = starts[:, None] + counts[:, None] + pad[None, :]
    pad_mask = (pad[None, :] < (padded - counts)[:, None]) & (experts[:, None] < num_experts)
    tl.store(sorted_ptr + pad_pos, tl.zeros([BLOCK_E, BLOCK_M], tl.int32) + num_pairs, pad_mask)
    total = tl.sum(padded, axis=0)
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_M
        # the expert whose segment holds row `first`: how many segments end at or before it
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first < total, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_blocks)
    return starts


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def align_one_kernel(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    starts_ptr,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The whole grouping in one program (few pairs: a decode step): count, plan, scatter."""
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(0, num_pairs, CHUNK):
        _, _, chunk_counts, _ = _chunk(ids_ptr, c, num_pairs, CHUNK, BLOCK_E)
        counts += chunk_counts
    starts = _plan(
        counts, starts_ptr, block_expert_ptr, num_padded_ptr, sorted_ptr, num_pairs,
        num_experts, max_blocks, BLOCK_M, BLOCK_E, BLOCK_B,
    )  # fmt: skip
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(0, num_pairs, CHUNK):
        i, onehot, chunk_counts, rank = _chunk(ids_ptr, c, num_pairs, CHUNK, BLOCK_E)
        pos = tl.sum(onehot * (starts + seen)[None, :], axis=1) + rank
        tl.store(sorted_ptr + pos, i, mask=i < num_pairs)
        seen += chunk_counts


@triton.jit(do_not_specialize=["num_pairs"])
def align_count_kernel(
    ids_ptr, chunk_counts_ptr, rank_ptr, num_pairs, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Many pairs, pass 1 of 3: a program's chunk counts per expert, and each pair's rank
    among its expert's pairs in the chunk."""
    c = tl.program_id(0)
    i, _, counts, rank = _chunk(ids_ptr, c * CHUNK, num_pairs, CHUNK, BLOCK_E)
    tl.store(chunk_counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    tl.store(rank_ptr + i, rank, mask=i < num_pairs)


@triton.jit(do_not_specialize=["num_chunks", "num_pairs", "max_blocks"])
def align_plan_kernel(
    chunk_counts_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    starts_ptr,
    num_chunks,
    num_pairs,
    num_experts,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Pass 2, one program: each chunk's first rank per expert (an exclusive prefix sum over
    the chunks, in place of its counts), then the plan from the totals."""
    experts = tl.arange(0, BLOCK_E)
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        ptrs = chunk_counts_ptr + chunks[:, None] * BLOCK_E + experts[None, :]
        mask = chunks[:, None] < num_chunks
        counts = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + total[None, :], mask=mask)
        total += tl.sum(counts, axis=0)
    _plan(
        total, starts_ptr, block_expert_ptr, num_padded_ptr, sorted_ptr, num_pairs,
        num_experts, max_blocks, BLOCK_M, BLOCK_E, BLOCK_B,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def align_scatter_kernel(
    ids_ptr,
    chunk_first_ptr,
    rank_ptr,
    starts_ptr,
    sorted_ptr,
    num_pairs,
    CHUNK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Pass 3: each pair to its place, its expert's start + its chunk's first rank + its rank."""
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    ok = i < num_pairs
    expert = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
    first = tl.load(chunk_first_ptr + c * BLOCK_E + expert, mask=ok, other=0)
    pos = tl.load(starts_ptr + expert, mask=ok, other=0) + first
    pos += tl.load(rank_ptr + i, mask=ok, other=0)
    tl.store(sorted_ptr + pos, i, mask=ok)


@dataclass
class Grouping:
    """The pairs grouped by expert (see above): sorted_ids [max_blocks * block_m] int32,
    block_expert [max_blocks] int32, num_padded [1] int32, on the device."""

    sorted_ids: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


# Tokens up to which the GEMMs skip the grouping and run a tile per pair: one token's pairs
# have distinct experts, so a tile per pair reads each expert once, as the grouped tiles would,
# without the grouping's launch. (Two tokens' pairs may share experts, read twice then.)
PER_PAIR_MAX_TOKENS = 1
# Tokens up to which MXFP4 and W4A16 pairs run moe_gemv_kernel (CUDA cores, no tile padding)
# instead of moe_gemm_kernel's tiles (faster for bf16 weights). W4A16's launch: GEMV_BLOCK_N
# output columns a program of GEMV_WARPS warps, GEMV_BLOCK_K columns a step (by analogy with
# MXFP4's byte layout, which measured best so); MXFP4's below (docs/ARCHITECTURE.md, MoE
# decisions).
GEMV_MAX_TOKENS = 4
GEMV_BLOCK_N = 16
GEMV_BLOCK_K = 256
GEMV_WARPS = 8
# MXFP4's GEMV: a thread takes whole 32-weight groups of gemv_rows columns, so its columns,
# K columns a step and warps are its own (measured: docs/ARCHITECTURE.md, MoE decisions).
GEMV_MXFP4_BLOCK_N = 8
GEMV_MXFP4_BLOCK_K = 1024
GEMV_MXFP4_WARPS = 4
# MXFP4's GEMV reads its weight words through TMA descriptors (moe_gemv_tma_kernel: bulk
# copies pipelined GEMV_MXFP4_TMA_* stages deep, more loads in flight than a thread's
# registers hold) wherever the GPU has TMA and the blocks' layout allows (mxfp4_tma_problem);
# moe_gemv_kernel's pointer loads elsewhere (measured: docs/ARCHITECTURE.md, MoE decisions).
# Its (output columns a program, K columns a step, warps, stages) for gate_up and down: both
# copy 16 weight rows by 512 bytes a step (gate_up's 8 columns are 16 interleaved rows), a
# thread's 4 rows of one 32-weight group, as moe_gemv_kernel's gate_up at 8 columns (9.6
# against its 9.2 SASS instructions a weight byte, 96 registers: kernel_sass.py --kernels
# moe_gemv,moe_gemv_tma); 4 stages hold gpt-oss's 3 K steps in flight at once, 5 programs
# an SM (by registers) 120 KB. Untimed: moe_layer.py --sweep tries others.
GEMV_MXFP4_TMA_GATE_UP = (8, 1024, 4, 4)
GEMV_MXFP4_TMA_DOWN = (16, 1024, 4, 4)
# Runs of K the down projection's GEMV splits into (GemmConfig.split_k; more programs, more
# loads in flight): 1, the split measured slower in gpt-oss-20b's decode.
GEMV_DOWN_SPLIT_K = 1
# Tokens up to which dense fp16 / bf16 experts run moe_tma_gemv_kernel (weight tiles by TMA
# bulk copies) instead of moe_gemm_kernel's pointer loads, on a GPU with TMA (sm_90+) or under
# the interpreter; 0: never (A/B: gpu_table.py --patch
# inferx_kernels_cuda.moe_kernels.TMA_GEMV_MAX_TOKENS=0). Its tiles are moe_gemm_kernel's
# 16 rows of pairs, so 2 tokens are grouped by expert (each expert read once) as there. 2:
# faster at 1-2 tokens, slower at 4 on V2-Lite's layer (docs/ARCHITECTURE.md, MoE decisions).
TMA_GEMV_MAX_TOKENS = 2
# Runs of K that moe_tma_gemv_kernel's down projection splits into (GemmConfig.split_k).
TMA_DOWN_SPLIT_K = 1
# Chunks of pairs up to which one program groups them all (a few decode tokens); above, three
# launches, whose passes over the chunks run in parallel.
ALIGN_ONE_MAX_CHUNKS = 2
# One-hot entries (pairs x experts, padded to a power of two) of a chunk.
ALIGN_CHUNK_ENTRIES = 8192


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A bound on the padded segments' total that the host knows: every pair, and fewer than
    block_m sentinels for each expert that has a pair (at most num_pairs of them)."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Grouping:
    """topk_ids [T, k] -> the Grouping of its T * k pairs, in one launch or three."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs, device = ids.shape[0], ids.device
    blocks = triton.cdiv(max_padded(num_pairs, num_experts, block_m), block_m)
    block_e = triton.next_power_of_2(num_experts)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    chunk = max(16, min(1024, ALIGN_CHUNK_ENTRIES // block_e))
    block_b = max(16, min(256, 8192 // block_e))
    common = {"BLOCK_M": block_m, "BLOCK_E": block_e, "BLOCK_B": block_b}
    if triton.cdiv(num_pairs, chunk) <= ALIGN_ONE_MAX_CHUNKS:
        align_one_kernel[(1,)](
            ids, sorted_ids, block_expert, num_padded, starts, num_pairs, num_experts, blocks,
            CHUNK=chunk, **common, num_warps=4,
        )  # fmt: skip
    else:
        chunks = triton.cdiv(num_pairs, chunk)
        chunk_counts = torch.empty(chunks, block_e, dtype=torch.int32, device=device)
        rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
        align_count_kernel[(chunks,)](
            ids, chunk_counts, rank, num_pairs, CHUNK=chunk, BLOCK_E=block_e, num_warps=4
        )
        align_plan_kernel[(1,)](
            chunk_counts, sorted_ids, block_expert, num_padded, starts, chunks, num_pairs,
            num_experts, blocks, BLOCK_C=max(1, 8192 // block_e), **common, num_warps=8,
        )  # fmt: skip
        align_scatter_kernel[(chunks,)](
            ids, chunk_counts, rank, starts, sorted_ids, num_pairs, CHUNK=chunk,
            BLOCK_E=block_e, num_warps=4,
        )  # fmt: skip
    return Grouping(sorted_ids, block_expert, num_padded, block_m)


# --- the grouped GEMM ----------------------------------------------------------------------------

ACT_NONE, ACT_SILU, ACT_SWIGLU_OAI = 0, 1, 2


# MXFP4 products in float32 from codes 2 ** -126 times their values (_e2m1_raw): the GEMV's
# activations 2 ** 64 times theirs and its group sums (the GEMM's weights) 2 ** 62 besides the
# scale, which keeps every product in float32's normal range.
_A_UP: tl.constexpr = tl.constexpr(18446744073709551616.0)  # 2 ** 64
_SCALE_UP: tl.constexpr = tl.constexpr(62)
# 2 ** 64 added to a float32's exponent field (exact for |a| < 2 ** 64; a zero or subnormal
# activation becomes at most 2 ** -62, whose products with the codes underflow to zero)
_A_UP_BITS: tl.constexpr = tl.constexpr(64 << 23)


@triton.jit
def _e2m1_raw(packed):
    """Bytes of two e2m1 codes (low nibble first) as two float32 tensors 2 ** -126 times the
    codes' values, by their bits alone: exponent and mantissa to bits 24..22, sign to bit 31
    (the subnormal code 0.5 lands on float32's subnormal 2 ** -127)."""
    b = packed.to(tl.int32)
    even = ((b << 22) & 0x01C00000) | ((b << 28) & -2147483648)
    odd = ((b << 18) & 0x01C00000) | ((b << 24) & -2147483648)
    return even.to(tl.float32, bitcast=True), odd.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_up(bits):
    """e8m0 scale bytes as float32 2 ** (bits - 127 + _SCALE_UP), from the bits (bytes to 192)."""
    return ((bits.to(tl.int32) + _SCALE_UP) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_half(
    blocks_ptrs,
    scale_ptrs,
    mask,
    scale_mask,
    HALF: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """A [2 * HALF, BLOCK_N] tile of MXFP4 weights as its (even, odd) rows, [HALF, BLOCK_N]
    each in float32 for an fp16 tile: the bytes at blocks_ptrs [HALF, BLOCK_N] (low nibble
    even), each times 2 ** (its e8m0 scale - 127), the GROUPS scales at scale_ptrs [GROUPS,
    BLOCK_N] covering 16 bytes each. An e2m1 code's bits placed in an fp16's (sign to bit 15,
    exponent and mantissa to bits 11..9) make that fp16 2 ** -14 times the e2m1 value,
    subnormals included; the 2 ** 14 goes into the scale (the values must stay normal fp16)."""
    packed = tl.load(blocks_ptrs, mask=mask, other=0)
    bits = tl.load(scale_ptrs, mask=scale_mask, other=0)
    scale = tl.reshape(
        tl.broadcast_to(_e8m0(bits)[:, None, :], (GROUPS, 16, BLOCK_N)), (HALF, BLOCK_N)
    )
    return _e2m1_pair(packed, scale)


@triton.jit
def _mxfp4_rows_bf16(
    blocks_ptrs,
    scale_ptrs,
    mask,
    scale_mask,
    GROUPS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """A [BLOCK_N, BLOCK_K] tile of MXFP4 weight rows in bf16, 2 ** -64 times their values
    (the caller's sums go up by _A_UP): the bytes at blocks_ptrs [BLOCK_N, BLOCK_K / 2], the
    GROUPS e8m0 scales at scale_ptrs [BLOCK_N, GROUPS]; exact for scale bytes 66 to 192.
    BF16_BITS: a byte b times 4097 holds its low nibble at bits 0..3 and its high one at bits
    16..19, so one shift-and-mask pass makes both codes' bf16 bits in one register (exponent
    and mantissa to bits 6..8, sign to bit 15 of each half): 2 ** -126 times the codes'
    values, the code 0.5 a bf16 subnormal; one mul.bf16x2 by 2 ** (scale - 65) twice, a power
    of two, makes the pair's values (PTX: Triton's scalar bf16 multiplies cost a swap of
    halves before and after each pair). Else the same values through float32 (_e2m1_raw):
    the interpreter runs no PTX and its bf16 conversions flush subnormals."""
    packed = tl.load(blocks_ptrs, mask=mask, other=0)
    exps = tl.load(scale_ptrs, mask=scale_mask, other=0).to(tl.int32)
    if BF16_BITS:
        spread = packed.to(tl.int32) * 4097
        bits = ((spread << 6) & 0x01C001C0) | ((spread << 12) & -2147450880)  # 0x80008000
        scale = ((exps + 62) << 7) * 65537  # the bf16 scale in both halves
        scale = tl.broadcast_to(scale[:, :, None], (BLOCK_N, GROUPS, 16))
        pairs = tl.inline_asm_elementwise(
            "mul.rn.bf16x2 $0, $1, $2;",
            "=r,r,r",
            [bits, tl.reshape(scale, (BLOCK_N, BLOCK_K // 2))],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
        even = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
        odd = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return tl.interleave(even, odd)
    even, odd = _e2m1_raw(packed)
    scale = tl.broadcast_to(_e8m0_up(exps)[:, :, None], (BLOCK_N, GROUPS, 32))
    codes = tl.interleave(even, odd)
    return (codes * tl.reshape(scale, (BLOCK_N, BLOCK_K))).to(tl.bfloat16)


@triton.jit
def _e8m0(bits):
    """e8m0 scale bytes as float32 2 ** (bits - 127), times the 2 ** 14 that _e2m1_pair's
    fp16 values lack."""
    return (bits.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _e2m1_pair(packed, scale):
    """Bytes of two e2m1 codes (low nibble first) as two float32 tensors times scale: a code's
    bits placed in an fp16's (sign to bit 15, exponent and mantissa to bits 11..9) are 2 ** -14
    times its value, subnormals included."""
    packed = packed.to(tl.int32)
    low = packed & 15
    high = packed >> 4
    low_bits = ((low & 7) << 9) | ((low & 8) << 12)
    high_bits = ((high & 7) << 9) | ((high & 8) << 12)
    even = low_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    odd = high_bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    return even, odd


@triton.jit
def _activation(acc, acc_up, alpha, limit, ACT: tl.constexpr):
    """gate_up's epilogue: 1 SiLU(gate) * up; 2 gpt-oss's clamped SwiGLU; 0 acc as it is."""
    if ACT == 1:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    elif ACT == 2:
        gate = tl.minimum(acc, limit)
        up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        acc = gate / (1.0 + tl.exp(-alpha * gate)) * (up + 1.0)
    return acc


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _tile_pairs(pid_m, block_expert_ptr, sorted_ptr, num_pairs, PER_PAIR: tl.constexpr,
                BLOCK_M: tl.constexpr):  # fmt: skip
    """The expert of tile pid_m and its BLOCK_M pair slots (num_pairs where none): PER_PAIR,
    pair pid_m alone in slot 0, its expert read from topk_ids (block_expert_ptr); else the
    grouping's sorted pairs and the tile's expert (a tile past num_padded is the caller's to
    skip, before this)."""
    expert = tl.load(block_expert_ptr + pid_m)
    if PER_PAIR:
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pair


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gemm_kernel(
    a_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    topk_w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    n_out,
    k_in,
    up_offset,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_out,
    alpha,
    limit,
    scale_bk,
    zero_ptr,
    perm_ptr,
    group_shift,
    rg_ptr,
    A_ROW_DIV: tl.constexpr,
    ACT: tl.constexpr,
    GATE_STRIDE: tl.constexpr,
    MXFP4: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    K_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ATOMIC_K: tl.constexpr,
    PER_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BF16_BITS: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
    W4: tl.constexpr = False,
    HAS_ZEROS: tl.constexpr = False,
    HAS_PERM: tl.constexpr = False,
    ROW_GROUP: tl.constexpr = False,
    EVEN_K: tl.constexpr = False,
):
    """One BLOCK_M tile of the grouped pairs (one expert's) times BLOCK_N output columns of that
    expert's weight [rows, K]. Row r of the tile is pair p = sorted[r]; its input row is
    a[p // A_ROW_DIV] (A_ROW_DIV = top_k: the token's hidden state; 1: the pair's own row) and
    its output row out[p]. With ACT, output column j takes weight rows j * GATE_STRIDE (gate)
    and that + up_offset (up), bias added to each, and stores the activation of the two in
    fp32; without, row j. WEIGHTED: times the pair's routing weight. ATOMIC_K > 0: added
    atomically to out[p // ATOMIC_K] (float32) instead, the top-k sum in place. MXFP4: w holds
    uint8 pairs of e2m1 ([rows, K / 2]) and scale the e8m0 exponents ([rows, K / 32]); BLOCK_K
    a multiple of 32. PER_PAIR: no grouping; tile i is pair i alone and block_expert_ptr
    points at topk_ids (a decode step of one token, whose k pairs have k distinct experts).
    ROW_SCALE: w is FP8 (or any narrower type), widened to the activations'
    dtype in registers, and each output row scaled by scale[row] (float32) before the bias.
    K_SCALE: FP8 too, scaled per row per scale_bk columns of K (scale [rows, K / scale_bk],
    unit stride along K; BLOCK_K divides scale_bk): each K tile's product by its scales.
    SWAP_AB (MXFP4 with bf16 / float32 activations): the products as W @ A^T into [BLOCK_N,
    BLOCK_M] accumulators, transposed once after the K loop, so the weight tile dequantized
    in registers is the MMA's first operand, which Hopper's wgmma reads from registers (the
    second must be in shared memory: as the weight it would be stored there every K step).
    W4 ("w4a16" weights): w int32 [K / 8, rows] packed along K (stride_wn: a word row's),
    scale [K / group, rows] (stride_sn: a group row's, equal to stride_wn), with HAS_ZEROS
    zero_ptr's uint8 zero points of the scales' layout (else zero 8); each K tile (BLOCK_K
    divides the group, and K) dequantized in registers as (q - zero) * scale, group
    k0 >> group_shift. HAS_PERM: K row i of the expert's weight takes activation column
    perm[expert, i] (perm_ptr int32 [E, k_in], act-order), gathered as the tile loads.
    ROW_GROUP: K row i's scales and zeros are row rg[expert, i] of the expert's (rg_ptr int32
    [E, k_in]: act-order split along K over ranks), so a tile may cross groups. EVEN_K:
    BLOCK_K divides k_in, so the activations' and MXFP4 weights' loads need no K mask."""
    # a K loop known to run keeps the accumulators' zeros off a skip path, which made ptxas
    # serialize the swapped MXFP4 tiles' wgmma (C7515: a wait after each)
    tl.assume(k_in > 0)
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if not PER_PAIR and pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pair = _tile_pairs(pid_m, block_expert_ptr, sorted_ptr, num_pairs, PER_PAIR, BLOCK_M)
    expert = expert.to(tl.int64)
    row_ok = pair < num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64) * stride_a
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    gated: tl.constexpr = ACT != 0
    rows_g = cols * GATE_STRIDE
    w_base = w_ptr + expert * stride_we
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    kr = tl.arange(0, BLOCK_K)
    s_base = scale_ptr + expert * stride_se
    # MXFP4 weights dequantized for bf16 / float32 activations (else fp16's)
    W_DOWN: tl.constexpr = a_ptr.dtype.element_ty != tl.float16
    if MXFP4:
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 32
        kk = tl.arange(0, HALF)
        kg = tl.arange(0, GROUPS)
        if W_DOWN:  # weight rows along K
            gate_rows = rows_g[:, None].to(tl.int64)
            up_rows = (rows_g + up_offset)[:, None].to(tl.int64)
        else:  # fp16: K along the tile's rows
            rows_gate = rows_g[None, :].to(tl.int64)
            rows_up = (rows_g + up_offset)[None, :].to(tl.int64)
    if W4:
        # columns past n_out reread a real one (never stored): unmasked weight loads
        w4_cols = (cols % n_out) * GATE_STRIDE
        z_base = zero_ptr + expert * stride_se
        perm_row = perm_ptr + expert * k_in
        rg_row = rg_ptr + expert * k_in
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = (k0 + kr) < k_in
        ka = k0 + kr
        if HAS_PERM:
            ka = tl.load(perm_row + ka)
        a_mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & k_ok[None, :]
        a = tl.load(a_ptr + a_rows[:, None] + ka[None, :], mask=a_mask, other=0.0)
        if MXFP4:
            if W_DOWN:
                # weight rows [BLOCK_N, BLOCK_K] in bf16, 2 ** -64 times theirs
                if EVEN_K:
                    w_mask = col_ok[:, None]
                    s_mask = col_ok[:, None]
                else:
                    w_mask = col_ok[:, None] & ((k0 // 2 + kk) < k_in // 2)[None, :]
                    s_mask = col_ok[:, None] & ((k0 // 32 + kg) < k_in // 32)[None, :]
                byte_off = (k0 // 2 + kk)[None, :]
                scale_off = (k0 // 32 + kg)[None, :]
                w = _mxfp4_rows_bf16(
                    w_base + gate_rows * stride_wn + byte_off,
                    s_base + gate_rows * stride_sn + scale_off,
                    w_mask, s_mask, GROUPS, BLOCK_N, BLOCK_K, BF16_BITS,
                )  # fmt: skip
                if SWAP_AB:
                    acc = _dot(w.to(a.dtype), tl.trans(a), acc, DOT_FP32)
                else:
                    acc = _dot(a, tl.trans(w.to(a.dtype)), acc, DOT_FP32)
                if gated:
                    w = _mxfp4_rows_bf16(
                        w_base + up_rows * stride_wn + byte_off,
                        s_base + up_rows * stride_sn + scale_off,
                        w_mask, s_mask, GROUPS, BLOCK_N, BLOCK_K, BF16_BITS,
                    )  # fmt: skip
                    if SWAP_AB:
                        acc_up = _dot(w.to(a.dtype), tl.trans(a), acc_up, DOT_FP32)
                    else:
                        acc_up = _dot(a, tl.trans(w.to(a.dtype)), acc_up, DOT_FP32)
            else:
                # fp16: the activations' even and odd columns, to meet the low and high nibbles
                a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, HALF, 2)))
                w_mask = ((k0 // 2 + kk) < k_in // 2)[:, None] & col_ok[None, :]
                s_mask = ((k0 // 32 + kg) < k_in // 32)[:, None] & col_ok[None, :]
                byte_off = (k0 // 2 + kk)[:, None]
                scale_off = (k0 // 32 + kg)[:, None]
                even, odd = _mxfp4_half(
                    w_base + rows_gate * stride_wn + byte_off,
                    s_base + rows_gate * stride_sn + scale_off,
                    w_mask, s_mask, HALF, GROUPS, BLOCK_N,
                )  # fmt: skip
                acc = _dot(a_even, even.to(a.dtype), acc, DOT_FP32)
                acc = _dot(a_odd, odd.to(a.dtype), acc, DOT_FP32)
                if gated:
                    even, odd = _mxfp4_half(
                        w_base + rows_up * stride_wn + byte_off,
                        s_base + rows_up * stride_sn + scale_off,
                        w_mask, s_mask, HALF, GROUPS, BLOCK_N,
                    )  # fmt: skip
                    acc_up = _dot(a_even, even.to(a.dtype), acc_up, DOT_FP32)
                    acc_up = _dot(a_odd, odd.to(a.dtype), acc_up, DOT_FP32)
        elif W4:
            w = _w4_tile(
                w_base, s_base, z_base, k0, w4_cols, stride_wn, group_shift,
                BLOCK_K, BLOCK_N, True, HAS_ZEROS, rg_row, ROW_GROUP,
            )  # fmt: skip
            acc = _dot(a, w.to(a.dtype), acc, DOT_FP32)
            if gated:
                w = _w4_tile(
                    w_base, s_base, z_base, k0, w4_cols + up_offset, stride_wn, group_shift,
                    BLOCK_K, BLOCK_N, True, HAS_ZEROS, rg_row, ROW_GROUP,
                )  # fmt: skip
                acc_up = _dot(a, w.to(a.dtype), acc_up, DOT_FP32)
        else:
            w_mask = k_ok[:, None] & col_ok[None, :]
            w = tl.load(
                w_base + rows_g[None, :].to(tl.int64) * stride_wn + (k0 + kr)[:, None],
                mask=w_mask,
                other=0.0,
            )
            if K_SCALE:
                s_k = s_base + k0 // scale_bk
                s = tl.load(s_k + rows_g * stride_sn, mask=col_ok, other=0.0)
                part = _dot(a, w.to(a.dtype), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), DOT_FP32)
                acc += part * s[None, :]
            else:
                acc = _dot(a, w.to(a.dtype), acc, DOT_FP32)
            if gated:
                rows_u = (rows_g + up_offset)[None, :].to(tl.int64)
                w = tl.load(
                    w_base + rows_u * stride_wn + (k0 + kr)[:, None], mask=w_mask, other=0.0
                )
                if K_SCALE:
                    s = tl.load(s_k + (rows_g + up_offset) * stride_sn, mask=col_ok, other=0.0)
                    zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                    acc_up += _dot(a, w.to(a.dtype), zero, DOT_FP32) * s[None, :]
                else:
                    acc_up = _dot(a, w.to(a.dtype), acc_up, DOT_FP32)
    if SWAP_AB:
        acc = tl.trans(acc)
        if gated:
            acc_up = tl.trans(acc_up)
    if MXFP4 and W_DOWN:  # the weights were 2 ** -64 times theirs
        acc *= _A_UP
        acc_up *= _A_UP
    if ROW_SCALE:
        acc *= tl.load(s_base + rows_g * stride_sn, mask=col_ok, other=0.0)[None, :]
        if gated:
            s_up = tl.load(s_base + (rows_g + up_offset) * stride_sn, mask=col_ok, other=0.0)
            acc_up *= s_up[None, :]
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc += tl.load(b_base + rows_g, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if gated:
            b_up = tl.load(b_base + rows_g + up_offset, mask=col_ok, other=0.0)
            acc_up += b_up.to(tl.float32)[None, :]
    acc = _activation(acc, acc_up, alpha, limit, ACT)
    if WEIGHTED:
        acc *= tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[:, None]
    out_mask = row_ok[:, None] & col_ok[None, :]
    if ATOMIC_K:
        out_ptrs = out_ptr + (pair // ATOMIC_K)[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")
    else:
        out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


# e2m1 codes in float32's sign (bit 31) and exponent and mantissa (bits 24..22) bits: 2 ** -126
# times their values, the code 0.5 a subnormal
_E2M1_BITS: tl.constexpr = tl.constexpr(-2118123520)  # 0x81C00000


@triton.jit
def _mxfp4_word_dot(w, a0, a1, a2, a3, a4, a5, a6, a7):
    """Sums over int32 words w of 8 e2m1 codes each (code j at bits 4j..4j+3) of code j times
    aj, the codes 2 ** -126 times their values. A code's sign is 3 bits above its lowest
    magnitude bit and must go 9 above (bits 31 and 22..24): d and e hold codes 0, 1, 4, 5
    and 2, 3 that way (magnitudes from w, signs from w << 6), and a shift and a mask a code
    place it; codes 7 and 6 come from an arithmetic shift of w and w << 4."""
    u = w << 6
    d = u ^ ((u ^ w) & 0x00770077)  # w's bits where the mask has ones, else u's: one LOP3
    e = u ^ ((u ^ w) & 0x00007700)
    s = ((d << 22) & _E2M1_BITS).to(tl.float32, bitcast=True) * a0
    s += ((d << 18) & _E2M1_BITS).to(tl.float32, bitcast=True) * a1
    s += ((e << 14) & _E2M1_BITS).to(tl.float32, bitcast=True) * a2
    s += ((e << 10) & _E2M1_BITS).to(tl.float32, bitcast=True) * a3
    s += ((d << 6) & _E2M1_BITS).to(tl.float32, bitcast=True) * a4
    s += ((d << 2) & _E2M1_BITS).to(tl.float32, bitcast=True) * a5
    s += (((w << 4) >> 6) & _E2M1_BITS).to(tl.float32, bitcast=True) * a6
    s += ((w >> 6) & _E2M1_BITS).to(tl.float32, bitcast=True) * a7
    return s


@triton.jit
def _quarters(x, GROUPS: tl.constexpr):
    """x [GROUPS, 16] as 4 tensors [GROUPS, 4]: x[:, 4 * i + q] at [:, i], q = 0..3."""
    lo, hi = tl.split(tl.reshape(x, (GROUPS, 4, 2, 2)))
    q0, q2 = tl.split(lo)
    q1, q3 = tl.split(hi)
    return q0, q1, q2, q3


@triton.jit
def _mxfp4_acts(a_row, g1, k_in, GROUPS: tl.constexpr, A_PAIRS: tl.constexpr):
    """The activations of a row's 32-column groups g1 [GROUPS] (zero past k_in), float32 and
    _A_UP times theirs, as 8 tensors aj [GROUPS, 4]: aj[g, i] meets code j of group g's word i.
    A_PAIRS: the bf16 row read as int32 pairs (an even row stride, 4-byte aligned), 2 ** 64
    added to each one's exponent field."""
    kq = tl.arange(0, 16)
    g1_ok = (g1 < k_in // 32)[:, None]
    if A_PAIRS:  # a group's 32 bf16 activations as 16 int32, their bits made float32's
        a_pairs = a_row.to(tl.pointer_type(tl.int32))
        p = tl.load(a_pairs + g1[:, None] * 16 + kq[None, :], mask=g1_ok, other=0)
        ev = ((p << 16) + _A_UP_BITS).to(tl.float32, bitcast=True)
        od = ((p + _A_UP_BITS) & -65536).to(tl.float32, bitcast=True)
    else:
        a_k = a_row + g1[:, None] * 32 + 2 * kq[None, :]
        ev = tl.load(a_k, mask=g1_ok, other=0.0).to(tl.float32) * _A_UP
        od = tl.load(a_k + 1, mask=g1_ok, other=0.0).to(tl.float32) * _A_UP
    a0, a2, a4, a6 = _quarters(ev, GROUPS)
    a1, a3, a5, a7 = _quarters(od, GROUPS)
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def _spread(a):
    """Activations [groups, 4] as [1, groups, 1, 4], moe_gemv_kernel's word layout's."""
    return a[None, :, None, :]


@triton.jit
def _mxfp4_group_dots(words_ptrs, scale_ptrs, a0, a1, a2, a3, a4, a5, a6, a7, mask, scale_mask):
    """[sub, groups, rows] dot products of MXFP4 weight groups with activations: the int32
    words at words_ptrs [sub, groups, rows, 4] (a group's 16 bytes) against aj [1, groups, 1,
    4] (_mxfp4_acts'), summed per group, then times the group's scale 2 ** (e8m0 - 127) at
    scale_ptrs [sub, groups, rows] and 2 ** _SCALE_UP."""
    w = tl.load(words_ptrs, mask=mask, other=0)
    scale = _e8m0_up(tl.load(scale_ptrs, mask=scale_mask, other=0))
    return tl.sum(_mxfp4_word_dot(w, a0, a1, a2, a3, a4, a5, a6, a7), axis=3) * scale


@triton.jit
def _mxfp4_tile_dots(w, scale_bits, a0, a1, a2, a3, a4, a5, a6, a7):
    """[rows, groups] dot products of a tile of MXFP4 weight words w [rows, groups, 4] (a
    group's 16 bytes on the last axis) with activations aj [groups, 4] (_mxfp4_acts'), summed
    per group, then times the group's scale (e8m0 bytes scale_bits [rows, groups]) and 2 **
    _SCALE_UP, as _mxfp4_group_dots."""
    s = _mxfp4_word_dot(
        w, a0[None, :, :], a1[None, :, :], a2[None, :, :], a3[None, :, :], a4[None, :, :],
        a5[None, :, :], a6[None, :, :], a7[None, :, :],
    )  # fmt: skip
    return tl.sum(s, axis=2) * _e8m0_up(scale_bits)


@triton.jit
def _k_split(k_in, run, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_lo, k_hi): run `run`'s K columns of SPLIT_K runs of whole BLOCK_K tiles (all of K for
    one run; a last run past K is empty)."""
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = k_in
    else:
        k_run = tl.cdiv(tl.cdiv(k_in, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = run * k_run
        k_hi = tl.minimum(k_in, k_lo + k_run)
    return k_lo, k_hi


@triton.jit
def moe_gemv_kernel(
    a_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    topk_w_ptr,
    ids_ptr,
    out_ptr,
    n_out,
    k_in,
    up_offset,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_out,
    alpha,
    limit,
    zero_ptr,
    perm_ptr,
    group_shift,
    rg_ptr,
    A_ROW_DIV: tl.constexpr,
    ACT: tl.constexpr,
    GATE_STRIDE: tl.constexpr,
    MXFP4: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ATOMIC_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_PAIRS: tl.constexpr = False,
    W4: tl.constexpr = False,
    HAS_ZEROS: tl.constexpr = False,
    HAS_PERM: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    ROWS: tl.constexpr = 1,
    ROW_GROUP: tl.constexpr = False,
):
    """moe_gemm_kernel's product for one pair (program axis 0) and BLOCK_N output columns (axis
    1) on the CUDA cores: weight tiles [BLOCK_N, BLOCK_K] in their stored layout (K along the
    fast axis), times the pair's input row, partial sums kept per column and lane and reduced
    once at the end. No tl.dot, so no 16-row padding of one row and no conversion of the
    dequantized tile to an MMA operand layout. MXFP4: rows read as int32 words of 8 codes, a
    thread's 16-byte groups of ROWS columns (gemv_rows) sharing its activations, codes made
    float32 by their bits alone (_mxfp4_word_dot), summed per 32-weight group and scaled
    once a group (_mxfp4_group_dots); A_PAIRS reads a bf16 row's activations two at a time
    as int32 (an even row stride, 4-byte aligned). Same arguments and epilogue as
    moe_gemm_kernel; FP8 only with per-row scales. W4: moe_gemm_kernel's
    "w4a16" tiles [BLOCK_K, BLOCK_N] (its layout: outputs the unit-stride axis), times the
    pair's activations (gathered by perm with HAS_PERM; scales by row with ROW_GROUP), summed
    per K row and lane, the partial sums transposed once after the loop. SPLIT_K (no
    activation): program axis 2 takes one of SPLIT_K runs of whole K tiles and writes its
    weighted partial sum (the bias in run 0's) to out[run, pair] (out [SPLIT_K, pairs, n_out]
    for moe_sum_kernel's SPLITS), or adds it with ATOMIC_K: more programs, so more loads in
    flight, for a projection of few pairs."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    run = tl.program_id(2) if SPLIT_K > 1 else 0
    k_lo, k_hi = _k_split(k_in, run, SPLIT_K, BLOCK_K)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_a
    gated: tl.constexpr = ACT != 0
    rows_g = (cols * GATE_STRIDE).to(tl.int64)
    rows_u = rows_g + up_offset
    w_base = w_ptr + expert * stride_we
    s_base = scale_ptr + expert * stride_se
    if MXFP4:
        # [SUB, GROUPS, ROWS, 4] tiles of int32 words, column sub * ROWS + r at [sub, :, r]: a
        # group's 16 bytes and its one scale share axes 0 to 2, and a thread's ROWS columns
        # (the layout's last axis) share its activations
        GROUPS: tl.constexpr = BLOCK_K // 32
        SUB: tl.constexpr = BLOCK_N // ROWS
        kw = tl.arange(0, 4)
        cols3 = tl.reshape(cols, (SUB, ROWS))[:, None, :]
        ok3 = cols3 < n_out
        rows_g3 = (cols3 * GATE_STRIDE).to(tl.int64)
        rows_u3 = rows_g3 + up_offset
        acc3 = tl.zeros([SUB, GROUPS, ROWS], dtype=tl.float32)
        up3 = tl.zeros([SUB, GROUPS, ROWS], dtype=tl.float32)
        words_g = (w_base + rows_g3 * stride_wn).to(tl.pointer_type(tl.int32))[:, :, :, None]
        words_u = (w_base + rows_u3 * stride_wn).to(tl.pointer_type(tl.int32))[:, :, :, None]
        scales_g = s_base + rows_g3 * stride_sn
        scales_u = s_base + rows_u3 * stride_sn
        for k0 in range(k_lo, k_hi, BLOCK_K):
            g1 = k0 // 32 + tl.arange(0, GROUPS)
            group = g1[None, :, None]  # [1, GROUPS, 1]
            g_ok = group < k_in // 32
            word = (group * 4)[:, :, :, None] + kw[None, None, None, :]
            m = (ok3 & g_ok)[:, :, :, None]
            sm = ok3 & g_ok
            a0, a1, a2, a3, a4, a5, a6, a7 = _mxfp4_acts(a_row, g1, k_in, GROUPS, A_PAIRS)
            a0, a1, a2, a3 = _spread(a0), _spread(a1), _spread(a2), _spread(a3)
            a4, a5, a6, a7 = _spread(a4), _spread(a5), _spread(a6), _spread(a7)
            acc3 += _mxfp4_group_dots(
                words_g + word, scales_g + group, a0, a1, a2, a3, a4, a5, a6, a7, m, sm
            )
            if gated:
                up3 += _mxfp4_group_dots(
                    words_u + word, scales_u + group, a0, a1, a2, a3, a4, a5, a6, a7, m, sm
                )
        acc2 = tl.reshape(tl.sum(acc3, axis=1), (BLOCK_N, 1))
        up2 = tl.reshape(tl.sum(up3, axis=1), (BLOCK_N, 1))
    elif W4:
        kr = tl.arange(0, BLOCK_K)
        w4_cols = (cols % n_out) * GATE_STRIDE  # past n_out: a real column, never stored
        z_base = zero_ptr + expert * stride_se
        rg_row = rg_ptr + expert * k_in
        acc_t = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        up_t = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):  # BLOCK_K divides k_in
            ka = k0 + kr
            if HAS_PERM:
                ka = tl.load(perm_ptr + expert * k_in + ka)
            a = tl.load(a_row + ka).to(tl.float32)[:, None]
            w = _w4_tile(
                w_base, s_base, z_base, k0, w4_cols, stride_wn, group_shift,
                BLOCK_K, BLOCK_N, True, HAS_ZEROS, rg_row, ROW_GROUP,
            )  # fmt: skip
            acc_t += w * a
            if gated:
                w = _w4_tile(
                    w_base, s_base, z_base, k0, w4_cols + up_offset, stride_wn, group_shift,
                    BLOCK_K, BLOCK_N, True, HAS_ZEROS, rg_row, ROW_GROUP,
                )  # fmt: skip
                up_t += w * a
        acc2 = tl.trans(acc_t)
        up2 = tl.trans(up_t)
    else:
        kr = tl.arange(0, BLOCK_K)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        up2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k_ok = (k0 + kr) < k_in
            a = tl.load(a_row + k0 + kr, mask=k_ok, other=0.0).to(tl.float32)
            m = col_ok[:, None] & k_ok[None, :]
            w = tl.load(
                w_base + rows_g[:, None] * stride_wn + (k0 + kr)[None, :], mask=m, other=0.0
            )
            acc2 += w.to(tl.float32) * a[None, :]
            if gated:
                w = tl.load(
                    w_base + rows_u[:, None] * stride_wn + (k0 + kr)[None, :], mask=m, other=0.0
                )
                up2 += w.to(tl.float32) * a[None, :]
    acc = tl.sum(acc2, axis=1)
    acc_up = tl.sum(up2, axis=1)
    if ROW_SCALE:
        acc *= tl.load(s_base + rows_g * stride_sn, mask=col_ok, other=0.0)
        if gated:
            acc_up *= tl.load(s_base + rows_u * stride_sn, mask=col_ok, other=0.0)
    _gemv_epilogue(
        acc, acc_up, pair, run, cols, n_out, bias_ptr + expert * stride_be, rows_g, rows_u,
        topk_w_ptr, out_ptr, stride_out, alpha, limit, ACT, HAS_BIAS, WEIGHTED, ATOMIC_K,
        SPLIT_K,
    )  # fmt: skip


@triton.jit
def _gemv_epilogue(
    acc,
    acc_up,
    pair,
    run,
    cols,
    n_out,
    b_base,
    rows_g,
    rows_u,
    topk_w_ptr,
    out_ptr,
    stride_out,
    alpha,
    limit,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ATOMIC_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """The GEMVs' end for one pair's output columns cols [BLOCK_N] (acc, acc_up [BLOCK_N]
    float32, the up sums for ACT): the expert's bias (at b_base, rows rows_g and rows_u; in
    run 0's partial sum alone), the activation, the routing weight, then the store to
    out[pair] (out[run, pair] with SPLIT_K), or the atomic add to out[pair // ATOMIC_K]."""
    col_ok = cols < n_out
    if HAS_BIAS:
        b_ok = col_ok if SPLIT_K == 1 else cols + run * n_out < n_out  # run 0's alone
        acc += tl.load(b_base + rows_g, mask=b_ok, other=0.0).to(tl.float32)
        if ACT != 0:
            acc_up += tl.load(b_base + rows_u, mask=col_ok, other=0.0).to(tl.float32)
    acc = _activation(acc, acc_up, alpha, limit, ACT)
    if WEIGHTED:
        acc *= tl.load(topk_w_ptr + pair)
    if ATOMIC_K:
        out_ptrs = out_ptr + (pair // ATOMIC_K).to(tl.int64) * stride_out + cols
        tl.atomic_add(out_ptrs, acc, mask=col_ok, sem="relaxed")
    else:
        row = pair.to(tl.int64)
        if SPLIT_K > 1:
            row += run.to(tl.int64) * tl.num_programs(0)
        tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def moe_gemv_tma_kernel(
    a_ptr,
    w_desc,
    scale_ptr,
    bias_ptr,
    topk_w_ptr,
    ids_ptr,
    out_ptr,
    n_out,
    k_in,
    up_offset,
    stride_a,
    stride_se,
    stride_sn,
    stride_be,
    stride_out,
    alpha,
    limit,
    A_ROW_DIV: tl.constexpr,
    ACT: tl.constexpr,
    GATE_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ATOMIC_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    A_PAIRS: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
):
    """moe_gemv_kernel's MXFP4 product (same grid, arithmetic and epilogue) with the weight
    words read through a TMA descriptor: w_desc covers the experts' blocks as int32 words [E,
    rows, K / 8], so a tile of rows by BLOCK_K / 8 words is one bulk copy into shared memory,
    zero-filled past K and past the expert's rows, that Triton pipelines num_stages deep: the
    loads in flight are the copies ahead, not a thread's registers. Scales (1/16 of the bytes)
    and activations stay pointer loads. Gated: gate rows j and up rows j + up_offset as two
    tiles (GATE_STRIDE 1), or interleaved rows 2j, 2j + 1 as one tile of 2 * BLOCK_N rows
    split after the loop (GATE_STRIDE 2, "swiglu_oai")."""
    pair = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    run = tl.program_id(2) if SPLIT_K > 1 else 0
    k_lo, k_hi = _k_split(k_in, run, SPLIT_K, BLOCK_K)
    expert = tl.load(ids_ptr + pair).to(tl.int32)
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_a
    gated: tl.constexpr = ACT != 0
    pairs_in_tile: tl.constexpr = gated and GATE_STRIDE == 2  # gate and up rows interleaved
    W_ROWS: tl.constexpr = 2 * BLOCK_N if pairs_in_tile else BLOCK_N
    GROUPS: tl.constexpr = BLOCK_K // 32
    r = tl.arange(0, W_ROWS)
    row0 = n0 * GATE_STRIDE
    # the tile's rows of output columns past n_out (read, never stored): no scales
    row_ok = (n0 + r // (2 if pairs_in_tile else 1)) < n_out
    s_rows = (row0 + r)[:, None].to(tl.int64) * stride_sn
    scales = scale_ptr + expert.to(tl.int64) * stride_se + s_rows
    acc = tl.zeros([W_ROWS, GROUPS], dtype=tl.float32)
    acc_up = tl.zeros([W_ROWS, GROUPS], dtype=tl.float32)
    # num_stages on the loop itself: Triton pipelines a loop without tl.dot only when asked
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        g1 = k0 // 32 + tl.arange(0, GROUPS)
        a0, a1, a2, a3, a4, a5, a6, a7 = _mxfp4_acts(a_row, g1, k_in, GROUPS, A_PAIRS)
        s_ok = row_ok[:, None] & (g1 < k_in // 32)[None, :]
        w = tl.reshape(w_desc.load([expert, row0, k0 // 8]), (W_ROWS, GROUPS, 4))
        bits = tl.load(scales + g1[None, :], mask=s_ok, other=0)
        acc += _mxfp4_tile_dots(w, bits, a0, a1, a2, a3, a4, a5, a6, a7)
        if gated and not pairs_in_tile:
            w = tl.reshape(w_desc.load([expert, row0 + up_offset, k0 // 8]), (W_ROWS, GROUPS, 4))
            bits = tl.load(scales + up_offset * stride_sn + g1[None, :], mask=s_ok, other=0)
            acc_up += _mxfp4_tile_dots(w, bits, a0, a1, a2, a3, a4, a5, a6, a7)
    sums = tl.sum(acc, axis=1)
    if pairs_in_tile:  # rows 2j (gate) and 2j + 1 (up) apart
        sums, sums_up = tl.split(tl.reshape(sums, (BLOCK_N, 2)))
    else:
        sums_up = tl.sum(acc_up, axis=1)
    cols = n0 + tl.arange(0, BLOCK_N)
    rows_g = (cols * GATE_STRIDE).to(tl.int64)
    _gemv_epilogue(
        sums, sums_up, pair, run, cols, n_out, bias_ptr + expert.to(tl.int64) * stride_be,
        rows_g, rows_g + up_offset, topk_w_ptr, out_ptr, stride_out, alpha, limit, ACT,
        HAS_BIAS, WEIGHTED, ATOMIC_K, SPLIT_K,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def moe_tma_gemv_kernel(
    a_ptr,
    w_desc,
    bias_ptr,
    topk_w_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_padded_ptr,
    num_pairs,
    n_out,
    k_in,
    expert_rows,
    up_offset,
    stride_a,
    stride_be,
    stride_out,
    alpha,
    limit,
    A_ROW_DIV: tl.constexpr,
    ACT: tl.constexpr,
    GATE_STRIDE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ATOMIC_K: tl.constexpr,
    PER_PAIR: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr = 1,
):
    """moe_gemm_kernel's tiles and epilogue for dense weights read through a TMA descriptor:
    w_desc covers the experts' weights flattened to [E * expert_rows, K] (expert e's row r
    at e * expert_rows + r), so a tile is one bulk copy at the tile's expert, zero-filled
    past K (rows past an expert's are read, never stored). The products run swapped, W @
    A^T into [rows, BLOCK_M] accumulators: the weight tile is the MMA's tall operand (wgmma's
    64 rows at 64 columns), the BLOCK_M activation rows of the tile's pairs, gathered by
    pointer loads, its narrow one. Gated: gate rows j and up rows j + up_offset as two
    tiles (GATE_STRIDE 1, "silu"), or interleaved rows 2j, 2j + 1 as one tile of 2 * BLOCK_N
    rows split after the loop (GATE_STRIDE 2, "swiglu_oai"; up_offset 1). PER_PAIR,
    grouping, A_ROW_DIV, ACT, HAS_BIAS, WEIGHTED, ATOMIC_K as moe_gemm_kernel's; SPLIT_K (no
    activation) as moe_gemv_kernel's: program axis 1 takes one of SPLIT_K runs of whole K
    tiles."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if not PER_PAIR and pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, pair = _tile_pairs(pid_m, block_expert_ptr, sorted_ptr, num_pairs, PER_PAIR, BLOCK_M)
    expert = expert.to(tl.int32)
    run = tl.program_id(1) if SPLIT_K > 1 else 0
    k_lo, k_hi = _k_split(k_in, run, SPLIT_K, BLOCK_K)
    row_ok = pair < num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64) * stride_a
    n0 = pid_n * BLOCK_N
    row0 = expert * expert_rows + n0 * GATE_STRIDE
    gated: tl.constexpr = ACT != 0
    pairs_in_tile: tl.constexpr = gated and GATE_STRIDE == 2  # gate and up rows interleaved
    W_ROWS: tl.constexpr = 2 * BLOCK_N if pairs_in_tile else BLOCK_N
    acc = tl.zeros([W_ROWS, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    kr = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ka = k0 + kr
        a = tl.load(
            a_ptr + a_rows[:, None] + ka[None, :],
            mask=row_ok[:, None] & (ka < k_in)[None, :],
            other=0.0,
        )
        a_t = tl.trans(a)
        acc = _dot(w_desc.load([row0, k0]), a_t, acc, DOT_FP32)
        if gated and not pairs_in_tile:
            acc_up = _dot(w_desc.load([row0 + up_offset, k0]), a_t, acc_up, DOT_FP32)
    if pairs_in_tile:  # rows 2j (gate) and 2j + 1 (up) apart
        acc, acc_up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N, 2, BLOCK_M)), (0, 2, 1)))
    cols = n0 + tl.arange(0, BLOCK_N)
    col_ok = cols < n_out
    rows_g = cols * GATE_STRIDE
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        b_ok = col_ok if SPLIT_K == 1 else cols + run * n_out < n_out  # run 0's alone
        acc += tl.load(b_base + rows_g, mask=b_ok, other=0.0).to(tl.float32)[:, None]
        if gated:
            b_up = tl.load(b_base + rows_g + up_offset, mask=col_ok, other=0.0)
            acc_up += b_up.to(tl.float32)[:, None]
    acc = _activation(acc, acc_up, alpha, limit, ACT)
    if WEIGHTED:
        acc *= tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)[None, :]
    out_mask = col_ok[:, None] & row_ok[None, :]
    if ATOMIC_K:
        out_ptrs = out_ptr + (pair // ATOMIC_K)[None, :].to(tl.int64) * stride_out + cols[:, None]
        tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")
    else:
        row = pair.to(tl.int64)
        if SPLIT_K > 1:
            row += run.to(tl.int64) * num_pairs
        out_ptrs = out_ptr + row[None, :] * stride_out + cols[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def moe_sum_kernel(
    y_ptr, out_ptr, hidden, split_stride, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS: tl.constexpr = 1,
):  # fmt: skip
    """out[t] = sum over s, j of y[s * split_stride + t * TOP_K + j] (rows), in float32 in the
    order s = 0, 1, ..., then j, rounded once to out's dtype (y and out contiguous rows of
    `hidden`; SPLITS > 1: moe_gemv_kernel's SPLIT_K runs, split_stride rows apart)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        for j in tl.static_range(TOP_K):
            row = s * split_stride + t * TOP_K + j
            acc += tl.load(y_ptr + row * hidden + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM; block_m is the grouping's. swap_ab: moe_gemm_kernel's
    SWAP_AB (MXFP4 weights with bf16 / float32 activations only). split_k: moe_gemv_kernel's
    SPLIT_K for the down projection (the GEMV's only; gate_up's activation needs whole sums).
    num_stages: Triton's pipeline depth (moe_gemv_tma_kernel's K loop's too; moe_gemv_kernel
    has none)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    swap_ab: bool = False
    split_k: int = 1


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode_block_n(tiles: int, n_out: int, num_sms: int) -> int:
    """The widest of 64, 32, 16 output columns a program that still gives every SM two
    programs (a decode GEMM reads weights: idle SMs are idle bandwidth)."""
    for block_n in (64, 32):
        if tiles * triton.cdiv(n_out, block_n) >= 2 * num_sms:
            return block_n
    return 16


def gemv_rows(block_n: int, block_k: int, warps: int) -> int:
    """moe_gemv_kernel's ROWS for MXFP4: the columns a thread takes a step (sharing its
    activations), when BLOCK_N columns of 32-weight groups outnumber the threads."""
    return max(1, min(block_n, block_n * (block_k // 32) // (32 * warps)))


def gemm_configs(
    num_pairs: int,
    num_experts: int,
    n: int,
    hidden: int,
    fmt: str,
    num_sms: int,
    gemv: bool = False,
    swap_ab: bool = False,
    gemv_tma: bool = False,
) -> tuple[GemmConfig, GemmConfig]:
    """(gate_up's, down's) tiles for a step of num_pairs pairs over experts of intermediate
    size n. Up to 16 pairs an expert on average, 16-row tiles (a decode step reads weights;
    a tile is mostly one expert's few tokens) and output columns narrow enough to spread the
    tiles over the SMs; above, 64-row tiles (a prefill computes), 128 rows from 128 pairs an expert;
    MXFP4's with 4 warps (8 spill the dequantization); W4A16's decode tiles 64 columns of K
    deep (128 spill the dequantization of a 64-wide tile at sm_90: tests/sm90_moe.py, registers
    by benchmarks/kernel_sass.py's resources). gemv: moe_gemv_kernel's columns. Small tiles
    under the interpreter. swap_ab: whether the prefill tiles may swap operands (MXFP4 weights,
    bf16 / float32 activations), which MXFP4's take: W @ A^T reads each weight tile once a
    tile of tokens, faster at 256 and 2048 tokens (docs/BENCHMARKS.md). gemv_tma: MXFP4's
    GEMV through moe_gemv_tma_kernel (GEMV_MXFP4_TMA_GATE_UP / _DOWN; num_stages its
    pipeline's depth)."""
    mxfp4 = fmt == "mxfp4"
    decode_k = 64 if fmt == "w4a16" else 128
    if gemv_tma:
        if _interpreting():  # 2 stages: the pipelined loop's code path, at small tiles
            small = GemmConfig(16, 16, 64, 4, 2)
            return small, dataclasses.replace(small, split_k=GEMV_DOWN_SPLIT_K)
        gate_up, down = GEMV_MXFP4_TMA_GATE_UP, GEMV_MXFP4_TMA_DOWN
        return GemmConfig(16, *gate_up), GemmConfig(16, *down, split_k=GEMV_DOWN_SPLIT_K)
    if _interpreting():
        small = GemmConfig(16, 32, 32 if mxfp4 else 16, 4, 1)
        return small, small
    if gemv:
        if mxfp4:
            cols, block_k, warps = GEMV_MXFP4_BLOCK_N, GEMV_MXFP4_BLOCK_K, GEMV_MXFP4_WARPS
        else:
            cols, block_k, warps = GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_WARPS
        return (
            GemmConfig(16, cols, block_k, warps),
            GemmConfig(16, cols, block_k, warps, split_k=GEMV_DOWN_SPLIT_K),
        )
    if num_pairs <= 16 * num_experts:
        tiles = min(num_pairs, num_experts)  # tiles holding pairs, about
        gate_up = GemmConfig(16, _decode_block_n(tiles, n, num_sms), decode_k, 4, 4)
        down = GemmConfig(16, _decode_block_n(tiles, hidden, num_sms), decode_k, 4, 4)
    elif mxfp4 and swap_ab:
        block_m = 128 if num_pairs >= 128 * num_experts else 64
        gate_up = down = GemmConfig(block_m, 64, 64, 4, 3, swap_ab=True)
    elif num_pairs >= 128 * num_experts:
        warps = 4 if mxfp4 else 8
        gate_up = GemmConfig(128, 64, 64, warps, 3)
        down = GemmConfig(128, 128, 64, warps, 3)
    elif mxfp4:
        gate_up = down = GemmConfig(64, 64, 64, 4, 3)
    else:
        gate_up = GemmConfig(64, 64, 64, 4, 3)
        down = GemmConfig(64, 128, 64, 8, 3)
    return gate_up, down


def _bf16_pairs(a: torch.Tensor) -> bool:
    """Whether moe_gemv_kernel may read a's rows as int32 pairs of bf16."""
    return a.dtype == torch.bfloat16 and a.stride(0) % 2 == 0 and a.data_ptr() % 4 == 0


def _words_aligned(w: ExpertWeights) -> bool:
    """Whether moe_gemv_kernel may read MXFP4 blocks as int32 words (4-byte aligned rows)."""
    return all(t.data_ptr() % 4 == 0 and t.stride(1) % 4 == 0 for t in (w.gate_up, w.down))


def mxfp4_tma_problem(w: ExpertWeights) -> str | None:
    """Why moe_gemv_tma_kernel cannot read these experts' blocks, or None when it can: MXFP4
    blocks [E, rows, K / 32, 16] whose rows are K / 2 contiguous bytes, seen as int32 words
    [E, rows, K / 8] by a TMA descriptor (16-byte aligned base, row and expert strides)."""
    if w.format != "mxfp4":
        return f"the TMA MXFP4 GEMV takes MXFP4 experts, got {w.format}"
    for name, t in (("gate_up", w.gate_up), ("down", w.down)):
        if t.stride(3) != 1 or t.stride(2) != 16 or t.stride(1) % 16 or t.stride(0) % 16:
            return (
                f"the TMA MXFP4 GEMV reads {name}'s rows as words: it needs blocks [E, rows, "
                f"K / 32, 16] with contiguous rows and 16-byte aligned row and expert strides "
                f"(strides {t.stride()})"
            )
        if t.data_ptr() % 16:
            return f"the TMA MXFP4 GEMV needs {name}'s blocks 16-byte aligned ({t.data_ptr()})"
    return None


def _words_desc(blocks: torch.Tensor, tile_rows: int, block_k: int) -> TensorDescriptor:
    """A TMA descriptor over MXFP4 blocks [E, rows, K / 32, 16] as int32 words [E, rows, K /
    8], tiles [1, tile_rows, block_k / 8] (mxfp4_tma_problem's layout)."""
    e, rows, groups, _ = blocks.shape
    words = blocks.view(torch.int32)  # [E, rows, K / 32, 4]: strides in words
    return TensorDescriptor(
        words, [e, rows, groups * 4], [words.stride(0), words.stride(1), 1],
        [1, tile_rows, block_k // 8],
    )  # fmt: skip


def tma_configs(
    num_pairs: int,
    num_experts: int,
    n: int,
    hidden: int,
    num_sms: int,
    elem_bytes: int = 2,
) -> tuple[GemmConfig, GemmConfig]:
    """moe_tma_gemv_kernel's (gate_up, down) tiles for num_pairs pairs over experts of
    intermediate size n: 16 rows of pairs; output columns the widest of 64, 32, 16 that still
    gives every SM a program (a GPU that streams weights wants every SM's loads, and a
    wider tile halves the programs an SM must hold); K columns and stages by
    tma_gemv.resident_config, which keeps every program resident (a second wave costs more than
    a shallower pipeline, as for the dense TMA GEMV). At DeepSeek-V2-Lite's one token (8
    pairs, 2 x 1408 gate_up rows, 2048 down rows): gate_up 64 columns, 176 programs of 64 gate
    and 64 up rows, 3 stages of 128 K columns; down 64 rows, 256 programs, 4 stages. At
    Qwen3-30B-A3B's (8 pairs of 768): gate_up 32 columns (64 would leave 36 SMs idle). Down's K
    in TMA_DOWN_SPLIT_K runs. Small tiles under the interpreter."""
    split = TMA_DOWN_SPLIT_K
    if _interpreting():
        small = GemmConfig(16, 16, 32, 4, 1)
        return small, dataclasses.replace(small, split_k=split)
    tiles = min(num_pairs, num_experts)  # tiles holding pairs, at most
    configs = []
    for n_out, gated, runs in ((n, True, 1), (hidden, False, split)):
        for block_n in (64, 32, 16):
            programs = tiles * triton.cdiv(n_out, block_n) * runs
            if programs >= num_sms:
                break
        tile_rows = (2 if gated else 1) * block_n + 16  # weight rows and pairs a stage holds
        cfg = resident_config(block_n, tile_rows, programs, num_sms, elem_bytes)
        configs.append(GemmConfig(16, block_n, cfg.block_k, 4, cfg.num_stages, split_k=runs))
    return configs[0], configs[1]


def tma_problem(w: ExpertWeights, x: torch.Tensor) -> str | None:
    """Why moe_tma_gemv_kernel cannot read these experts, or None when it can: dense weights
    in x's dtype, float16 or bfloat16 (float32 too under the interpreter, for exact tests:
    compiled, its ieee products run on the CUDA cores and spill at sm_90), whose experts
    flatten to [E * rows, K] rows TMA can address (unit stride along K, 16-byte aligned base
    and rows)."""
    dtypes = (torch.float16, torch.bfloat16) + ((torch.float32,) if _interpreting() else ())
    if w.format != "dense" or x.dtype not in dtypes:
        return f"the TMA MoE GEMV takes dense fp16 / bf16 experts, got {w.format} {x.dtype}"
    for name, t in (("gate_up", w.gate_up), ("down", w.down)):
        if (
            t.stride(2) != 1
            or t.stride(0) != t.shape[1] * t.stride(1)
            or (t.stride(1) * t.element_size()) % 16
            or t.data_ptr() % 16
        ):
            return (
                f"the TMA MoE GEMV reads {name} as [E * rows, K]: it needs a unit K stride, "
                f"experts one after another and 16-byte aligned rows (strides {t.stride()}, "
                f"{t.element_size()}-byte elements, address {t.data_ptr()})"
            )
    return None


def _tma_device(x: torch.Tensor) -> bool:
    return _interpreting() or (x.is_cuda and has_tma(x.device))


def check_weights(w: ExpertWeights, spec: ExpertsSpec, x: torch.Tensor) -> None:
    """Refuse weights the kernels do not read, naming what is wrong."""
    if w.format not in ("dense", "mxfp4", "fp8", "w4a16"):
        raise ValueError(f"{spec.prefix}: fused MoE has no {w.format!r} weights")
    if w.format == "w4a16":
        _check_w4(w, spec)
        return
    if w.format == "dense" and (w.gate_up.dtype != x.dtype or w.down.dtype != x.dtype):
        raise ValueError(
            f"{spec.prefix}: dense expert weights are {w.gate_up.dtype} / {w.down.dtype}, the "
            f"activations {x.dtype}"
        )
    if w.format != "dense" and (w.gate_up_scales is None or w.down_scales is None):
        raise ValueError(f"{spec.prefix}: {w.format} expert weights need their scales")
    if w.format == "fp8":
        bk = w.scale_block_k
        for name, t, s in (
            ("gate_up", w.gate_up, w.gate_up_scales),
            ("down", w.down, w.down_scales),
        ):
            assert s is not None
            want = (*t.shape[:2], triton.cdiv(t.shape[2], bk)) if bk else t.shape[:2]
            if t.dtype != torch.float8_e4m3fn or s.dtype != torch.float32 or s.shape != want:
                per = f"[E, rows, K / {bk}]" if bk else "[E, rows]"
                raise ValueError(
                    f"{spec.prefix}: fp8 {name} must be float8_e4m3fn [E, rows, K] with float32 "
                    f"scales {per}, got {t.dtype} {tuple(t.shape)} and {s.dtype} "
                    f"{tuple(s.shape)}"
                )
            if bk and s.stride(-1) != 1:
                raise ValueError(f"{spec.prefix}: fp8 {name} scales need a unit stride along K")
    for name, t in (("gate_up", w.gate_up), ("down", w.down)):
        inner = t.flatten(2) if w.format == "mxfp4" else t
        if inner.stride(-1) != 1:
            raise ValueError(f"{spec.prefix}: {name} weights need a unit stride along K")


def _check_w4(w: ExpertWeights, spec: ExpertsSpec) -> None:
    """The "w4a16" layout (ExpertWeights), named where a tensor departs from it."""
    e, h = w.gate_up.shape[0], w.down.shape[-1]
    n = w.gate_up.shape[-1] // 2
    if w.group_size not in (-1, 32, 64, 128) or n % 16 or h % 16:
        raise ValueError(
            f"{spec.prefix}: w4a16 experts need group_size 32, 64, 128 or -1 and H ({h}) and n "
            f"({n}) multiples of 16, got group_size {w.group_size}"
        )
    for name, k, rows in (("gate_up", h, 2 * n), ("down", n, h)):
        g = k if w.group_size == -1 else w.group_size
        groups = k // g
        if name == "down" and w.down_row_group is not None:  # the groups its rows touch
            groups = w.down_scales.shape[1] if w.down_scales is not None else 0
        want = {
            name: ((e, k // 8, rows), (torch.int32,)),
            f"{name}_scales": ((e, groups, rows), (torch.float16, torch.bfloat16, torch.float32)),
            f"{name}_zeros": ((e, groups, rows), (torch.uint8,)),
            f"{name}_perm": ((e, k), (torch.int32,)),
        }
        if name == "down":  # gate_up keeps its whole K on every rank: no row groups
            want["down_row_group"] = ((e, k), (torch.int32,))
        for field, (shape, dtypes) in want.items():
            t = getattr(w, field)
            if t is None and field.endswith(("_zeros", "_perm", "_row_group")):
                continue
            if t is None or tuple(t.shape) != shape or t.dtype not in dtypes:
                got = None if t is None else (t.dtype, tuple(t.shape))
                raise ValueError(
                    f"{spec.prefix}: w4a16 {field} must be {dtypes[0]} {shape}, got {got}"
                )
            if not t.is_contiguous():
                raise ValueError(f"{spec.prefix}: w4a16 {field} must be contiguous")


def _w4_block_k(block_k: int, group: int, k: int) -> int:
    """block_k lowered to a power of two dividing the group and K (a tile in one group)."""
    common = math.gcd(group, k)
    while block_k > 16 and common % block_k:
        block_k //= 2
    return block_k


def fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w: ExpertWeights,
    spec: ExpertsSpec,
    configs: tuple[GemmConfig, GemmConfig] | None = None,
    atomic_sum: bool = False,
    gemv: bool | None = None,
    tma: bool | None = None,
    gemv_tma: bool | None = None,
    parts: bool = False,
) -> torch.Tensor:
    """QuantExperts.forward on the device: x [T, H], topk_weights [T, k] float32, topk_ids
    [T, k] -> sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), [T, H] in x's dtype.
    parts: as [S, T, H] partial results for a norm to sum (KernelOps.moe_experts_parts): the
    k weighted outputs unsummed, [k, T, H] (a view, no sum launch), where down writes them in
    x's dtype (no atomic_sum, no split K), else the sum as one part.
    Four launches (group, gate_up, down, sum; no grouping for one token, two more grouping
    passes for many pairs), with no host synchronisation. atomic_sum: down adds each pair's
    output into a float32 [T, H] (zeroed first, cast after) with atomics instead of writing
    [T * k, H] for the sum kernel: fewer bytes, in an order that varies from run to run.
    gemv: the pairs through moe_gemv_kernel (None: up to GEMV_MAX_TOKENS MXFP4 or W4A16
    tokens; never for K-blocked fp8 scales); configs then give its output columns a program,
    K columns a step (0: GEMV_BLOCK_K) and warps. W4A16: K tiles lowered to divide the group.
    tma: the GEMMs through moe_tma_gemv_kernel (dense weights read by TMA; None: up to
    TMA_GEMV_MAX_TOKENS fp16 / bf16 tokens on a GPU with TMA or under the interpreter, where
    neither gemv nor configs is given and tma_problem finds nothing); configs then give its
    tiles (tma_configs' by default). gemv_tma: MXFP4's GEMV as moe_gemv_tma_kernel, its
    weight words by TMA (None: where the GEMV runs without configs, the GPU has TMA or the
    interpreter runs and mxfp4_tma_problem finds nothing; True implies gemv); configs then
    give its columns, K columns a step, warps and stages."""
    check_weights(w, spec, x)
    t, hidden = x.shape
    k = topk_ids.shape[1]
    e = w.gate_up.shape[0]
    w4 = w.format == "w4a16"
    n = w.gate_up.shape[2 if w4 else 1] // 2  # this rank's intermediate size
    if x.stride(1) != 1:
        x = x.contiguous()
    topk_weights = topk_weights.contiguous()
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out.unsqueeze(0) if parts else out
    num_pairs = t * k
    mxfp4 = w.format == "mxfp4"
    bk = w.scale_block_k if w.format == "fp8" else 0
    if gemv_tma:
        if gemv is False or tma:
            problem = "gemv_tma is the MXFP4 GEMV's: it takes neither gemv=False nor tma=True"
        elif not _tma_device(x):
            problem = f"the TMA MXFP4 GEMV needs a GPU with TMA (sm_90+), got {x.device}"
        else:
            problem = mxfp4_tma_problem(w)
        if problem:
            raise ValueError(f"{spec.prefix}: {problem}")
        gemv = True
    if tma is None:
        tma = (
            gemv is None
            and configs is None
            and t <= TMA_GEMV_MAX_TOKENS
            and x.dtype != torch.float32  # float32: tests' own choice (tma_problem)
            and _tma_device(x)
            and tma_problem(w, x) is None
        )
    elif tma:
        problem = "gemv and tma are two kernels: ask for one" if gemv else tma_problem(w, x)
        if problem:
            raise ValueError(f"{spec.prefix}: {problem}")
        gemv = False
    if gemv is None:
        gemv = t <= GEMV_MAX_TOKENS and w.format in ("mxfp4", "w4a16")
        gemv = gemv and not (mxfp4 and not _words_aligned(w))
    elif gemv and bk:
        raise ValueError(f"{spec.prefix}: the MoE GEMV takes no K-blocked fp8 scales")
    elif gemv and mxfp4 and not _words_aligned(w):
        raise ValueError(f"{spec.prefix}: the MoE GEMV reads MXFP4 rows as 4-byte words")
    if gemv_tma is None:
        gemv_tma = bool(
            gemv
            and mxfp4
            and configs is None  # configs given are the pointer GEMV's
            and _tma_device(x)
            and mxfp4_tma_problem(w) is None
        )
    swappable = mxfp4 and x.dtype != torch.float16  # what SWAP_AB takes
    if configs is None:
        sms = 132 if _interpreting() else _num_sms(x.device)
        if tma:
            configs = tma_configs(num_pairs, e, n, hidden, sms, x.element_size())
        else:
            configs = gemm_configs(
                num_pairs, e, n, hidden, w.format, sms, gemv, swappable, gemv_tma
            )
    gate_up_cfg, down_cfg = configs
    if gemv_tma:
        for cfg, rows in ((gate_up_cfg, 2 if spec.activation != "silu" else 1), (down_cfg, 1)):
            bk_ok = cfg.block_k in (32, 64, 128, 256, 512, 1024, 2048)
            if not bk_ok or rows * cfg.block_n > 256 or cfg.num_stages < 1:
                raise ValueError(
                    f"{spec.prefix}: the TMA MXFP4 GEMV's copies are at most 256 rows of at "
                    f"most 256 words: block_k a power of two 32..2048, block_n * {rows} <= 256, "
                    f"num_stages >= 1, got {cfg}"
                )
    if (gate_up_cfg.swap_ab or down_cfg.swap_ab) and not swappable:
        raise ValueError(
            f"{spec.prefix}: swapped MoE GEMM operands take MXFP4 weights and bf16 / float32 "
            f"activations, got {w.format} weights and {x.dtype}"
        )
    if bk:  # a K tile must lie in one scale block
        tiles_k = [math.gcd(cfg.block_k, bk) for cfg in configs]
        if min(tiles_k) < 16:
            raise ValueError(f"{spec.prefix}: fp8 scale blocks of {bk} columns (need 16 | {bk})")
        gate_up_cfg = dataclasses.replace(gate_up_cfg, block_k=tiles_k[0])
        down_cfg = dataclasses.replace(down_cfg, block_k=tiles_k[1])
    if gate_up_cfg.block_m != down_cfg.block_m:
        raise ValueError("fused_experts: gate_up and down tiles must share block_m")
    split = down_cfg.split_k
    if gate_up_cfg.split_k != 1 or split < 1 or (split > 1 and not (gemv or tma)):
        raise ValueError(
            f"fused_experts: split_k {gate_up_cfg.split_k} / {split} (gate_up / down): only "
            "the down projection's GEMV splits K (moe_gemv_kernel's or moe_tma_gemv_kernel's)"
        )
    per_pair = gemv or t <= PER_PAIR_MAX_TOKENS
    if per_pair:
        ids = topk_ids.reshape(-1).contiguous()
        tiles, sorted_ids, block_expert, num_padded = num_pairs, ids, ids, ids
    else:
        g = group_by_expert(topk_ids, e, gate_up_cfg.block_m)
        tiles, sorted_ids = g.max_blocks, g.sorted_ids
        block_expert, num_padded = g.block_expert, g.num_padded
    dot_fp32 = x.dtype == torch.float32 or (_interpreting() and x.dtype == torch.bfloat16)
    silu = spec.activation == "silu"
    inter = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    if atomic_sum:
        y = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
    elif split > 1:  # the runs' partial sums in float32, summed by moe_sum_kernel
        y = torch.empty(split, num_pairs, hidden, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    for cfg, weights, scales, bias, a, dest, n_out, k_in, gated, zeros, perm, row_group in (
        (
            gate_up_cfg, w.gate_up, w.gate_up_scales, w.gate_up_bias, x, inter, n, hidden, True,
            w.gate_up_zeros, w.gate_up_perm, None,
        ),
        (
            down_cfg, w.down, w.down_scales, w.down_bias, inter, y, hidden, n, False,
            w.down_zeros, w.down_perm, w.down_row_group,
        ),
    ):  # fmt: skip
        scale_t = scales if scales is not None else weights
        bias_t = bias if bias is not None else weights
        # W4A16: zero points, act-order perm, the K row -> group shift, or each row's group
        # (a K tile may then cross groups: it need only divide K)
        group = k_in if w.group_size == -1 or row_group is not None else w.group_size
        w4_args = (
            zeros if zeros is not None else weights,
            perm if perm is not None else weights,
            _group_shift(group, k_in) if w4 else 0,
            row_group if row_group is not None else weights,
        )
        w4_flags = dict(W4=w4, HAS_ZEROS=zeros is not None, HAS_PERM=perm is not None)
        if row_group is not None:  # left at its default otherwise: the kernels compile as before
            w4_flags["ROW_GROUP"] = True
        up_offset = (n if silu else 1) if gated else 0
        strides = (
            a.stride(0), weights.stride(0), weights.stride(1),
            scale_t.stride(0), scale_t.stride(1), bias_t.stride(0), dest.stride(-2),
        )  # fmt: skip
        # the constexprs all three kernels take, then those of the two pointer kernels (the
        # GEMV runs no K-blocked scales: ROW_SCALE holds)
        epilogue = dict(
            A_ROW_DIV=k if gated else 1,
            ACT=(ACT_SILU if silu else ACT_SWIGLU_OAI) if gated else ACT_NONE,
            GATE_STRIDE=1 if silu or not gated else 2,
            HAS_BIAS=bias is not None, WEIGHTED=not gated,
            ATOMIC_K=k if atomic_sum and not gated else 0, BLOCK_N=cfg.block_n,
        )  # fmt: skip
        shared = dict(epilogue, MXFP4=mxfp4, ROW_SCALE=w.format == "fp8" and not bk)
        if tma:  # the experts' weights as [E * rows, K]: a tile of one expert is one copy
            rows, runs = weights.shape[1], 1 if gated else split
            tile_rows = 2 * cfg.block_n if gated and not silu else cfg.block_n
            w_desc = TensorDescriptor(
                weights, [weights.shape[0] * rows, k_in], [weights.stride(1), 1],
                [tile_rows, cfg.block_k],
            )  # fmt: skip
            moe_tma_gemv_kernel[(tiles * triton.cdiv(n_out, cfg.block_n), runs)](
                a, w_desc, bias_t, topk_weights, dest, sorted_ids, block_expert, num_padded,
                num_pairs, n_out, k_in, rows, up_offset, a.stride(0), bias_t.stride(0),
                dest.stride(-2), float(spec.alpha), float(spec.limit), **epilogue,
                PER_PAIR=per_pair, DOT_FP32=dot_fp32, BLOCK_M=cfg.block_m,
                BLOCK_K=cfg.block_k, SPLIT_K=runs,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
            continue
        if gemv_tma:  # weight words by TMA, [E, rows, K / 8]
            runs = 1 if gated else split
            tile_rows = 2 * cfg.block_n if gated and not silu else cfg.block_n
            moe_gemv_tma_kernel[(num_pairs, triton.cdiv(n_out, cfg.block_n), runs)](
                a, _words_desc(weights, tile_rows, cfg.block_k), scale_t, bias_t, topk_weights,
                sorted_ids, dest, n_out, k_in, up_offset, a.stride(0), scale_t.stride(0),
                scale_t.stride(1), bias_t.stride(0), dest.stride(-2), float(spec.alpha),
                float(spec.limit), **epilogue, BLOCK_K=cfg.block_k, STAGES=cfg.num_stages,
                A_PAIRS=_bf16_pairs(a), SPLIT_K=runs,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )  # fmt: skip
            continue
        if gemv:
            block_k = (cfg.block_k or GEMV_BLOCK_K) if not _interpreting() else 64
            if w4:
                block_k = _w4_block_k(block_k, group, k_in)
            runs = 1 if gated else split
            moe_gemv_kernel[(num_pairs, triton.cdiv(n_out, cfg.block_n), runs)](
                a, weights, scale_t, bias_t, topk_weights, sorted_ids, dest, n_out, k_in,
                up_offset, *strides, float(spec.alpha), float(spec.limit), *w4_args, **shared,
                BLOCK_K=block_k, A_PAIRS=mxfp4 and _bf16_pairs(a), **w4_flags,
                SPLIT_K=runs, ROWS=gemv_rows(cfg.block_n, block_k, cfg.num_warps) if mxfp4 else 1,
                num_warps=cfg.num_warps,
            )  # fmt: skip
            continue
        grid = (tiles * triton.cdiv(n_out, cfg.block_n),)
        block_k = _w4_block_k(cfg.block_k, group, k_in) if w4 else cfg.block_k
        moe_gemm_kernel[grid](
            a, weights, scale_t, bias_t, topk_weights, dest, sorted_ids, block_expert,
            num_padded, num_pairs, n_out, k_in, up_offset, *strides,
            float(spec.alpha), float(spec.limit), max(bk, 1), *w4_args, **shared,
            K_SCALE=bk > 0, PER_PAIR=per_pair, DOT_FP32=dot_fp32,
            BLOCK_M=cfg.block_m, BLOCK_K=block_k, BF16_BITS=not _interpreting(),
            SWAP_AB=cfg.swap_ab, EVEN_K=k_in % block_k == 0, **w4_flags,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    if atomic_sum:
        return y.to(x.dtype).unsqueeze(0) if parts else y.to(x.dtype)
    if parts and split == 1:
        return y.view(t, k, hidden).transpose(0, 1)
    block = min(1024, triton.next_power_of_2(hidden))
    moe_sum_kernel[(t, triton.cdiv(hidden, block))](
        y, out, hidden, num_pairs, TOP_K=k, BLOCK=block, SPLITS=split, num_warps=4
    )
    return out.unsqueeze(0) if parts else out
