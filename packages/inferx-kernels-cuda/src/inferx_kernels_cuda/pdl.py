"""Programmatic dependent launch (PDL) of the decode GEMVs.

A small-batch decode step is a chain of ~300 short kernels inside a CUDA graph, and each
launch leaves a gap of about half a microsecond. A TMA GEMV (tma_gemv_kernel,
tma_norm_gemv_kernel) launched with PDL becomes resident as soon as the kernel ahead of it
lets it (every program of that kernel has called `gdc_launch_dependents`, or exited), and
waits in `gdc_wait` until that kernel has finished and its writes are visible. The kernels
ahead of the GEMVs call `gdc_launch_dependents` at their start (their TRIGGER constexpr):
rms_norm_kernel, decode_kernel and decode_reduce_kernel. The trigger does nothing
when the next kernel was launched without PDL. Every other kernel launches as before.

Measured on the H200 (BENCHMARKS.md, session 16): steps 22-49 µs faster at every batch of 1-64
(3B and 8B; the graph's launch gaps 127 -> ~70 µs a step). Two variants, by the step's rows
(session 17; ALL_ROWS and CHAIN_ROWS below):
- INFERX_PDL_ALL (default 2-16, layers up to ALL_MAX_WIDTH wide): the kernels between the
  GEMVs launch with PDL too, each waiting at its start, and every kernel of the chain, GEMVs
  included, triggers right after its wait (at most one kernel ahead). 3B: faster at batch
  2-16, slower at 1 and from 32; 8B (4096 wide): slower at 8-16.
- INFERX_PDL_CHAIN (default 33-64): GEMVs let the next kernel launch early too. Slower at
  batch 1-2 (session 16), faster at 8 and 48-64.
Both take "0", "1" (every row count) or row ranges ("5-8,33-64") for A/B runs, as do two
single edges (session 18, default 1-48 each): INFERX_PDL_ATTENTION (QKV into the decode kernel,
attention_early) and INFERX_PDL_NORM (down_proj into the next norm, norm_early); together 3B
steps 5-97 µs faster at batch 1-48. INFERX_PDL_LATE (session 19, default 1-64): GEMVs that
do not trigger at their start trigger after their K loop (pdl_late); batch-1 steps 12-20 µs
faster on both models.
Each GEMV program prefetching its first weight tiles into L2 before its wait was slower
everywhere (session 16; behind a late trigger too, session 21) and was removed;
tma_reduce_linear instead loads its whole weight slice before its wait (into shared memory)
and is faster at 1-4 rows (session 17).
PDL on the small kernels themselves, behind cuBLAS GEMMs, measured slower in session 5: its
edges cost more than the launches they hid.

On for Hopper or newer with a Triton that has launch_pdl; never under TRITON_INTERPRET.
INFERX_PDL=0 turns it off (A/B runs).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never traced (PDL is off)

    @triton.jit
    def gdc_wait() -> None:
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass


__all__ = [
    "attention_early",
    "between_launch",
    "gemv_launch",
    "in_ranges",
    "norm_early",
    "pdl_enabled",
    "pdl_late",
    "pdl_start",
    "row_ranges",
]

# The rows (a decode step's batch) at which the GEMVs let the next kernel launch early
# (INFERX_PDL_CHAIN), and at which the kernels between them launch with PDL too
# (INFERX_PDL_ALL). H200, 3B steps (profile_decode, session 17), ms at 128 / 640 tokens:
# - all, off -> on: batch 2 2.305 -> 2.259 / 2.310 -> 2.263, 8 2.367 -> 2.304 / 2.419 ->
#   2.343, 16 2.407 -> 2.335 / 2.510 -> 2.440; but batch 1 2.256 -> 2.292 / 2.256 -> 2.304,
#   32 2.458 -> 2.704 / 2.665 -> 3.012, 64 2.631 -> 2.647 / 2.942 -> 3.116.
# - chain at 5-8 and 33-64, off -> on: batch 8 2.369 -> 2.333 / 2.414 -> 2.380, 48 2.568 ->
#   2.548 / 2.875 -> 2.853, 64 2.645 -> 2.607 / 2.944 -> 2.929 (1-4, 16, 32 level).
# - all at 2-16 for Llama-3.1-8B's widths (4096), off -> on at 640 tokens: batch 8 4.541 ->
#   4.638, 16 4.756 -> 4.804: so only for layers up to ALL_MAX_WIDTH wide.
# INFERX_PDL_ATTENTION: at its rows the QKV GEMV triggers and the decode kernel launches with
# PDL, loading its context and rotary before the wait. INFERX_PDL_NORM: at its rows
# linear_parts' GEMMs trigger and rms_norm_kernel launches with PDL. H200, 3B steps
# (profile_decode, session 18), ms at 128 / 640 tokens, both off -> both on:
# - batch 1 2.155 -> 2.058 / 2.174 -> 2.086, 2 2.144 -> 2.104 / 2.232 -> 2.197, 4 2.190 ->
#   2.154 / 2.309 -> 2.281, 8 2.304 -> 2.257 / 2.335 -> 2.293, 16 2.338 -> 2.292 / 2.448 ->
#   2.404; at batch 1 each edge alone wins 24-37 µs, at 2-16 the attention edge nearly all;
# - at 1-64 rows: batch 24 2.431 -> 2.376 / 2.615 -> 2.610, 32 2.439 -> 2.378 / 2.639 ->
#   2.634, 48 2.526 -> 2.452 / 2.824 -> 2.808, but 64 2.589 -> 2.530 / 2.897 -> 2.995.
# An L2 prefetch of the decode kernel's first K/V tile before its wait added nothing (batch
# 1-16 level or 10-27 µs slower) and was removed.
ATTENTION_ROWS = "1-48"
NORM_ROWS = "1-48"
# INFERX_PDL_LATE: at its rows a GEMV that does not trigger at its start (not in the chain, no
# single edge) triggers once its K loop is done (its LATE constexpr): at batch 1 o_proj into
# gate_up and gate_up into down, the two plain edges left. The next GEMV's launch and prologue
# overlap this one's tail, and its programs arrive when this one's have all started, so they
# take no SM slots from it (the chain's loss at 1-2). H200, profile_decode, ms a step, off ->
# 1-64, two machines (session 19): 3B batch 1 2.062 -> 2.043 and 2.080 -> 2.063 (128 tokens),
# 2.074 -> 2.071 and 2.098 -> 2.085 (640); 3B batch 24 and 32 20-27 µs faster at both lengths;
# 8B batch 1 4.080 -> 4.060 (128), 4.097 -> 4.085 (640); elsewhere (3B 2-16, 48, 64; 8B 2-32)
# within +-12 µs.
LATE_ROWS = "1-64"
ALL_ROWS = "2-16"
ALL_MAX_WIDTH = 2048
CHAIN_ROWS = "33-64"


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
    if os.environ.get("INFERX_PDL", "1") == "0":
        return False
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    return _triton_has_pdl()


def row_ranges(name: str, default: str = "0") -> tuple[tuple[int, int], ...]:
    """A row-range environment setting (unset: default): "0" or "" none, "1" every row count,
    else ranges "LO-HI" (or "N") joined by commas; anything else is refused with its name."""
    value = os.environ.get(name, default).strip()
    if value in ("0", ""):
        return ()
    if value == "1":
        return ((1, 1 << 30),)
    ranges = []
    for item in value.split(","):
        lo, sep, hi = item.strip().partition("-")
        hi = hi if sep else lo
        if not (lo.isdigit() and hi.isdigit() and 1 <= int(lo) <= int(hi)):
            raise ValueError(f"{name}: 0, 1 or row ranges LO-HI[,LO-HI...], got {value!r}")
        ranges.append((int(lo), int(hi)))
    return tuple(ranges)


def in_ranges(rows: int, ranges: tuple[tuple[int, int], ...]) -> bool:
    """Whether a row-range setting (row_ranges) takes `rows` rows."""
    return any(lo <= rows <= hi for lo, hi in ranges)


@functools.cache
def _chain_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_CHAIN: the rows of x at which a GEMV lets the next kernel launch early."""
    return row_ranges("INFERX_PDL_CHAIN", CHAIN_ROWS)


@functools.cache
def _all_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_ALL: the rows at which the kernels between the GEMVs launch with PDL too."""
    return row_ranges("INFERX_PDL_ALL", ALL_ROWS)


@functools.cache
def _chain(rows: int) -> bool:
    return _all(rows) or in_ranges(rows, _chain_rows())


@functools.cache
def _all(rows: int) -> bool:
    return in_ranges(rows, _all_rows())


@functools.cache
def _attention_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_ATTENTION: the rows at which the decode kernel launches early behind QKV."""
    return row_ranges("INFERX_PDL_ATTENTION", ATTENTION_ROWS)


def attention_early(device: torch.device, rows: int) -> bool:
    """Whether, at `rows` rows of a decode-only step, the QKV GEMV lets the decode kernel
    launch early, which then loads the step's metadata (its context, the rotary's cos and sin)
    before its wait (its EARLY constexpr): INFERX_PDL_ATTENTION's rows, PDL on."""
    return pdl_enabled(device) and in_ranges(rows, _attention_rows())


@functools.cache
def _late_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_LATE: the rows at which a GEMV not triggering at its start triggers late."""
    return row_ranges("INFERX_PDL_LATE", LATE_ROWS)


@functools.cache
def _norm_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_NORM: the rows at which rms_norm launches early behind the GEMV before it."""
    return row_ranges("INFERX_PDL_NORM", NORM_ROWS)


def norm_early(device: torch.device, rows: int) -> bool:
    """Whether, at `rows` rows, the GEMMs that TritonOps.linear_parts runs (down_proj; o_proj
    where the split combine does not take it) let the next kernel launch early and
    rms_norm_kernel launches with PDL (loading its weight before its wait): INFERX_PDL_NORM's
    rows, PDL on. At up to 8 rows the norm after down_proj is the only rms_norm_kernel of a
    layer (the post-attention norm runs inside gate_up)."""
    return pdl_enabled(device) and in_ranges(rows, _norm_rows())


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode GEMVs on this device launch with PDL (read once per device)."""
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def gemv_launch(device: torch.device, rows: int, trigger: bool = False) -> dict[str, Any]:
    """A TMA GEMV launch's PDL arguments for `rows` rows of x: its PDL and TRIGGER constexprs
    (TRIGGER also where the caller asks: QKV before an early decode kernel), LATE where it does
    not trigger at its start and INFERX_PDL_LATE takes the rows, and Triton's launch_pdl option
    when PDL is on."""
    if not pdl_enabled(device):
        return {"PDL": False, "TRIGGER": False}
    args = {"PDL": True, "TRIGGER": trigger or _chain(rows), "launch_pdl": True}
    if not args["TRIGGER"] and in_ranges(rows, _late_rows()):
        args["LATE"] = True  # only then: the default variants stay as they were
    return args


def between_launch(
    device: torch.device, rows: int, width: int, norm: bool = False
) -> dict[str, Any]:
    """The PDL arguments of a kernel between the GEMVs (rms_norm_kernel, decode_kernel,
    decode_reduce_kernel) for a step of `rows` rows of a layer `width` wide (the norm's
    columns, the attention's heads x head dim): TRIGGER (the GEMV after it may launch early),
    and PDL (it launches early itself and waits) with Triton's launch_pdl where INFERX_PDL_ALL
    takes the rows and width <= ALL_MAX_WIDTH, or for the norm (`norm`) where INFERX_PDL_NORM
    takes them."""
    if not pdl_enabled(device):
        return {"PDL": False, "TRIGGER": False}
    if (_all(rows) and width <= ALL_MAX_WIDTH) or (norm and norm_early(device, rows)):
        return {"PDL": True, "TRIGGER": True, "launch_pdl": True}
    return {"PDL": False, "TRIGGER": True}
