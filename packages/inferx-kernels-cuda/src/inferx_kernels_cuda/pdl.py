"""Programmatic dependent launch (PDL) for the small Triton kernels between the decode GEMMs.

A kernel launched with PDL may start before the kernel ahead of it in the stream has finished:
its programs are launched once every program of that kernel has exited (or called
`gdc_launch_dependents`), run what they can, and block in `gdc_wait` until that kernel's
writes are visible. A decode step is ~400 kernels of a few microseconds each, so each launch's
gap is a visible part of it (docs/BENCHMARKS.md).

The contract each kernel with a `PDL` constexpr keeps: only loads of data no kernel of the step
writes (weights) before `gdc_wait()`, everything else after it. Every earlier kernel has then
finished too: the one ahead waited for its own predecessor before it could finish. Kernels
without PDL (cuBLAS, torch's) wait as before. No kernel here calls `gdc_launch_dependents`
early: on the H200 that let the next kernel's programs sit waiting on SMs the running kernel
needed, and the step got slower (batch 64: 3.07 -> 3.17 ms).

Off under TRITON_INTERPRET, on GPUs before Hopper, with a Triton that lacks it, and when the
environment sets INFERX_PDL=0 (for A/B runs).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without grid dependency control: never called (PDL is off)

    @triton.jit
    def gdc_wait() -> None:
        pass


__all__ = ["gdc_wait", "launch_options", "pdl_enabled"]


def _triton_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    import triton.language.extra.cuda as cuda_extra

    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and hasattr(cuda_extra, "gdc_wait")


@functools.cache
def _enabled(device_type: str, index: int) -> bool:
    if device_type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if os.environ.get("INFERX_PDL", "1") == "0":
        return False
    if torch.cuda.get_device_capability(index) < (9, 0):
        return False
    return _triton_has_pdl()


def pdl_enabled(device: torch.device | str) -> bool:
    """Whether kernels on this device launch with PDL."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _enabled(device.type, index)


def launch_options(device: torch.device | str) -> dict[str, Any]:
    """The keyword arguments that turn PDL on for one launch: the kernel's PDL constexpr and
    Triton's launch_pdl option (only passed where Triton knows it)."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
