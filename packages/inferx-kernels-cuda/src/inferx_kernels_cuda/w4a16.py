"""W4A16 GEMM: y = x @ W.T (+ b) with W stored as 4-bit integers in groups along K, dequantized
in registers (inferx_quant.w4a16 holds the layout and calls this on CUDA tensors).

The weight arrives as inferx_quant.w4a16 keeps it: `qweight` int32 [K / 8, N], eight rows of a
column a word (row 8i + j in nibble j, GPTQ's packing), `scales` [G, N] (fp16 as checkpoints
store them), `zeros` uint8 [G, N], G = K / group_size, and for act-order checkpoints `perm`
int32 [K]: kernel row i is input row perm[i]. A program owns BLOCK_N output columns and a range
of K; each BLOCK_K step loads BLOCK_K / 8 words a column, shifts out the nibbles, and makes
(q - zero) * scale in fp32 with the step's one row of scales and zeros (BLOCK_K divides the
group size, so a step never straddles two groups), then casts to x's dtype for tl.dot.

Act-order: the weight's rows were permuted once at load so each group's rows are contiguous, and
the kernel gathers x's columns by `perm` as it loads them (x is the small operand: at decode a
few rows, so the gather costs a [BLOCK_K] index load a step); past 16 rows x is permuted once
before the GEMM instead (`_gathered`). The other way, gathering each row's
scale and zero by g_idx, would load [BLOCK_K, BLOCK_N] scales a step instead of one row of
BLOCK_N, on the operand that is the whole memory traffic; the permutation also keeps act-order
and plain checkpoints on one kernel.

Act-order split along K (a row-parallel layer's rank, inferx_quant.w4a16): the rank's rows,
sorted by group, hold runs of unequal length, so the group of a kernel row is read from
`row_group` int32 [K] (ROW_GROUP, off by default: the paths above compile as without it). Each
weight then takes its own row's scale and zero, gathered from the few scale rows a step spans
(cache hits): on the tl.dot path a [BLOCK_K, BLOCK_N] tile of them, on the CUDA-core path
(`_fma_step_rows`) the weight dequantized exactly, (q - zero) * scale, before its FFMA; a K step
may cross groups, so BLOCK_K need only divide K. The CUDA-core loop then spends about 2.5 times
the plain one's instructions a weight byte (`benchmarks/kernel_sass.py --row-group`): the price
of a row's own group.

Two regimes, one kernel:
- 1-16 rows (decode): split-K GEMV. x padded to 16 rows for tl.dot (free for a memory-bound
  kernel); N alone rarely fills the GPU (a 4096-wide o_proj is 64 programs of 64 columns), so
  K is split until there are at least two programs an SM. Partial sums [SPLIT, M, N] in fp32
  are summed in split order by gemv.split_k_reduce_kernel, which adds the bias and casts (no
  atomics: deterministic). forward_parts callers take the partials themselves
  (`w4a16_linear_parts`), in x's dtype, the bias in the first.
- more rows: tiled GEMM, BLOCK_M x BLOCK_N tiles, split only where the tiles leave SMs idle.

Accumulation is fp32. The weights are rounded once, to x's dtype, for tl.dot (what any bf16
GEMM of the dequantized weight does); in fp32 (the interpreter tests) nothing is rounded.

A CUDA-core path for 1-4 rows (W4Config.use_dot=False, `_fma_rows`) skips tl.dot's padding and
its operand layout: two instructions a weight in its loop (a mask, a fused multiply-add; the
zero point and scale once a group), where the dot path spends about ten (unpack, convert,
scale, round, and the trip through shared memory into the MMA layout). Exact weights; x's
magnitude below 2^64. `benchmarks/kernel_sass.py --kernels w4a16` counts both loops'
instructions.

PDL: up to PDL_MAX_ROWS rows the kernel launches with programmatic dependent launch by the
bf16 decode GEMVs' rules (pdl_launch: where the device has PDL; the kernel ahead, a norm or
the attention, lets it launch early), so its launch and the first step's weight loads overlap
the kernel ahead: the CUDA-core path's prefetch issues them before its wait (`gdc_wait`),
every load of x comes after it; the tl.dot path waits first. Faster decode on an H100
(docs/BENCHMARKS.md). Where w4a16_linear's split reduce follows (a K split, or gated), the
GEMV triggers at its start and the reduce launches with PDL too, waiting at its start and
then triggering, so the kernel after it (down_proj's GEMV) launches early and prefetches as
well (Qwen2.5-3B GPTQ decode 1.717 ms against 1.791 without: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from inferx_kernels_cuda.gemv import split_k_reduce_kernel
from inferx_kernels_cuda.pdl import gemv_launch, pdl_late, pdl_start

GEMV_ROWS = 16  # up to this many rows: the split-K GEMV regime
MAX_FMA_ROWS = 4
# Rows up to which a call without a config takes the CUDA-core path (fma_config), which decodes
# faster than tl.dot's (docs/BENCHMARKS.md); 0 sends every call to the tl.dot path.
FMA_ROWS = MAX_FMA_ROWS
# Programmatic dependent launch (inferx_kernels_cuda.pdl) of the GEMV at up to PDL_MAX_ROWS
# rows (the TMA GEMVs' limit, TritonOps.tma_gemv_max_rows), by the rules of the bf16 decode
# GEMVs (pdl_launch); above it, or on a device without PDL, the kernel compiles as without it.
PDL_MAX_ROWS = 64
_REDUCE_BLOCK = 256
_H100_SMS = 132
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class W4Config:
    """Launch parameters: tile sizes, K splits, Triton's num_warps / num_stages. block_k is
    lowered to a power of two dividing the group size and K. packed_loads: load each word once
    and unpack its eight nibbles in registers (else: load the word once per row it holds, and
    let the cache serve the repeats, as gemlite does). use_dot=False: products and sums on the
    CUDA cores in fp32 instead of tl.dot (`_fma_rows`: no padding of x to 16 rows, no
    conversion of the weight tile to tl.dot's operand layout), block_m rows a program (1, 2
    or 4), for the benchmark to weigh against the dot path at a few rows; packed_loads and
    num_stages do not apply to it."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    packed_loads: bool = True
    use_dot: bool = True

    def __str__(self) -> str:
        loads = "packed" if self.packed_loads else "dup"
        return (
            f"m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k} "
            f"w{self.num_warps} st{self.num_stages} {loads}" + ("" if self.use_dot else " fma")
        )


def split_for(
    tiles: int,
    k: int,
    block_k: int,
    rows: int,
    num_sms: int = _H100_SMS,
    per_sm: int = 2,
    min_steps: int = 4,
) -> int:
    """The K split count: the smallest power of two giving at least `per_sm` programs an SM,
    while each split keeps at least `min_steps` BLOCK_K steps and the fp32 partial sums (8
    bytes a row and column a split, written and read back) stay within a quarter of the
    weight's bytes (K / 2 a column): split * rows <= K / 64. 1 when the tiles alone fill the
    GPU. (Guesses to tune with benchmarks/w4a16_gemm.py --sweep.)"""
    split = 1
    while (
        tiles * split < per_sm * num_sms
        and k >= 2 * min_steps * block_k * split
        and 2 * split * max(rows, 1) * 64 <= k
    ):
        split *= 2
    return split


def pick_config(m: int, n: int, k: int, num_sms: int = _H100_SMS) -> W4Config:
    """Defaults by row count (guesses for Hopper, to be tuned on the GPU): up to 16 rows one
    16-row tile; up to 64 rows 64 x 64 tiles (twice the programs of 128-wide ones, where a
    K split would cost more in partial sums than it gains); then 128 x 128."""
    if m <= GEMV_ROWS:
        cfg = W4Config(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = W4Config(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    else:
        cfg = W4Config(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return replace(cfg, split_k=split_for(tiles, k, cfg.block_k, m, num_sms))


def fma_config(m: int, n: int, k: int, num_sms: int = _H100_SMS) -> W4Config:
    """The CUDA-core path's config for 1-4 rows, which benchmarks/w4a16_gemm.py --fma times
    beside pick_config's: 64 columns, a 128-row step (one group), four warps. The next step's
    words, scales and zeros are loaded during the current step's arithmetic (_fma_rows'
    prefetch); beyond that, memory parallelism comes from resident programs: K is split for
    eight programs an SM, down to two steps a split (a guess for the sweep to tune)."""
    if not 1 <= m <= MAX_FMA_ROWS:
        raise ValueError(f"w4a16: the CUDA-core path takes 1-{MAX_FMA_ROWS} rows, not {m}")
    cfg = W4Config(
        block_m=1 << (m - 1).bit_length(), block_n=64, block_k=128, num_stages=1, use_dot=False
    )
    split = split_for(triton.cdiv(n, cfg.block_n), k, cfg.block_k, m, num_sms, 8, 2)
    return replace(cfg, split_k=split)


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _H100_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _dequantized(
    qw_ptr,
    s_ptr,
    z_ptr,
    k0,
    cols,
    n,
    group_shift,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACKED: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    rg_ptr,
    ROW_GROUP: tl.constexpr,
):
    """Rows [k0, k0 + BLOCK_K) of the weight, columns `cols`, as fp32 (q - zero) * scale; n is
    the row stride of the words and of the scales and zeros. HAS_ZEROS False: zero 8
    (symmetric; z_ptr unread). ROW_GROUP: each row's scale and zero from the row of them that
    rg_ptr names (int32, one a row), else the step's one row, group k0 >> group_shift. Also
    moe_kernels' "w4a16" experts' tiles."""
    if PACKED:
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + words[:, None] * n + cols[None, :])  # [BLOCK_K / 8, BLOCK_N]
        shifts = tl.arange(0, 8) * 4
        nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BN]
        q = tl.reshape(nibbles, (BLOCK_K, BLOCK_N))
    else:
        rows = k0 + tl.arange(0, BLOCK_K)
        packed = tl.load(qw_ptr + (rows // 8)[:, None] * n + cols[None, :])
        q = (packed >> ((rows % 8) * 4)[:, None]) & 0xF
    # q - zero without an int-to-float conversion per weight: 0x4B000000 are the bits of 2^23,
    # and q (4 bits) or-ed into its mantissa makes the float 2^23 + q, so the mask and the or
    # (one LOP3) and a float subtraction of the column's 2^23 + zero give q - zero exactly.
    if ROW_GROUP:
        # [BLOCK_K, BLOCK_N] scales and zeros: the rows are sorted by group, so a step's span
        # few groups and these loads hit the same few rows, in cache. 2^23 + zero is made by
        # its bits too, as 2^23 + q is: no conversion of either.
        at = tl.load(rg_ptr + k0 + tl.arange(0, BLOCK_K))[:, None] * n + cols[None, :]
        scales = tl.load(s_ptr + at).to(tl.float32)
        if HAS_ZEROS:
            zeros = tl.load(z_ptr + at).to(tl.int32) | 0x4B000000
        else:
            zeros = tl.full([BLOCK_K, BLOCK_N], 0x4B000008, tl.int32)
        diff = (q | 0x4B000000).to(tl.float32, bitcast=True) - zeros.to(tl.float32, bitcast=True)
        return diff * scales
    else:
        group = k0 >> group_shift
        scale = tl.load(s_ptr + group * n + cols).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + group * n + cols).to(tl.float32)
        else:
            zero = tl.full([BLOCK_N], 8.0, tl.float32)
        diff = (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + zero)[None, :]
        return diff * scale[None, :]


@triton.jit
def _fma_row(part, xs, x_ptrs, row, m, d, X_SCALE: tl.constexpr, MASKED: tl.constexpr):
    """One row of x times one nibble's denormals d [KW, BLOCK_N] (see _fma_rows): part plus
    x * X_SCALE * d, and the row's sum of x for its zero points."""
    if MASKED:  # a block's first row is always below m
        x = tl.load(x_ptrs, mask=tl.full(x_ptrs.shape, row, tl.int32) < m, other=0.0)
    else:
        x = tl.load(x_ptrs)
    x = x.to(tl.float32)
    # tl.fma, not a * b + c: one rounding whatever triton's default for contracting them
    return tl.fma(tl.broadcast_to((x * X_SCALE)[:, None], d.shape), d, part), xs + x


@triton.jit
def _group_sum(acc, part, xs, scale, neg_zs):
    """acc + part * scale - xs * zero * scale: a group's sums in, two FFMAs an element."""
    return tl.fma(tl.broadcast_to(xs[:, None], part.shape), neg_zs, tl.fma(part, scale, acc))


@triton.jit
def _fma_step_loads(
    qw_ptr, s_ptr, z_ptr, k0, k_end, kw, cols, n, group_shift, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, ROW_GROUP: tl.constexpr,
):  # fmt: skip
    """Step k0's words [KW, BLOCK_N] and its group's scales and zeros [BLOCK_N], as loaded
    (_fma_rows); MASKED: none when k0 >= k_end (undefined values, never used). The words'
    addresses are a scalar base plus loop-invariant offsets (fewer instructions in the loop).
    ROW_GROUP: the words alone, three times (_fma_step_rows loads scales and zeros per row)."""
    # a scalar base (uniform registers) plus loop-invariant offsets
    words = (qw_ptr + (k0 // 8) * n) + (kw[:, None] * n + cols[None, :])
    group = k0 >> group_shift
    if ROW_GROUP:
        ok = tl.full([BLOCK_N], k0, tl.int32) < k_end
        if MASKED:
            packed = tl.load(words, mask=tl.broadcast_to(ok[None, :], words.shape))
        else:
            packed = tl.load(words)
        return packed, packed, packed
    else:
        if MASKED:
            ok = tl.full([BLOCK_N], k0, tl.int32) < k_end
            packed = tl.load(words, mask=tl.broadcast_to(ok[None, :], words.shape))
            return (
                packed,
                tl.load(s_ptr + group * n + cols, mask=ok),
                tl.load(z_ptr + group * n + cols, mask=ok),
            )
        return (
            tl.load(words),
            tl.load(s_ptr + group * n + cols),
            tl.load(z_ptr + group * n + cols),
        )


@triton.jit
def _fma_step(
    acc0, acc1, acc2, acc3, packed, s_raw, z_raw, x_rows, perm_ptr, m, row0, k0, kw, stride_xm,
    s_ptr, z_ptr, rg_ptr, cols, n, HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KW: tl.constexpr, ROW_GROUP: tl.constexpr,
):  # fmt: skip
    """One BLOCK_K step of _fma_rows at row k0 on its loaded words (and, but for ROW_GROUP,
    its group's scales and zeros): the accumulators of the block's rows plus the step's
    products."""
    if ROW_GROUP:
        acc0, acc1, acc2, acc3 = _fma_step_rows(
            acc0, acc1, acc2, acc3, packed, x_rows, perm_ptr, m, row0, k0, kw, stride_xm,
            s_ptr, z_ptr, rg_ptr, cols, n, HAS_PERM, BLOCK_M, KW,
        )  # fmt: skip
    else:
        acc0, acc1, acc2, acc3 = _fma_step_groups(
            acc0, acc1, acc2, acc3, packed, s_raw, z_raw, x_rows, perm_ptr, m, row0, k0, kw,
            stride_xm, HAS_PERM, BLOCK_M, BLOCK_N, KW,
        )  # fmt: skip
    return acc0, acc1, acc2, acc3


@triton.jit
def _fma_step_rows(
    acc0, acc1, acc2, acc3, packed, x_rows, perm_ptr, m, row0, k0, kw, stride_xm, s_ptr, z_ptr,
    rg_ptr, cols, n, HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, KW: tl.constexpr,
):  # fmt: skip
    """_fma_step where a word's eight rows may lie in different groups (row_group): each
    weight dequantized exactly, (q - zero) * scale with its row's scale and zero (gathered by
    rg_ptr, from cache: sorted rows share them in runs), then one FFMA a row of x."""
    zero_sum = tl.zeros([KW], tl.float32)  # _fma_row's sum of x, unused here
    for j in tl.static_range(8):
        rows = k0 + kw * 8 + j  # kernel row 8w + j of each word w
        at = tl.load(rg_ptr + rows)[:, None] * n + cols[None, :]
        scale = tl.load(s_ptr + at).to(tl.float32)
        # 2^23 + q and 2^23 + zero as floats by their bits (see _dequantized): their
        # difference is q - zero exactly, without converting either
        q = ((packed >> (4 * j)) & 0xF) | 0x4B000000
        zero = tl.load(z_ptr + at).to(tl.int32) | 0x4B000000
        w = (q.to(tl.float32, bitcast=True) - zero.to(tl.float32, bitcast=True)) * scale
        x0 = x_rows + rows
        if HAS_PERM:
            x0 = x_rows + tl.load(perm_ptr + rows)
        acc0, _ = _fma_row(acc0, zero_sum, x0, row0, m, w, 1.0, False)
        if BLOCK_M > 1:
            acc1, _ = _fma_row(acc1, zero_sum, x0 + stride_xm, row0 + 1, m, w, 1.0, True)
        if BLOCK_M > 2:
            acc2, _ = _fma_row(acc2, zero_sum, x0 + 2 * stride_xm, row0 + 2, m, w, 1.0, True)
            acc3, _ = _fma_row(acc3, zero_sum, x0 + 3 * stride_xm, row0 + 3, m, w, 1.0, True)
    return acc0, acc1, acc2, acc3


@triton.jit
def _fma_step_groups(
    acc0, acc1, acc2, acc3, packed, s_raw, z_raw, x_rows, perm_ptr, m, row0, k0, kw, stride_xm,
    HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr,
):  # fmt: skip
    """_fma_step where the step lies in one group: its products on the CUDA cores, scaled and
    shifted by the group's zero once a step (_fma_rows)."""
    high = packed >> 12
    x_step = x_rows + k0 + kw * 8
    scale = s_raw.to(tl.float32)
    zs = z_raw.to(tl.float32) * scale
    zs = tl.broadcast_to(-zs[None, :], (KW, BLOCK_N))
    scale = scale * 3.8685626227668134e25  # 2^85: the sums' unit back to 1
    scale = tl.broadcast_to(scale[None, :], (KW, BLOCK_N))
    part0 = tl.zeros([KW, BLOCK_N], tl.float32)
    part1 = tl.zeros([KW, BLOCK_N], tl.float32)
    part2 = tl.zeros([KW, BLOCK_N], tl.float32)
    part3 = tl.zeros([KW, BLOCK_N], tl.float32)
    xs0 = tl.zeros([KW], tl.float32)
    xs1 = tl.zeros([KW], tl.float32)
    xs2 = tl.zeros([KW], tl.float32)
    xs3 = tl.zeros([KW], tl.float32)
    for j in tl.static_range(8):
        pos = 4 * j - 12 * (j >= 5)
        d = ((packed if j < 5 else high) & (15 << pos)).to(tl.float32, bitcast=True)
        x0 = x_step + j
        if HAS_PERM:
            x0 = x_rows + tl.load(perm_ptr + k0 + kw * 8 + j)
        xsc = 18446744073709551616.0 / (1 << pos)  # 2^(64 - p)
        part0, xs0 = _fma_row(part0, xs0, x0, row0, m, d, xsc, False)
        if BLOCK_M > 1:
            part1, xs1 = _fma_row(part1, xs1, x0 + stride_xm, row0 + 1, m, d, xsc, True)
        if BLOCK_M > 2:
            part2, xs2 = _fma_row(part2, xs2, x0 + 2 * stride_xm, row0 + 2, m, d, xsc, True)
            part3, xs3 = _fma_row(part3, xs3, x0 + 3 * stride_xm, row0 + 3, m, d, xsc, True)
    acc0 = _group_sum(acc0, part0, xs0, scale, zs)
    if BLOCK_M > 1:
        acc1 = _group_sum(acc1, part1, xs1, scale, zs)
    if BLOCK_M > 2:
        acc2 = _group_sum(acc2, part2, xs2, scale, zs)
        acc3 = _group_sum(acc3, part3, xs3, scale, zs)
    return acc0, acc1, acc2, acc3


@triton.jit
def _fma_rows(
    x_rows,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    m,
    row0,
    cols,
    n,
    stride_xm,
    k_start,
    k_end,
    group_shift,
    rg_ptr,
    HAS_PERM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
    TRIGGER: tl.constexpr,
    ROW_GROUP: tl.constexpr,
):
    """x[row0 + (0..BLOCK_M), k_start:k_end] @ W[.., cols] on the CUDA cores: [BLOCK_M,
    BLOCK_N] fp32, BLOCK_M 1, 2 or 4. The words stay the [BLOCK_K / 8, BLOCK_N] tile they were
    loaded as, each thread summing its own (word, column) positions until one cross-thread sum
    after the loop. Two instructions a weight and row: one LOP3 masks nibble j in place, and
    its bits read as the float32 denormal q * 2^(p - 149), p its bit position (4j; the top
    three nibbles come from the word shifted right by 12, p 8 to 16, so every nibble sits
    below the exponent); one FFMA multiplies that by x * 2^(64 - p) into a sum in units of
    2^-85, exact products as the plain q * x would be. Zero points and scales apply once a
    group (BLOCK_K divides it): s * (sum x q - z * sum x). Range: |x| < 2^64 (x * 2^64 must
    not overflow); a product under 2^-126 (|x q| < 2^-41) is a denormal and loses bits.
    PDL, TRIGGER (inferx_kernels_cuda.pdl): the wait comes after the first step's loads (the
    weight is no kernel's output)."""
    KW: tl.constexpr = BLOCK_K // 8
    kw = tl.arange(0, KW)
    acc0 = tl.zeros([KW, BLOCK_N], tl.float32)
    acc1 = tl.zeros([KW, BLOCK_N], tl.float32)
    acc2 = tl.zeros([KW, BLOCK_N], tl.float32)
    acc3 = tl.zeros([KW, BLOCK_N], tl.float32)
    # Step i + 1's words, scales and zeros are loaded before step i's arithmetic, so they
    # are in flight while it runs. The first step's loads come before the loop (none for a
    # split past K, k_start >= k_end), and the last step runs after it: the loop's loads
    # stay unmasked (a masked load's registers are zeroed first: instructions a step).
    packed, s_raw, z_raw = _fma_step_loads(
        qw_ptr, s_ptr, z_ptr, k_start, k_end, kw, cols, n, group_shift, BLOCK_N, True, ROW_GROUP,
    )  # fmt: skip
    # Launched early (PDL), the program waits here for the kernel ahead, which writes x:
    # the first step's weight loads are in flight across the wait, x's all come after it.
    pdl_start(PDL, TRIGGER)
    for k0 in range(k_start, k_end - BLOCK_K, BLOCK_K):
        words_next, s_next, z_next = _fma_step_loads(
            qw_ptr, s_ptr, z_ptr, k0 + BLOCK_K, k_end, kw, cols, n, group_shift, BLOCK_N,
            False, ROW_GROUP,
        )  # fmt: skip
        acc0, acc1, acc2, acc3 = _fma_step(
            acc0, acc1, acc2, acc3, packed, s_raw, z_raw, x_rows, perm_ptr, m, row0, k0,
            kw, stride_xm, s_ptr, z_ptr, rg_ptr, cols, n, HAS_PERM, BLOCK_M, BLOCK_N, KW,
            ROW_GROUP,
        )  # fmt: skip
        packed, s_raw, z_raw = words_next, s_next, z_next
    if k_start < k_end:
        acc0, acc1, acc2, acc3 = _fma_step(
            acc0, acc1, acc2, acc3, packed, s_raw, z_raw, x_rows, perm_ptr, m, row0,
            k_end - BLOCK_K, kw, stride_xm, s_ptr, z_ptr, rg_ptr, cols, n, HAS_PERM,
            BLOCK_M, BLOCK_N, KW, ROW_GROUP,
        )  # fmt: skip
    # each row's [KW, BLOCK_N] sums summed across their KW rows (the one cross-thread sum)
    rows = tl.arange(0, BLOCK_M)[:, None]
    out = tl.where(rows == 0, tl.sum(acc0, axis=0)[None, :], 0.0)
    if BLOCK_M > 1:
        out = tl.where(rows == 1, tl.sum(acc1, axis=0)[None, :], out)
    if BLOCK_M > 2:
        out = tl.where(rows == 2, tl.sum(acc2, axis=0)[None, :], out)
        out = tl.where(rows == 3, tl.sum(acc3, axis=0)[None, :], out)
    return out


@triton.jit(do_not_specialize=["m"])
def w4a16_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    perm_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    stride_xm,
    stride_os,
    stride_om,
    k_per_split,
    group_shift,
    rg_ptr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PACKED: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
    TRIGGER: tl.constexpr = False,
    LATE: tl.constexpr = False,
    ROW_GROUP: tl.constexpr = False,
):
    """Grid (column blocks, row blocks, splits): out[split] = x[rows, ks] @ W[ks, cols] (+ bias
    in split 0), ks = this split's [k_start, k_start + k_per_split) clipped to k; k_per_split
    and k are multiples of BLOCK_K. Columns past n reread a real column (never stored), so the
    weight loads stay unmasked. PDL, TRIGGER, LATE: inferx_kernels_cuda.pdl (pdl_launch); the
    CUDA-core path's prefetch issues its first step's weight loads before the wait. ROW_GROUP:
    kernel row i's scales and zeros are row rg_ptr[i] of theirs (int32 [K]), not
    i >> group_shift."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % n
    m_mask = offs_m < m
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    if not USE_DOT:
        acc = _fma_rows(
            x_ptr + pid_m.to(tl.int64) * BLOCK_M * stride_xm, qw_ptr, s_ptr, z_ptr, perm_ptr, m,
            pid_m * BLOCK_M, cols, n, stride_xm, k_start, k_end, group_shift, rg_ptr,
            HAS_PERM, BLOCK_M, BLOCK_N, BLOCK_K, PDL, TRIGGER, ROW_GROUP,
        )  # fmt: skip
    else:
        pdl_start(PDL, TRIGGER)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if HAS_PERM:
                offs_k = tl.load(perm_ptr + offs_k)
            x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            w = _dequantized(
                qw_ptr, s_ptr, z_ptr, k0, cols, n, group_shift, BLOCK_K, BLOCK_N, PACKED, True,
                rg_ptr, ROW_GROUP,
            )  # fmt: skip
            if UPCAST:
                acc += tl.dot(x.to(tl.float32), w, input_precision=DOT_PRECISION)
            else:
                acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION)
    pdl_late(LATE)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols).to(tl.float32)
        acc += bias[None, :] * (pid_k == 0).to(tl.float32)
    out = out_ptr + pid_k * stride_os + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < n)[None, :])


def _block_k(cfg: W4Config, group_size: int, k: int) -> int:
    """cfg.block_k lowered to the largest power of two dividing the group size and K."""
    common = math.gcd(group_size, k)
    block = cfg.block_k
    while block > 16 and common % block:
        block //= 2
    if common % block:
        raise ValueError(f"w4a16: group_size {group_size} and K {k} need a common factor of 16")
    return block


def _group_shift(group_size: int, k: int) -> int:
    """The shift that takes a row to its group (k0 >> shift, no division in the loop): log2 of
    a power-of-two group size, or past K's top bit for one group over K."""
    if group_size & (group_size - 1) == 0:
        return group_size.bit_length() - 1
    if group_size == k:
        return k.bit_length()
    raise ValueError(f"w4a16: group_size {group_size} must be a power of two or K ({k})")


def _check(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    row_group: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _DTYPES:
        raise ValueError(
            f"w4a16: x must be [M, K] with unit stride along K in fp16, bf16 or fp32, got "
            f"{tuple(x.shape)} {x.dtype} strides {x.stride()}"
        )
    k, n = x.shape[1], qweight.shape[1]
    groups = k // group_size if row_group is None else scales.shape[0]
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (k // 8, n):
        raise ValueError(
            f"w4a16: qweight must be int32 [{k // 8}, N], got {qweight.dtype} "
            f"{tuple(qweight.shape)}"
        )
    if tuple(scales.shape) != (groups, n) or tuple(zeros.shape) != (groups, n):
        raise ValueError(
            f"w4a16: scales and zeros must be [{groups}, {n}], got {tuple(scales.shape)} and "
            f"{tuple(zeros.shape)}"
        )
    for name, t in (("perm", perm), ("row_group", row_group)):
        if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (k,)):
            raise ValueError(f"w4a16: {name} must be int32 [{k}], got {t.dtype} {tuple(t.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"w4a16: bias must be [{n}], got {tuple(bias.shape)}")
    for t in (qweight, scales, zeros, perm, bias, row_group):
        if t is not None and not t.is_contiguous():
            raise ValueError(
                "w4a16: qweight, scales, zeros, perm, bias and row_group must be contiguous"
            )
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"w4a16: runs on CUDA tensors (or under TRITON_INTERPRET=1), not {x.device}"
        )


def pdl_launch(device: torch.device, rows: int, trigger: bool = False) -> dict[str, Any]:
    """w4a16_kernel's PDL arguments for `rows` rows of x: none (the kernel as without PDL)
    past PDL_MAX_ROWS rows; else pdl.gemv_launch's, as the bf16 decode GEMVs get them (PDL
    where the device has it; TRIGGER where the rows or the caller's `trigger` say the kernel
    after it launches early; LATE else, at LATE_ROWS)."""
    if rows > PDL_MAX_ROWS:
        return {}
    return gemv_launch(device, rows, trigger)


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    cfg: W4Config,
    pdl: dict[str, Any],
    row_group: torch.Tensor | None = None,
) -> None:
    """One kernel launch into out [split_k, M, N] (any float dtype); pdl: pdl_launch's."""
    m, k = x.shape
    n = qweight.shape[1]
    if not cfg.use_dot and (cfg.block_m > MAX_FMA_ROWS or cfg.block_m & (cfg.block_m - 1)):
        raise ValueError(f"w4a16: the FMA path takes block_m 1, 2 or 4, not {cfg.block_m}")
    if row_group is not None:  # a K step may cross groups: any block_k dividing K
        group_size = k
    block_k = _block_k(cfg, group_size, k)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)
    # Absent perm, bias, row_group: a dummy pointer HAS_PERM / HAS_BIAS / ROW_GROUP = False
    # compiles away.
    w4a16_kernel[grid](
        x,
        qweight,
        scales,
        zeros,
        perm if perm is not None else qweight,
        bias if bias is not None else scales,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        out.stride(1),
        k_per_split,
        _group_shift(group_size, k),
        row_group if row_group is not None else qweight,
        HAS_PERM=perm is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=block_k,
        PACKED=cfg.packed_loads,
        USE_DOT=cfg.use_dot,
        # bf16 tl.dot is wrong under the interpreter only; there operands go to fp32 first.
        UPCAST=x.dtype == torch.float32 or (interpret and x.dtype == torch.bfloat16),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        ROW_GROUP=row_group is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl,
    )


def _gathered(
    x: torch.Tensor, perm: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Past GEMV_ROWS rows x's columns are put in the weight's row order once, here: the tiled
    GEMM reads x once per column block, and scattered 2-byte loads that many times would cost
    more than one gather. Up to GEMV_ROWS the kernel gathers as it loads (no extra launch)."""
    if perm is None or x.shape[0] <= GEMV_ROWS:
        return x, perm
    return x.index_select(1, perm), None


def _pdl_after_gather(x: torch.Tensor, perm: torch.Tensor | None, trigger: bool) -> dict[str, Any]:
    """pdl_launch's arguments for x, none where _gathered permutes it first: the kernel ahead
    is then that gather, which lets no kernel launch early."""
    if perm is not None and x.shape[0] > GEMV_ROWS:
        return {}
    return pdl_launch(x.device, x.shape[0], trigger)


def default_config(m: int, n: int, k: int, num_sms: int = _H100_SMS) -> W4Config:
    """fma_config up to FMA_ROWS rows, else pick_config."""
    if 1 <= m <= min(FMA_ROWS, MAX_FMA_ROWS):
        return fma_config(m, n, k, num_sms)
    return pick_config(m, n, k, num_sms)


def w4a16_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: W4Config | None = None,
    row_group: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """x [M, K] times the 4-bit weight (module docstring) (+ bias): [M, N] in x's dtype. One
    launch, or two with a K split (the second sums the splits, adds the bias and casts); no
    host sync, so it can be captured in a CUDA graph. row_group: int32 [K], the row of scales
    and zeros of each kernel row (module docstring: a K slice of act-order); group_size is
    then unused. gated (N even, gate columns then up columns): silu(gate) * up as [M, N / 2],
    made by the reduce (always launched then) from the gate and up sums each rounded to x's
    dtype first, as silu_and_mul after the plain call computes it."""
    if gated and qweight.shape[-1] % 2:
        raise ValueError(
            f"w4a16_linear: gated needs gate and up halves, got {qweight.shape[-1]} columns"
        )
    _check(x, qweight, scales, zeros, group_size, perm, bias, row_group)
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n // 2 if gated else n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or default_config(m, n, k, _num_sms(x.device))
    reduced = cfg.split_k > 1 or gated
    # Before a reduce the GEMV triggers at its start (the reduce loads nothing before its wait,
    # and its programs arrive only once all of the GEMV's have started).
    pdl = _pdl_after_gather(x, perm, reduced)
    x, perm = _gathered(x, perm)
    args = (x, qweight, scales, zeros, group_size, perm)
    if not reduced:
        _launch(*args, bias, out.unsqueeze(0), cfg, pdl, row_group)
        return out
    # With PDL the reduce waits at its start for the GEMV (which waited for the kernel ahead)
    # and lets the next kernel launch: that one reads out only after its own wait.
    reduce_pdl = {"PDL": True, "TRIGGER": True, "launch_pdl": True} if pdl.get("PDL") else {}
    partial = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    _launch(*args, None, partial, cfg, pdl, row_group)
    split_k_reduce_kernel[(m, triton.cdiv(out.shape[1], _REDUCE_BLOCK))](
        partial,
        bias if bias is not None else partial,
        out,
        m,
        n,
        cfg.split_k,
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK=_REDUCE_BLOCK,
        GATED=gated,
        **reduce_pdl,
    )
    return out


def w4a16_linear_parts(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: W4Config | None = None,
    trigger: bool = False,
    row_group: torch.Tensor | None = None,
) -> torch.Tensor:
    """The K split's partial results [S, M, N] in x's dtype, the bias in the first, for callers
    that sum them anyway (QuantLinear.forward_parts): one launch. trigger: the kernel after it
    launches early (PDL, pdl_launch)."""
    _check(x, qweight, scales, zeros, group_size, perm, bias, row_group)
    m, k = x.shape
    n = qweight.shape[1]
    cfg = config or default_config(m, n, k, _num_sms(x.device))
    out = torch.empty((cfg.split_k, m, n), dtype=x.dtype, device=x.device)
    if m:
        pdl = _pdl_after_gather(x, perm, trigger)
        x, perm = _gathered(x, perm)
        _launch(x, qweight, scales, zeros, group_size, perm, bias, out, cfg, pdl, row_group)
    return out
