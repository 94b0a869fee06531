"""Micro-benchmark: CPU cost of ContinuousScheduler.schedule() + update() per step, no model.

    python benchmarks/bench_scheduler.py [--steps 1000] [--json PATH]

Cases (block size 16, plenty of KV blocks, fake sampled tokens):
- decode: 256 sequences with 512-token prompts, all decoding;
- decode+prefix: the same with the prefix cache on (prompts share a 256-token head);
- mixed: 256 running with the prefix cache on; finished requests are replaced by new 512-token
  prompts, so chunked prefill runs beside the decodes in most steps.
The prefill that brings the 256 sequences to decoding is not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

from commit_id import commit_id

from inferx_core.config import SchedulerSection
from inferx_core.kv_manager import PagedKVManager
from inferx_core.scheduler import ContinuousScheduler
from inferx_core.sequence import SamplingParams, Sequence

BLOCK = 16
RUNNING = 256
PROMPT = 512
MAX_LEN = 4096


def prompt(rng: random.Random, head: list[int]) -> list[int]:
    return head + [rng.randrange(3, 32000) for _ in range(PROMPT - len(head))]


def step(sched: ContinuousScheduler, token: int) -> tuple[int, int]:
    """One step; returns (nanoseconds in the scheduler, tokens scheduled)."""
    t0 = time.perf_counter_ns()
    out = sched.schedule()
    t1 = time.perf_counter_ns()
    sampled = [token] * sum(1 for c in out.chunks if c.sample)  # the executor's part: not timed
    t2 = time.perf_counter_ns()
    sched.update(out, sampled)
    t3 = time.perf_counter_ns()
    return t1 - t0 + t3 - t2, out.num_tokens


def run_case(name: str, steps: int, prefix_cache: bool, mixed: bool) -> dict:
    rng = random.Random(0)
    config = SchedulerSection(max_running=RUNNING, prefix_cache=prefix_cache)
    num_blocks = RUNNING * (MAX_LEN // BLOCK) + 1
    sched = ContinuousScheduler(config, PagedKVManager(num_blocks, BLOCK, prefix_cache), MAX_LEN)
    head = [rng.randrange(3, 32000) for _ in range(PROMPT // 2)] if prefix_cache else []

    def new_request() -> Sequence:
        # Mixed: lengths spread so that a request or two finishes in most steps.
        max_tokens = rng.randint(64, 1024) if mixed else steps + 100
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return Sequence(prompt(rng, head), params)

    for _ in range(RUNNING):
        sched.add(new_request())
    while any(s.num_computed < s.num_prompt for s in sched.running) or sched.waiting:
        step(sched, 7)  # prefill everything first, untimed
    for i in range(20):  # warm up
        step(sched, 3 + i)

    times, tokens = [], []
    for i in range(steps):
        ns, n = step(sched, 3 + i % 1000)
        times.append(ns / 1000)
        tokens.append(n)
        if mixed:
            for _ in range(RUNNING - len(sched.running) - len(sched.waiting)):
                sched.add(new_request())
    times.sort()
    return {
        "case": name,
        "steps": steps,
        "mean_us": round(statistics.fmean(times), 1),
        "p50_us": round(times[len(times) // 2], 1),
        "p99_us": round(times[min(len(times) - 1, int(len(times) * 0.99))], 1),
        "tokens_per_step": round(statistics.fmean(tokens), 1),
        "preemptions": sched.stats().preemptions,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()

    cases = [
        run_case("decode", args.steps, prefix_cache=False, mixed=False),
        run_case("decode+prefix", args.steps, prefix_cache=True, mixed=False),
        run_case("mixed", args.steps, prefix_cache=True, mixed=True),
    ]
    print(f"{'case':<15}{'µs/step mean':>14}{'p50':>10}{'p99':>10}{'tokens/step':>13}")
    for c in cases:
        print(
            f"{c['case']:<15}{c['mean_us']:>14.1f}{c['p50_us']:>10.1f}{c['p99_us']:>10.1f}"
            f"{c['tokens_per_step']:>13.1f}"
        )
    if args.json:
        report = {
            "benchmark": "scheduler",
            "commit": commit_id(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "running": RUNNING,
            "prompt": PROMPT,
            "block_size": BLOCK,
            "cases": cases,
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
