"""What one kernel boundary costs a chain of dependent phases, against a grid barrier inside one
persistent launch: the question a per-layer persistent decode kernel turns on.

    python benchmarks/bench_grid_barrier.py [--programs 4,16,132] [--phases 64] [--json OUT]

A small-batch decode layer is a chain of latency-bound kernels (norm, QKV, attention, o_proj:
~18 µs a layer for ~4.4 µs of bytes at 3B batch 1, BENCHMARKS.md session 21), each waiting for
the one before. Each phase here does almost nothing: program p reads what program p + 1 wrote
in the phase before and writes its own slot, so every phase depends on the whole grid's last.
Inside one CUDA graph (bench_gemv.graph_us: the whole chain captured GRAPH_CALLS times, median of
10 replays), µs a phase for:

- launches: a launch a phase;
- pdl: a launch a phase with programmatic dependent launch (each triggers at its start and
  waits for the one before, as the decode GEMVs do: inferx_kernels_cuda.pdl);
- barrier: one launch of all phases, the programs meeting at a grid barrier (an atomic count,
  release on arrival, acquire while spinning) between phases.

Session 12 measured a barrier 0.5-0.9 µs faster than a launch boundary, before PDL. The results
are checked (the last phase's slots hold the phase count) before they are timed.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_gemv import graph_us
from commit_id import commit_id

from inferx_kernels_cuda.pdl import pdl_enabled, pdl_start


@triton.jit
def _phase(buf_ptr, phase, p, programs):
    """Phase `phase` of program p: its slot = the next program's slot of the phase before + 1."""
    prev = tl.load(buf_ptr + (phase - 1) * programs + (p + 1) % programs)
    tl.store(buf_ptr + phase * programs + p, prev + 1)


@triton.jit
def phase_kernel(buf_ptr, phase, programs, PDL: tl.constexpr, TRIGGER: tl.constexpr):
    """One phase as its own launch (grid: programs)."""
    pdl_start(PDL, TRIGGER)
    _phase(buf_ptr, phase, tl.program_id(0), programs)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid has arrived `target` times in all: each program's writes
    before it are visible to every program after it. The grid must be resident at once."""
    tl.debug_barrier()  # this program's threads are done with the phase
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def barrier_kernel(buf_ptr, counter_ptr, phases, programs):
    """Phases 1..phases in one launch (grid: programs, all resident), a grid barrier between
    them; counter_ptr starts at 0."""
    p = tl.program_id(0)
    for phase in range(1, phases + 1):
        _phase(buf_ptr, phase, p, programs)
        if phase < phases:
            _grid_barrier(counter_ptr, programs * phase)


def run_launches(buf: torch.Tensor, programs: int, pdl: bool) -> None:
    """Phases 1..len(buf) - 1 over buf [phases + 1, programs] (row 0 the start), a launch each."""
    on = pdl and pdl_enabled(buf.device)
    extra = {"launch_pdl": True} if on else {}
    for phase in range(1, buf.shape[0]):
        phase_kernel[(programs,)](buf, phase, programs, PDL=on, TRIGGER=on, **extra)


def run_barrier(buf: torch.Tensor, counter: torch.Tensor, programs: int) -> None:
    """The same phases in one barrier_kernel launch (counter reset first)."""
    counter.zero_()
    barrier_kernel[(programs,)](buf, counter, buf.shape[0] - 1, programs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default="4,16,132")
    ap.add_argument("--phases", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    print(f"{'programs':>8} {'launches':>9} {'pdl':>7} {'barrier':>8}  µs a phase")
    for programs in (int(p) for p in args.programs.split(",")):
        if programs > sms:
            raise SystemExit(f"--programs {programs}: the barrier needs them all resident ({sms})")
        buf = torch.zeros(args.phases + 1, programs, dtype=torch.int32, device=dev)
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        row = {"programs": programs}
        for name, call in (
            ("launches", partial(run_launches, buf, programs, False)),
            ("pdl", partial(run_launches, buf, programs, True)),
            ("barrier", partial(run_barrier, buf, counter, programs)),
        ):
            buf[1:] = -1
            call()
            torch.cuda.synchronize()
            if not bool((buf[-1] == args.phases).all()):
                raise SystemExit(f"{name} at {programs} programs: wrong result {buf[-1].tolist()}")
            row[name] = graph_us(lambda _, call=call: call(), [buf]) / args.phases
        rows.append(row)
        print(f"{programs:>8} {row['launches']:>9.2f} {row['pdl']:>7.2f} {row['barrier']:>8.2f}")
    if args.json:
        doc = {"commit": commit_id(), "device": torch.cuda.get_device_name(dev),
               "phases": args.phases, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
