"""Pull the first bytes a decode GEMV reads into L2, beside the latency-bound kernels before it.

A small-batch decode layer spends ~15 µs on its attention block (norm, QKV, the decode kernel,
o_proj), which reads ~20 MB: HBM idles for much of it. The MLP after it (3B's gate_up: 90 MB)
is bound by HBM. `l2_prefetch` asks L2 (Hopper's `cp.async.bulk.prefetch.L2`, a hint that
changes no result) for the first `fraction` of every K-slice row of a weight: what each program
of tma_gemv_kernel / tma_norm_gemv_kernel reads first, since they all walk K from their slice's
start. TritonOps issues it on a side stream forked from the main one, so nothing in the chain
waits for it (session 11 had issued it in the chain: each launch cost ~5 µs there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Requests a program issues (one per K-slice row).
REQUESTS_PER_PROGRAM = 256


_NOT_SPECIALISED = ["count", "row_bytes", "k_bytes", "seg_bytes", "parts", "slice_bytes"]


@triton.jit(do_not_specialize=_NOT_SPECIALISED)
def l2_prefetch_kernel(
    addr, count, row_bytes, k_bytes, seg_bytes, parts, slice_bytes, BLOCK: tl.constexpr
):  # fmt: skip
    """Request i (< count) asks L2 for up to seg_bytes at the start of K-slice i % parts
    (slice_bytes apart) of row i // parts (row_bytes apart), cut at the row's k_bytes. The
    kernel does not wait for them."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offset = (i % parts) * slice_bytes
    start = addr + (i // parts) * row_bytes + offset
    size = tl.minimum(seg_bytes, (k_bytes - offset) // 16 * 16)
    size = tl.where(i < count, size, 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [start, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def l2_prefetch(weight: torch.Tensor, fraction: float, k_per_split: int | None = None) -> None:
    """Ask L2 for the first `fraction` of each K-slice of k_per_split columns (default: all of
    K) of each of weight [N, K]'s rows, as 16-byte multiples: where the programs of a TMA GEMV
    with that split start. Launches one kernel on the current stream; nothing waits for it."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    size = weight.element_size()
    k_per_split = k_per_split or k
    if (
        weight.dim() != 2
        or weight.stride(1) != 1
        or (weight.stride(0) * size) % 16
        or weight.data_ptr() % 16
        or (k_per_split * size) % 16
        or not 0.0 < fraction <= 1.0
    ):
        raise ValueError(
            f"l2_prefetch: weight [N, K] with a unit K stride, 16-byte aligned rows and slices "
            f"and a fraction in (0, 1]; got strides {weight.stride()}, {k_per_split} columns a "
            f"slice, fraction {fraction}"
        )
    parts = triton.cdiv(k, k_per_split)
    seg = max(16, int(k_per_split * size * fraction) // 16 * 16)
    count = n * parts
    l2_prefetch_kernel[(triton.cdiv(count, REQUESTS_PER_PROGRAM),)](
        weight.data_ptr(), count, weight.stride(0) * size, k * size, seg, parts,
        k_per_split * size, BLOCK=REQUESTS_PER_PROGRAM, num_warps=4,
    )  # fmt: skip
