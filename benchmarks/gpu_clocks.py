"""The GPU's clocks and power over a run, sampled by nvidia-smi beside it.

    with GpuClocks("clocks.csv") as clocks:   # nvidia-smi -lms 100 writes there meanwhile
        run_the_benchmark()
    clocks.summary  # {"sm_mhz_median": ..., "power_w_mean": ..., "power_capped": ..., ...}

An H200 held at its 700 W limit lowers its SM clock (nvidia-smi's clock-event reason 0x4, the
software power cap): compute-bound steps then run at that clock, not at the 1980 MHz boost, so a
benchmark's figure depends on the power it draws as well as on its kernels. Every summary counts
only busy samples (utilization >= 50%). Without nvidia-smi (the CPU VM) the summary says so
(`unavailable`, not `error`: the figure itself stands).

The CSV is nvidia-smi's own, one line a sample; its first line, written here, is the offset of
the wall clock from time.monotonic() (the step trace's clock), so samples can be matched to
steps (as the deleted step_trace.py did: `git show 0fe8913^:benchmarks/step_trace.py`).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

QUERY = (
    "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,"
    "clocks_throttle_reasons.active,utilization.gpu"
)
POWER_CAP = 0x4  # clocks_event_reasons: SW power cap
THERMAL = 0x20 | 0x40 | 0x8  # SW thermal slowdown, HW thermal slowdown, HW slowdown
BUSY_UTIL = 50.0


@dataclass(frozen=True)
class Sample:
    monotonic: float  # time.monotonic() of the sample, through the file's offset
    sm_mhz: float
    mem_mhz: float
    power_w: float
    temp_c: float
    reasons: int
    util: float


def _number(text: str) -> float:
    """'1980 MHz' / '695.77 W' / '100 %' / '53' -> the number; '[N/A]' -> nan."""
    head = text.strip().split(" ")[0]
    try:
        return float(head)
    except ValueError:
        return float("nan")


def parse(text: str) -> list[Sample]:
    """The samples of a GpuClocks CSV: an `offset <seconds>` line (wall minus monotonic), then
    nvidia-smi's `--format=csv,noheader` lines of QUERY. Lines that do not parse are skipped (a
    partial last line when nvidia-smi was stopped)."""
    offset = 0.0
    samples = []
    for line in text.splitlines():
        if line.startswith("offset "):
            offset = float(line.split()[1])
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 7:
            continue
        try:
            wall = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            reasons = int(parts[5], 16)
        except ValueError:
            continue
        sm, mem, power, temp, util = (_number(parts[i]) for i in (1, 2, 3, 4, 6))
        samples.append(Sample(wall - offset, sm, mem, power, temp, reasons, util))
    return samples


def summarize(samples: list[Sample], start: float = -1e18, end: float = 1e18) -> dict[str, Any]:
    """Clocks and power over the busy samples between start and end (monotonic seconds):
    median and 10th percentile SM clock, mean power, the share power-capped or thermally
    slowed, and the energy of the whole window (every sample, mean power x its span)."""
    window = [s for s in samples if start <= s.monotonic <= end]
    busy = [s for s in window if s.util >= BUSY_UTIL]
    if not busy:
        return {"samples": len(window), "busy_samples": 0}
    sm = sorted(s.sm_mhz for s in busy)
    span = window[-1].monotonic - window[0].monotonic if len(window) > 1 else 0.0
    return {
        "samples": len(window),
        "busy_samples": len(busy),
        "sm_mhz_median": statistics.median(sm),
        "sm_mhz_p10": sm[len(sm) // 10],
        "mem_mhz_median": statistics.median(s.mem_mhz for s in busy),
        "power_w_mean": statistics.fmean(s.power_w for s in busy),
        "power_w_max": max(s.power_w for s in busy),
        "temp_c_max": max(s.temp_c for s in busy),
        "power_capped": sum(bool(s.reasons & POWER_CAP) for s in busy) / len(busy),
        "thermal": sum(bool(s.reasons & THERMAL) for s in busy) / len(busy),
        "energy_j": statistics.fmean(s.power_w for s in window) * span,
    }


def describe(summary: dict[str, Any]) -> str:
    """One line for a log: 'SM 1740 MHz median (p10 1485), 694 W, power-capped 98%'."""
    if "unavailable" in summary:
        return summary["unavailable"]
    if not summary.get("busy_samples"):
        return f"no busy samples of {summary.get('samples', 0)}"
    return (
        f"SM {summary['sm_mhz_median']:.0f} MHz median (p10 {summary['sm_mhz_p10']:.0f}), "
        f"{summary['power_w_mean']:.0f} W, power-capped {100 * summary['power_capped']:.0f}%"
    )


class GpuClocks:
    """Runs `nvidia-smi --query-gpu=QUERY -lms interval_ms` into `path` while the block runs;
    then `summary` (summarize over the block) and `samples`. `command` replaces nvidia-smi
    (tests). Never raises for a missing nvidia-smi: the summary says it was unavailable."""

    def __init__(
        self,
        path: str | Path,
        interval_ms: int = 100,
        gpu: int = 0,
        command: list[str] | None = None,
    ) -> None:
        self.path = Path(path)
        self.command = command or [
            "nvidia-smi",
            f"--query-gpu={QUERY}",
            "--format=csv,noheader",
            f"-lms={interval_ms}",
            f"--id={gpu}",
        ]
        self.proc: subprocess.Popen[bytes] | None = None
        self.samples: list[Sample] = []
        self.summary: dict[str, Any] = {}
        self._start = 0.0

    def __enter__(self) -> GpuClocks:
        self._start = time.monotonic()
        if shutil.which(self.command[0]) is None:
            self.summary = {"unavailable": f"{self.command[0]} not found: no clocks sampled"}
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.write(f"offset {time.time() - time.monotonic():.6f}\n")
        with open(self.path, "ab") as f:
            self.proc = subprocess.Popen(self.command, stdout=f, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc: object) -> None:
        end = time.monotonic()
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.samples = parse(self.path.read_text(errors="replace"))
        self.summary = summarize(self.samples, self._start, end)
