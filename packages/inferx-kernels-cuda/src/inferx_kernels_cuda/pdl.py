"""Programmatic dependent launch (PDL) of the decode GEMVs.

A small-batch decode step is a chain of ~300 short kernels inside a CUDA graph, and each
launch leaves a gap of about half a microsecond. A TMA GEMV (tma_gemv_kernel,
tma_norm_gemv_kernel) launched with PDL becomes resident as soon as the kernel ahead of it
lets it (every program of that kernel has called `gdc_launch_dependents`, or exited), and
waits in `gdc_wait` until that kernel has finished and its writes are visible. The kernels
ahead of the GEMVs call `gdc_launch_dependents` at their start (their TRIGGER constexpr):
rms_norm_kernel, decode_kernel, decode_reduce_kernel, and silu_and_mul_kernel (ahead of a
down_proj not fused with gate_up). The trigger does nothing when the next kernel was launched
without PDL. Every other kernel launches as before. W4A16's GEMV (w4a16.w4a16_kernel) takes
the same rules up to w4a16.PDL_MAX_ROWS rows (w4a16.pdl_launch), through
QuantLinear.takes_trigger for the call sites' triggers below; the split reduce after it
(gemv.split_k_reduce_kernel) launches with PDL and triggers at its start.

Faster steps at every batch of 1-64 (the graph's launch gaps shrink). By the step's rows (a
decode step's batch; row ranges as tuples of (lo, hi), module attributes below that tests and
benchmarks may set):
- ALL_ROWS (layers up to ALL_MAX_WIDTH wide): the kernels between the GEMVs launch with PDL
  too, each waiting at its start, and every kernel of the chain, GEMVs included, triggers right
  after its wait (at most one kernel ahead). Slower at 1 row, from 32, and on wider layers.
- CHAIN_ROWS: GEMVs let the next kernel launch early too (slower at 1-2 rows).
- ATTENTION_ROWS (attention_early): QKV into the decode kernel, which loads its metadata
  before its wait; NORM_ROWS (norm_early): down_proj into the next norm.
- LATE_ROWS (pdl_late): GEMVs that do not trigger at their start trigger after their K loop.
Each GEMV program prefetching its first weight tiles into L2 before its wait was slower and
was removed; tma_reduce_linear instead loads its whole weight slice before its wait (into
shared memory). PDL on the small kernels themselves, behind cuBLAS GEMMs, was slower: its
edges cost more than the launches they hid. The reasons and figures are in
docs/ARCHITECTURE.md's decision register and docs/BENCHMARKS.md.

On for Hopper or newer with a Triton that has launch_pdl; never under TRITON_INTERPRET.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _no_wait() -> None:
    pass


@triton.jit
def _no_trigger() -> None:
    pass


try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never traced (PDL is off)
    gdc_wait, gdc_launch_dependents = _no_wait, _no_trigger
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # The interpreter has no grid dependency control either. PDL never launches there, but
    # tests run a kernel's PDL variant (its loads placed around the wait) against the plain one.
    gdc_wait, gdc_launch_dependents = _no_wait, _no_trigger


__all__ = [
    "attention_early",
    "between_launch",
    "gemv_launch",
    "in_ranges",
    "norm_early",
    "pdl_enabled",
    "pdl_late",
    "pdl_start",
]

# The rows (a decode step's batch) at which the GEMVs let the next kernel launch early
# (CHAIN_ROWS), and at which the kernels between them launch with PDL too (ALL_ROWS, only for
# layers up to ALL_MAX_WIDTH wide: wider ones lost); the single edges (ATTENTION_ROWS,
# NORM_ROWS: slower from 64 rows), and the late trigger (LATE_ROWS: at batch 1 o_proj into
# gate_up and gate_up into down, the two plain edges left; the next GEMV's launch and prologue
# overlap this one's tail, and its programs arrive when this one's have all started, so they
# take no SM slots from it). An L2 prefetch of the decode kernel's first K/V tile before its
# wait added nothing and was removed.
ATTENTION_ROWS: tuple[tuple[int, int], ...] = ((1, 48),)
NORM_ROWS: tuple[tuple[int, int], ...] = ((1, 48),)
LATE_ROWS: tuple[tuple[int, int], ...] = ((1, 64),)
ALL_ROWS: tuple[tuple[int, int], ...] = ((2, 16),)
ALL_MAX_WIDTH = 2048
CHAIN_ROWS: tuple[tuple[int, int], ...] = ((33, 64),)


@triton.jit
def pdl_start(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """A kernel's PDL prologue: with PDL (it was launched early) wait until the kernel ahead
    has finished and its writes are visible; then with TRIGGER let the next kernel launch. The
    wait comes first, so at most one kernel runs ahead."""
    if PDL:
        gdc_wait()
    if TRIGGER:
        gdc_launch_dependents()


@triton.jit
def pdl_late(LATE: tl.constexpr):
    """A GEMV's late trigger, after its K loop: with LATE let the next kernel launch now."""
    if LATE:
        gdc_launch_dependents()


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    import triton.language.extra.cuda as cuda_extra

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda_extra, "gdc_wait")


@functools.cache
def _enabled(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    return _triton_has_pdl()


def in_ranges(rows: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether a row-range setting (tuples of (lo, hi), inclusive) takes `rows` rows."""
    return any(lo <= rows <= hi for lo, hi in ranges)


def _chain(rows: int) -> bool:
    return _all(rows) or in_ranges(rows, CHAIN_ROWS)


def _all(rows: int) -> bool:
    return in_ranges(rows, ALL_ROWS)


def attention_early(device: torch.device, rows: int) -> bool:
    """Whether, at `rows` rows of a decode-only step, the QKV GEMV lets the decode kernel
    launch early, which then loads the step's metadata (its context, the rotary's cos and sin)
    before its wait (its EARLY constexpr): ATTENTION_ROWS, PDL on."""
    return pdl_enabled(device) and in_ranges(rows, ATTENTION_ROWS)


def norm_early(device: torch.device, rows: int) -> bool:
    """Whether, at `rows` rows, the GEMMs that TritonOps.linear_parts runs (down_proj; o_proj
    where the split combine does not take it) let the next kernel launch early and
    rms_norm_kernel launches with PDL (loading its weight before its wait): NORM_ROWS, PDL
    on. At up to 8 rows the norm after down_proj is the only rms_norm_kernel of a
    layer (the post-attention norm runs inside gate_up)."""
    return pdl_enabled(device) and in_ranges(rows, NORM_ROWS)


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode GEMVs on this device launch with PDL (read once per device)."""
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def gemv_launch(device: torch.device, rows: int, trigger: bool = False) -> dict[str, Any]:
    """A TMA GEMV launch's PDL arguments for `rows` rows of x: its PDL and TRIGGER constexprs
    (TRIGGER also where the caller asks: QKV before an early decode kernel), LATE where it does
    not trigger at its start and LATE_ROWS takes the rows, and Triton's launch_pdl option
    when PDL is on."""
    if not pdl_enabled(device):
        return {"PDL": False, "TRIGGER": False}
    args = {"PDL": True, "TRIGGER": trigger or _chain(rows), "launch_pdl": True}
    if not args["TRIGGER"] and in_ranges(rows, LATE_ROWS):
        args["LATE"] = True  # only then: the default variants stay as they were
    return args


def between_launch(
    device: torch.device, rows: int, width: int, norm: bool = False
) -> dict[str, Any]:
    """The PDL arguments of a kernel between the GEMVs (rms_norm_kernel, decode_kernel,
    decode_reduce_kernel; silu_and_mul_kernel takes TRIGGER alone) for a step of `rows` rows
    of a layer `width` wide (the norm's columns, the attention's heads x head dim, the
    activation's columns): TRIGGER (the GEMV after it may launch early),
    and PDL (it launches early itself and waits) with Triton's launch_pdl where ALL_ROWS
    takes the rows and width <= ALL_MAX_WIDTH, or for the norm (`norm`) where NORM_ROWS takes
    them."""
    if not pdl_enabled(device):
        return {"PDL": False, "TRIGGER": False}
    if (_all(rows) and width <= ALL_MAX_WIDTH) or (norm and norm_early(device, rows)):
        return {"PDL": True, "TRIGGER": True, "launch_pdl": True}
    return {"PDL": False, "TRIGGER": True}
