"""Read INFERX_STEP_TRACE files: a serving run's prompt phases and the decode steps between them.

    python benchmarks/step_trace.py FILE [FILE ...] [--long 3] [--lookback-ms 50] [--json OUT]

The engine child (server.engine_process) writes a line per add, per step and per garbage
collection (engine_process.StepTrace) when the server runs with INFERX_STEP_TRACE=FILE. A step
longer than --long times the run's median step is a prompt step, and consecutive prompt steps
make a prompt phase: a wave's prefill at 64 or 256 clients. For each phase: when it started, its
steps (ms, and the running / waiting counts each left), its length, and the adds the child read
from --lookback-ms before it to its end, with when the HTTP side had handed them over (ms from
the phase's start): how the wave reached the engine. Between phases: the decode steps' count and
mean. Session 34 read wave 2 of 8B c=64 this way (docs/BENCHMARKS.md).

--clocks CSV [CSV ...]: the GPU's clocks sampled over the same run (gpu_clocks.GpuClocks;
h200_table.py writes one per serve run into h200-table-logs/): each phase's, and its decode
steps', median SM clock, mean power and power-capped share.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpu_clocks import Sample, parse, summarize


@dataclass
class Step:
    start: float  # s (time.monotonic of the child)
    ms: float
    outputs: int
    running: int
    waiting: int


@dataclass
class Phase:
    start: float
    steps: list[Step]
    adds: int = 0
    handed_ms: tuple[float, float] | None = None  # first and last hand-over, from the start
    decodes_after: int = 0  # decode steps from this phase's end to the next phase
    decode_ms_after: float = 0.0  # their mean
    clocks: dict[str, Any] = field(default_factory=dict)  # gpu_clocks.summarize over the phase
    decode_clocks: dict[str, Any] = field(default_factory=dict)  # over the decode steps after
    ms: float = field(init=False)

    def __post_init__(self) -> None:
        last = self.steps[-1]
        self.ms = (last.start - self.start) * 1e3 + last.ms


def read(path: Path) -> tuple[list[Step], list[tuple[float, float]]]:
    """Steps in start order, and each add's (taken, handed) times in s."""
    steps, adds = [], []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "step":
            t, ms, outputs, running, waiting = float(parts[0]), float(parts[2]), *parts[3:6]
            steps.append(Step(t, ms, int(outputs), int(running), int(waiting)))
        elif len(parts) >= 4 and parts[1] == "add":
            taken = float(parts[0])
            adds.append((taken, taken - float(parts[3]) / 1e3))
    steps.sort(key=lambda s: s.start)
    return steps, adds


def phases(
    steps: list[Step], adds: list[tuple[float, float]], long: float = 3.0, lookback_ms: float = 50
) -> list[Phase]:
    """The run's prompt phases (runs of steps over `long` x the median step), with the adds
    taken from lookback_ms before each to its end and the decode steps after each."""
    if not steps:
        return []
    cut = long * statistics.median(s.ms for s in steps)
    # Alternating runs of prompt steps and decode steps, in start order.
    runs = [(slow, list(run)) for slow, run in itertools.groupby(steps, lambda s: s.ms > cut)]
    found: list[Phase] = []
    for i, (slow, run) in enumerate(runs):
        if not slow:
            continue
        p = Phase(run[0].start, run)
        if i + 1 < len(runs):  # the decode steps up to the next phase
            p.decodes_after = len(runs[i + 1][1])
            p.decode_ms_after = statistics.fmean(s.ms for s in runs[i + 1][1])
        lo, hi = p.start - lookback_ms / 1e3, p.start + p.ms / 1e3
        handed = [h for taken, h in adds if lo <= taken <= hi]
        p.adds = len(handed)
        if handed:
            p.handed_ms = ((min(handed) - p.start) * 1e3, (max(handed) - p.start) * 1e3)
        found.append(p)
    return found


def add_clocks(found: list[Phase], samples: list[Sample], steps: list[Step]) -> None:
    """Each phase's clocks, and those of the decode steps after it (to the next phase's start,
    or the run's last step)."""
    end = steps[-1].start + steps[-1].ms / 1e3 if steps else 0.0
    for i, p in enumerate(found):
        stop = p.start + p.ms / 1e3
        p.clocks = summarize(samples, p.start, stop)
        if p.decodes_after:
            p.decode_clocks = summarize(
                samples, stop, found[i + 1].start if i + 1 < len(found) else end
            )


def _clock_text(c: dict[str, Any]) -> str:
    if not c.get("busy_samples"):
        return ""
    return (
        f" [GPU {c['sm_mhz_median']:.0f} MHz, {c['power_w_mean']:.0f} W, capped "
        f"{100 * c['power_capped']:.0f}%, {c['busy_samples']} samples]"
    )


def describe(found: list[Phase]) -> str:
    if not found:
        return "no prompt phase"
    t0 = found[0].start
    lines = []
    for i, p in enumerate(found, 1):
        steps = " ".join(f"{s.ms:.1f}" for s in p.steps)
        left = " ".join(f"{s.running}/{s.waiting}" for s in p.steps)
        handed = f", handed {p.handed_ms[0]:+.1f}..{p.handed_ms[1]:+.1f} ms" if p.handed_ms else ""
        lines.append(
            f"phase {i} at {p.start - t0:.3f} s: {len(p.steps)} steps of {steps} ms = "
            f"{p.ms:.0f} ms (running/waiting after each: {left}); {p.adds} adds{handed}"
            + _clock_text(p.clocks)
        )
        if p.decodes_after:
            lines.append(
                f"  then {p.decodes_after} decode steps, {p.decode_ms_after:.2f} ms mean"
                + _clock_text(p.decode_clocks)
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--long", type=float, default=3.0, help="x the median step: a prompt step")
    ap.add_argument("--lookback-ms", type=float, default=50.0)
    ap.add_argument("--clocks", nargs="*", type=Path, default=[], help="GpuClocks CSVs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    samples = sorted(
        (x for f in args.clocks for x in parse(f.read_text())), key=lambda x: x.monotonic
    )
    out = {}
    for path in args.files:
        steps, adds = read(path)
        found = phases(steps, adds, args.long, args.lookback_ms)
        if samples:
            add_clocks(found, samples, steps)
        print(f"== {path}\n{describe(found)}")
        out[str(path)] = [asdict(p) for p in found]
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
