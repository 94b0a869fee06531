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

And phases of a split-K GEMV's shape (programs // 4 groups of 4 K-slices), the question a norm
folded into the split GEMV's epilogue turns on:

- pdl+finish: a PDL launch a phase, then a one-program PDL launch that finishes every group
  (as the norm kernel after down_proj / o_proj sums their parts);
- pdl, last: a PDL launch a phase, each group finished by its last program to arrive (an
  acq_rel count a group).

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


@triton.jit
def split_phase_kernel(final_ptr, part_ptr, count_ptr, phase, groups, LAST: tl.constexpr,
                       PDL: tl.constexpr, TRIGGER: tl.constexpr):  # fmt: skip
    """One phase of a split-K GEMM's shape (grid: 4 x groups programs; program p is slice
    p % 4 of group p // 4): part[phase, p] = final[phase - 1, the next group] + 1. LAST: the
    group's last program to arrive (an acq_rel count a group) also finishes the group, as a
    norm after the GEMM would: final[phase, g] = the mean of its 4 parts; it resets the count."""
    pdl_start(PDL, TRIGGER)
    p = tl.program_id(0)
    g = p // 4
    prev = tl.load(final_ptr + (phase - 1) * groups + (g + 1) % groups)
    tl.store(part_ptr + phase * groups * 4 + p, prev + 1)
    if LAST:
        tl.debug_barrier()  # this program's store is done before it counts itself in
        arrived = tl.atomic_add(count_ptr + g, 1, sem="acq_rel", scope="gpu")
        if arrived == 3:
            parts = tl.load(part_ptr + phase * groups * 4 + g * 4 + tl.arange(0, 4))
            tl.store(final_ptr + phase * groups + g, tl.sum(parts) // 4)
            tl.store(count_ptr + g, 0)


@triton.jit
def finish_kernel(final_ptr, part_ptr, phase, groups, BLOCK: tl.constexpr, PDL: tl.constexpr,
                  TRIGGER: tl.constexpr):  # fmt: skip
    """The finish as a launch of its own (one program, as the norm after a split GEMV):
    final[phase, g] = the mean of group g's 4 parts, for every group."""
    pdl_start(PDL, TRIGGER)
    g = tl.arange(0, BLOCK)
    parts = tl.load(part_ptr + phase * groups * 4 + g[:, None] * 4 + tl.arange(0, 4)[None, :],
                    mask=g[:, None] < groups, other=0)  # fmt: skip
    tl.store(final_ptr + phase * groups + g, tl.sum(parts, axis=1) // 4, mask=g < groups)


def run_split(final: torch.Tensor, part: torch.Tensor, count: torch.Tensor, last: bool) -> None:
    """Phases 1..len(final) - 1 of split_phase_kernel (final [phases + 1, groups], row 0 the
    start; part [phases + 1, 4 x groups]; count [groups] zeros), with PDL where the GPU has it:
    each finished by its last-arriving programs (last) or by a finish_kernel launch after it."""
    on = pdl_enabled(final.device)
    extra = {"launch_pdl": True} if on else {}
    groups = final.shape[1]
    for phase in range(1, final.shape[0]):
        split_phase_kernel[(4 * groups,)](
            final, part, count, phase, groups, LAST=last, PDL=on, TRIGGER=on, **extra
        )
        if not last:
            block = max(2, triton.next_power_of_2(groups))
            finish_kernel[(1,)](final, part, phase, groups, BLOCK=block, PDL=on, TRIGGER=on,
                                **extra)  # fmt: skip


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
    print(f"{'programs':>8} {'launches':>9} {'pdl':>7} {'barrier':>8} {'pdl+finish':>11} "
          f"{'pdl, last':>10}  µs a phase")  # fmt: skip
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
        groups = max(1, programs // 4)
        final = torch.zeros(args.phases + 1, groups, dtype=torch.int32, device=dev)
        part = torch.zeros(args.phases + 1, 4 * groups, dtype=torch.int32, device=dev)
        count = torch.zeros(groups, dtype=torch.int32, device=dev)
        for name, last in (("pdl+finish", False), ("pdl, last", True)):
            final[1:] = -1
            run_split(final, part, count, last)
            torch.cuda.synchronize()
            if not bool((final[-1] == args.phases).all()):
                raise SystemExit(f"{name} at {groups} groups: wrong result {final[-1].tolist()}")
            call = partial(run_split, final, part, count, last)
            row[name] = graph_us(lambda _, call=call: call(), [final]) / args.phases
        rows.append(row)
        print(f"{programs:>8} {row['launches']:>9.2f} {row['pdl']:>7.2f} {row['barrier']:>8.2f} "
              f"{row['pdl+finish']:>11.2f} {row['pdl, last']:>10.2f}")  # fmt: skip
    if args.json:
        doc = {"commit": commit_id(), "device": torch.cuda.get_device_name(dev),
               "phases": args.phases, "rows": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
