"""Pull a byte range of device memory into L2 without waiting for it (Hopper's bulk prefetch).

Each program asks for CHUNK bytes, LANES requests of CHUNK // LANES, and exits at once: the
copy engine fills L2 while the kernels after it run. Many programs, so that many SMs' copy
engines issue in parallel. PTX `cp.async.bulk.prefetch.L2.global` (sm_90+) wants a 16-byte
aligned address and a size that is a multiple of 16. The kernel is inline PTX, so it has no
meaning under TRITON_INTERPRET; prefetch_l2 never launches it off a CUDA device of sm_90+.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CHUNK = 128 * 1024  # bytes per program
LANES = 32  # requests per program: one warp, one each


@triton.jit(do_not_specialize=["nbytes"])
def l2_prefetch_kernel(addr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    lane = tl.arange(0, LANES)
    start = tl.program_id(0).to(tl.int64) * CHUNK + lane * (CHUNK // LANES)
    size = tl.minimum(tl.maximum(nbytes - start, 0), CHUNK // LANES).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr + start, size],
        dtype=tl.int32,
        is_pure=False,  # its only effect is on the cache: never dropped as unused
        pack=1,
    )


@functools.cache
def supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def prefetch_l2(weight: torch.Tensor, max_bytes: int) -> bool:
    """Issue prefetches for the first max_bytes (rounded down to 16) of weight's storage, on
    the current stream. Returns False (and does nothing) where the instruction is missing."""
    if not supported(weight.device):
        return False
    nbytes = min(weight.numel() * weight.element_size(), max_bytes) // 16 * 16
    if nbytes <= 0 or weight.data_ptr() % 16:
        return False
    grid = (triton.cdiv(nbytes, CHUNK),)
    l2_prefetch_kernel[grid](weight.data_ptr(), nbytes, CHUNK=CHUNK, LANES=LANES, num_warps=1)
    return True
