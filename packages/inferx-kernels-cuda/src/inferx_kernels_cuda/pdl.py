"""Programmatic dependent launch (PDL) of the decode GEMVs, their first weight tiles prefetched.

A small-batch decode step is a chain of short kernels, and each TMA GEMV spends its first
microseconds being launched and waiting for its first weight tiles from DRAM. Launched with
PDL, a GEMV (tma_gemv_kernel, tma_norm_gemv_kernel) may start while the kernel ahead of it
still runs: its programs ask L2 for their first PREFETCH_TILES weight tiles (no kernel of a
step writes weights), wait in `gdc_wait` until the kernel ahead has finished and its writes
are visible, and then run as before, their first tiles coming from L2.

The kernel ahead lets it start early by calling `gdc_launch_dependents` (every program of it
must have called it, or exited): rms_norm_kernel, decode_kernel and decode_reduce_kernel at
their start (their TRIGGER constexpr), a GEMV right after its own wait, so at most one GEMV
runs ahead. The trigger does nothing when the next kernel was launched without PDL. All other
kernels launch as before: PDL on the small kernels themselves measured slower in session 5
(BENCHMARKS.md), its edges costing more than the launches they hid.

Off unless the environment sets INFERX_PDL=1 (until measured), and never under
TRITON_INTERPRET, on GPUs before Hopper or with a Triton without launch_pdl.
INFERX_PDL_PREFETCH: K tiles each GEMV program prefetches (a power of two, default 4; 0 none).
INFERX_PDL_MIN_ROWS: the fewest rows of x a GEMV launches with PDL at (default 1).
INFERX_PDL_CHAIN=0: GEMVs do not let the next GEMV launch early (they trigger by exiting).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never traced (PDL is off)

    @triton.jit
    def gdc_wait() -> None:
        pass

    @triton.jit
    def gdc_launch_dependents() -> None:
        pass


__all__ = ["gdc_launch_dependents", "gdc_wait", "gemv_launch", "pdl_enabled", "trigger"]


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
    if os.environ.get("INFERX_PDL", "0") != "1":
        return False
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    return _triton_has_pdl()


def pdl_enabled(device: torch.device) -> bool:
    """Whether the decode GEMVs on this device launch with PDL (read once per device)."""
    if device.type != "cuda":
        return False
    return _enabled(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _prefetch_tiles() -> int:
    value = os.environ.get("INFERX_PDL_PREFETCH", "4")
    tiles = int(value) if value.isdigit() else -1
    if tiles < 0 or tiles & (tiles - 1) or tiles > 64:
        raise ValueError(f"INFERX_PDL_PREFETCH: a power of two up to 64 or 0, got {value!r}")
    return tiles


@functools.cache
def _min_rows() -> int:
    value = os.environ.get("INFERX_PDL_MIN_ROWS", "1")
    if not value.isdigit():
        raise ValueError(f"INFERX_PDL_MIN_ROWS: a row count, got {value!r}")
    return int(value)


@functools.cache
def _chain() -> bool:
    return os.environ.get("INFERX_PDL_CHAIN", "1") != "0"


def gemv_launch(device: torch.device, element_size: int, rows: int) -> dict[str, Any]:
    """A TMA GEMV launch's PDL arguments for `rows` rows of x: its PDL, PREFETCH_TILES, LINE
    (elements a 128-byte line) and TRIGGER constexprs, and Triton's launch_pdl option when PDL
    is on."""
    line = 128 // element_size
    if pdl_enabled(device) and rows >= _min_rows():
        return {"PDL": True, "PREFETCH_TILES": _prefetch_tiles(), "LINE": line,
                "TRIGGER": _chain(), "launch_pdl": True}  # fmt: skip
    return {"PDL": False, "PREFETCH_TILES": 0, "LINE": line, "TRIGGER": False}


def trigger(device: torch.device) -> bool:
    """A kernel ahead of a GEMV: whether it calls gdc_launch_dependents (its TRIGGER)."""
    return pdl_enabled(device)
