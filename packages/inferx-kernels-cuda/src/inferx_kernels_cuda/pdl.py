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
(3B and 8B; the graph's launch gaps 127 -> ~70 µs a step). Two variants are not the default:
- GEMVs letting the next kernel launch early too: slower at batch 1-2, faster at 8 and 64.
  INFERX_PDL_CHAIN=1 turns it on at every row count, or at row ranges ("5-8,33-64"), for A/B.
- Each GEMV program prefetching its first weight tiles into L2 before its wait: slower
  everywhere, removed.
PDL on the small kernels themselves, behind cuBLAS GEMMs, measured slower in session 5: its
edges cost more than the launches they hid.

On for Hopper or newer with a Triton that has launch_pdl; never under TRITON_INTERPRET.
INFERX_PDL=0 turns it off (A/B runs). INFERX_PDL_ALL=1 (not yet measured) launches the kernels
between the GEMVs with PDL too, each waiting at its start, and has every kernel of the chain
trigger right after its wait (at most one kernel ahead), GEMVs included.
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


__all__ = ["between_launch", "gemv_launch", "pdl_enabled", "pdl_start"]


@triton.jit
def pdl_start(PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """A kernel's PDL prologue: with PDL (it was launched early) wait until the kernel ahead
    has finished and its writes are visible; then with TRIGGER let the next kernel launch. The
    wait comes first, so at most one kernel runs ahead."""
    if PDL:
        gdc_wait()
    if TRIGGER:
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


def _row_ranges(name: str) -> tuple[tuple[int, int], ...]:
    """A row-range setting: "0" (the default) or "" none, "1" every row count, else ranges
    "LO-HI" (or "N") joined by commas."""
    value = os.environ.get(name, "0").strip()
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


@functools.cache
def _chain_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_CHAIN: the rows of x at which a GEMV lets the next kernel launch early."""
    return _row_ranges("INFERX_PDL_CHAIN")


@functools.cache
def _all_rows() -> tuple[tuple[int, int], ...]:
    """INFERX_PDL_ALL: the rows at which the kernels between the GEMVs launch with PDL too."""
    return _row_ranges("INFERX_PDL_ALL")


@functools.cache
def _chain(rows: int) -> bool:
    return _all(rows) or any(lo <= rows <= hi for lo, hi in _chain_rows())


@functools.cache
def _all(rows: int) -> bool:
    return any(lo <= rows <= hi for lo, hi in _all_rows())


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode GEMVs on this device launch with PDL (read once per device)."""
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


def gemv_launch(device: torch.device, rows: int) -> dict[str, Any]:
    """A TMA GEMV launch's PDL arguments for `rows` rows of x: its PDL and TRIGGER constexprs,
    and Triton's launch_pdl option when PDL is on."""
    if pdl_enabled(device):
        return {"PDL": True, "TRIGGER": _chain(rows), "launch_pdl": True}
    return {"PDL": False, "TRIGGER": False}


def between_launch(device: torch.device, rows: int) -> dict[str, Any]:
    """The PDL arguments of a kernel between the GEMVs (rms_norm_kernel, decode_kernel,
    decode_reduce_kernel) for a step of `rows` rows: TRIGGER (the GEMV after it may launch
    early), and where INFERX_PDL_ALL takes the rows PDL (it launches early itself and waits)
    with Triton's launch_pdl."""
    if not pdl_enabled(device):
        return {"PDL": False, "TRIGGER": False}
    if _all(rows):
        return {"PDL": True, "TRIGGER": True, "launch_pdl": True}
    return {"PDL": False, "TRIGGER": True}
