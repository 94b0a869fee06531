"""Compile Triton kernels on worker threads while start-up walks its step shapes.

On a fresh machine (empty Triton cache) start-up spent most of its time compiling Triton
kernel variants one after another, each where a warm-up forward first launched it. Triton's
compiler releases the GIL for much of its work, and ptxas runs as a process of its own, so
variants compile side by side on threads.

`compiles_in_background(threads)` is a dry run: inside it, launching any Triton kernel (any
`triton.jit` function, ours or a plugin's) submits the compile of that variant to a thread
pool and launches nothing, so the outputs of a forward pass run inside are garbage. Leaving
it waits for every compile (and raises the first error). The real forward passes that follow
find the variants in Triton's caches. A variant the dry run missed still compiles, at its
first launch, as before.

A worker also readies each variant for its first launch (`CompiledKernel._init_handles`):
Triton loads the binary and, once per argument signature, builds a C launcher with the host's
C compiler. Left to the first launch, those builds ran one after another and were most of the
warm-up's time on an empty cache (`benchmarks/cold_start.py --profile-phase warm_up`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch


def _spec(value: Any, specialised: bool = True) -> Any:
    """What Triton specialises a launch argument on, or finer: a tensor's dtype and 16-byte
    alignment; a host tensor descriptor's dtype, block, shape, strides and alignment (never
    its repr, which would print the tensor); a scalar's value (finer than Triton's "1 or a
    multiple of 16" for ints, and exact for constexprs passed positionally) unless the kernel
    does not specialise on it (`specialised` False: any int is one variant); anything else by
    its repr."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ("tensor", str(value.dtype), value.data_ptr() % 16 == 0)
    if hasattr(value, "base") and hasattr(value, "block_shape"):  # TensorDescriptor
        base = value.base
        return ("desc", str(base.dtype), tuple(value.block_shape), tuple(value.shape),
                tuple(value.strides), base.data_ptr() % 16 == 0)  # fmt: skip
    if isinstance(value, int) and not isinstance(value, bool) and not specialised:
        return ("int",)
    if isinstance(value, bool | int | float | str) or value is None:
        return (type(value).__name__, value)
    return ("other", repr(value))


@dataclass(frozen=True)
class Compile:
    """One variant's compile on a worker: the kernel's name, when it began (seconds after the
    dry run began) and how long it took (the compile and the readying for launch)."""

    kernel: str
    began_s: float
    seconds: float


def summarize(compiles: list[Compile], wall_s: float, longest: int = 5) -> dict[str, Any]:
    """What a dry run's compiles cost: how many, the dry run's wall time (wall_s, the caller's
    clock from its start to the wait's end), the compiles' summed time (summed / wall: how many
    ran side by side on average) and the longest ones, [name, seconds]."""
    ranked = sorted(compiles, key=lambda c: c.seconds, reverse=True)[:longest]
    return {
        "variants": len(compiles),
        "wall_s": round(wall_s, 3),
        "summed_s": round(sum(c.seconds for c in compiles), 3),
        "longest": [[c.kernel, round(c.seconds, 3)] for c in ranked],
    }


def _compile_and_ready(
    original: Any, fn: Any, args: Any, grid: Any, kwargs: Any, t0: float, done: list[Compile]
) -> Any:
    """The worker's part: compile the variant (Triton's own run, warmup=True) and ready it for
    its first launch, where this Triton has the hook; record how long that took in done."""
    began = time.perf_counter()
    kernel = original(fn, *args, grid=grid, warmup=True, **kwargs)
    ready = getattr(kernel, "_init_handles", None)
    if callable(ready):
        ready()
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
    done.append(Compile(name, began - t0, time.perf_counter() - began))  # list.append: atomic
    return kernel


def _unspecialised(fn: Any) -> set[str]:
    """Names of the arguments a triton.jit function does not specialise on (do_not_specialize)."""
    return {p.name for p in getattr(fn, "params", ()) if getattr(p, "do_not_specialize", False)}


@contextlib.contextmanager
def compiles_in_background(threads: int) -> Iterator[list[Compile]]:
    """Dry-run Triton launches: compile (and ready) each distinct variant on one of `threads`
    workers and launch nothing; wait for them on exit. Yields the list the workers record each
    compile in (complete once the block is left). A no-op without Triton or with threads < 2."""
    done: list[Compile] = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        JITFunction = None  # noqa: N806
    if JITFunction is None or threads < 2:
        yield done
        return
    t0 = time.perf_counter()
    original = JITFunction.run
    init: Any = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()  # workers compile for the caller's device

        def init() -> None:
            torch.cuda.set_device(device)

    pool = ThreadPoolExecutor(threads, thread_name_prefix="triton-compile", initializer=init)
    futures: dict[Any, Future] = {}  # by variant: each distinct one is submitted once
    lock = threading.Lock()

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        loose = _unspecialised(self)
        names = [p.name for p in getattr(self, "params", ())]
        positional = tuple(
            _spec(a, i >= len(names) or names[i] not in loose) for i, a in enumerate(args)
        )
        key = (id(self), positional, tuple(sorted(
            (k, _spec(v, k not in loose)) for k, v in kwargs.items())))  # fmt: skip
        with lock:
            if key not in futures:
                futures[key] = pool.submit(
                    _compile_and_ready, original, self, args, grid, kwargs, t0, done
                )
        return None

    JITFunction.run = run
    try:
        yield done
    finally:
        JITFunction.run = original
        try:
            for future in futures.values():
                future.result()
        finally:
            pool.shutdown(wait=True)
