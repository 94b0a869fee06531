"""Where decode steps spend their time, and how long the GPU sits idle between them.

    python benchmarks/profile_decode.py --preset qwen2.5-3b-instruct --tokenizer DIR \
        --backend triton --batch 1,64 [--steps 64] [--prompt-len 128] [--eager] [--json OUT.json]

Per batch size: `batch` requests of a `--prompt-len`-token prompt (128) are prefilled, then
`--steps` decode steps run under torch.profiler (CPU and CUDA activity). From the trace's GPU
records (kernels, copies, memsets) it prints:

- the wall time per step (host clock, engine.step() to engine.step()), the steps over 1.2 x
  the median, and the garbage collector's passes during the profiled steps,
- the GPU idle fraction: 1 - (union of GPU activity) / (first GPU start to last GPU end) over
  the profiled steps, the figure issue 4 wants under 5%; the gaps of 50 µs or more by the GPU
  activities around them, and the host events (torch ops, CUDA calls) they overlap,
- the GPU time per step by kind of kernel (GEMM, attention, norm, rotary + KV write,
  SiLU-and-mul, sampling, copies, other), then
- each kernel's launches and GPU time per step, largest first: what one decode step runs.

The profiler adds a little host overhead to every launch; graph replays are one launch each, so
with CUDA graphs the idle figure is close to the unprofiled one. Eager steps are slower under it.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from commit_id import commit_id
from torch.profiler import ProfilerActivity, profile

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def trace_events(trace_path: Path) -> list[dict[str, Any]]:
    """The events of a chrome trace that torch.profiler exported."""
    return json.loads(trace_path.read_text())["traceEvents"]


def records(
    events: list[dict[str, Any]], categories: set[str] = GPU_CATEGORIES
) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every complete event of those categories, sorted by start."""
    recs = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), str(e.get("name", "?")))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in categories
    ]
    return sorted(recs)


def gpu_records(trace_path: Path) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU activity in a chrome trace, sorted by start."""
    return records(trace_events(trace_path))


def gaps(recs: list[tuple[float, float, str]]) -> Iterator[tuple[float, float, str, str]]:
    """(start µs, end µs, the activity that ended last before it, the one after) of every
    stretch in which the GPU ran nothing; overlapping activities count as one busy stretch."""
    if not recs:
        return
    end, last = recs[0][1], recs[0][2]
    for start, stop, name in recs[1:]:
        if start > end:
            yield end, start, last, name
        if stop >= end:
            end, last = stop, name


def idle_fraction(recs: list[tuple[float, float, str]]) -> tuple[float, float]:
    """(idle fraction, window µs): the GPU's idle share between its first start and last end."""
    if not recs:
        return float("nan"), 0.0
    window = max(e for _, e, _ in recs) - recs[0][0]
    idle = sum(stop - start for start, stop, _, _ in gaps(recs))
    return (idle / window if window > 0 else 0.0), window


GAP_EDGES_US = (5.0, 50.0)  # gaps inside a graph are ~1-3 µs; between steps, tens or more


def idle_by_gap(recs: list[tuple[float, float, str]], steps: int) -> dict[str, float]:
    """Idle µs per step in the gaps between GPU activities, by gap length: short gaps are the
    launch latency between kernels inside a graph, long ones the host keeping the GPU waiting
    (between steps)."""
    buckets = {"<5us": 0.0, "5-50us": 0.0, ">50us": 0.0}
    for start, stop, _, _ in gaps(recs):
        gap = stop - start
        key = "<5us" if gap < GAP_EDGES_US[0] else "5-50us" if gap < GAP_EDGES_US[1] else ">50us"
        buckets[key] += gap
    return {k: v / steps for k, v in buckets.items()}


def long_gaps(
    recs: list[tuple[float, float, str]],
    steps: int,
    top: int = 6,
    edges: tuple[float, float] = (GAP_EDGES_US[1], float("inf")),
) -> list[dict[str, Any]]:
    """The gaps of edges[0] to edges[1] µs (by default 50 µs or more), by the GPU activity
    before and after them: what the GPU finished and what it then waited to start (per step:
    how often, and µs)."""
    per: dict[tuple[str, str], list[float]] = defaultdict(list)
    for start, stop, before, after in gaps(recs):
        if edges[0] <= stop - start < edges[1]:
            per[(before[:60], after[:60])].append(stop - start)
    rows = [
        {"before": b, "after": a, "per_step": len(g) / steps, "us_per_step": sum(g) / steps}
        for (b, a), g in per.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


HOST_CATEGORIES = {"cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"}


def host_in_long_gaps(
    events: list[dict[str, Any]], recs: list[tuple[float, float, str]], steps: int, top: int = 10
) -> list[dict[str, Any]]:
    """What the host was inside while the GPU (recs, from the same events) sat idle 50 µs or
    more: per host event name (torch ops, CUDA runtime calls), the µs per step of its overlap
    with those gaps. A cudaEventSynchronize there is the host waiting on the device; a Python or
    torch op, host work the step's launch waited behind."""
    windows = [(a, b) for a, b, _, _ in gaps(recs) if b - a >= GAP_EDGES_US[1]]
    per: dict[str, float] = defaultdict(float)
    for t0, t1, name in records(events, HOST_CATEGORIES):
        for w0, w1 in windows:
            overlap = min(t1, w1) - max(t0, w0)
            if overlap > 0:
                per[name[:60]] += overlap
    rows = [{"host": name, "us_per_step": us / steps} for name, us in per.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:top]


def kernel_table(recs: list[tuple[float, float, str]], steps: int) -> list[dict[str, Any]]:
    per: dict[str, list[float]] = defaultdict(list)
    for start, end, name in recs:
        per[name].append(end - start)
    rows = [
        {
            "name": name,
            "launches_per_step": len(durs) / steps,
            "us_per_step": sum(durs) / steps,
            "us_each": sum(durs) / len(durs),
        }
        for name, durs in per.items()
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])


# (group, substrings of a kernel's name), first match wins.
GROUPS = (
    ("attention", ("prefill_kernel", "decode_kernel", "decode_reduce", "flashinfer")),
    ("norm", ("rms_norm",)),
    ("rotary + KV write", ("rotary", "kv_write")),
    ("SiLU-and-mul", ("silu",)),
    ("GEMM", ("nvjet", "gemm", "gemv", "cutlass", "xmma", "sm90_", "sm80_", "skinny", "split_k")),
    ("sampling", ("argmax",)),
    ("copies", ("memcpy", "memset")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def group_table(kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """kernel_table rows summed by kernel_group, largest first."""
    sums: dict[str, dict[str, float]] = {}
    for k in kernels:
        g = sums.setdefault(kernel_group(k["name"]), {"launches_per_step": 0.0, "us_per_step": 0.0})
        g["launches_per_step"] += k["launches_per_step"]
        g["us_per_step"] += k["us_per_step"]
    rows = [{"group": name, **v} for name, v in sums.items()]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def print_groups(groups: list[dict[str, Any]]) -> None:
    """A group_table, then a blank line."""
    print(f"{'group':<40} {'launch/step':>11} {'us/step':>10}")
    for g in groups:
        print(f"{g['group']:<40} {g['launches_per_step']:>11.1f} {g['us_per_step']:>10.1f}")
    print()


def print_kernels(kernels: list[dict[str, Any]], top: int) -> None:
    """The first `top` rows of a kernel_table."""
    print(f"{'kernel':<72} {'launch/step':>11} {'us/step':>9} {'us each':>8}")
    for k in kernels[:top]:
        print(
            f"{k['name'][:72]:<72} {k['launches_per_step']:>11.1f} "
            f"{k['us_per_step']:>9.1f} {k['us_each']:>8.2f}"
        )


def with_sets(overrides: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """overrides plus each --set KEY=VALUE (a later one wins)."""
    return {**overrides, **dict(kv.split("=", 1) for kv in sets)}


def not_started(engine: Any, ids: list[str]) -> bool:
    """Whether a request of ids is still waiting for its first token (one that finished or
    was dropped is not: it is gone from engine.requests)."""
    return any(engine.requests[i].seq.num_output == 0 for i in ids if i in engine.requests)


def profile_batch(
    llm: LLM, batch: int, steps: int, trace_dir: Path, prompt_len: int = 128
) -> dict[str, Any]:
    engine = llm.engine
    prompts = [list(range(1000 + i, 1000 + prompt_len + i)) for i in range(batch)]
    # The batch's prefill takes up to one step per max_batched_tokens prompt tokens, and the
    # first sequences decode meanwhile: their budget covers that, so none finishes before the
    # profiled steps (256 x 640 tokens took ~80 steps and lost sequences at steps + 16).
    prefill_steps = -(-batch * prompt_len // engine.config.scheduler.max_batched_tokens)
    params = SamplingParams(max_tokens=steps + 16 + prefill_steps, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm
    ids = [engine.add_request(p, params) for p in prompts]
    while not_started(engine, ids):  # prefill, first tokens
        engine.step()
    for _ in range(4):
        engine.step()
    running = len(engine.scheduler.running)
    if running < batch:  # the KV cache (kv_cache.memory) holds fewer: the rest wait
        print(f"batch {batch}: only {running} sequences fit and run (raise kv_cache.memory)")
    walls = []
    trace = trace_dir / f"decode-{batch}.json"
    collections: list[tuple[int, float]] = []  # (generation, seconds) of each gc pass
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            collections.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(on_gc)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    gc.callbacks.remove(on_gc)
    prof.export_chrome_trace(str(trace))
    for i in ids:
        engine.abort(i)
    # Unprofiled wall time per step, for comparison with the profiled one.
    ids = [engine.add_request(p, params) for p in prompts]
    while not_started(engine, ids):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    plain_ms = (time.perf_counter() - t0) / steps * 1e3
    for i in ids:
        engine.abort(i)
    return {
        "batch": batch,
        "running": running,
        "steps": steps,
        "step_ms_median_profiled": statistics.median(walls) * 1e3,
        "step_ms_mean_unprofiled": plain_ms,
        "step_ms_profiled": [round(w * 1e3, 3) for w in walls],
        "gc_passes": [{"generation": g, "ms": round(t * 1e3, 3)} for g, t in collections],
        **trace_summary(trace, steps),
    }


def trace_summary(trace: Path, steps: int) -> dict[str, Any]:
    """What a profiled run of `steps` steps did on the GPU, per step: its window, busy time and
    idle share (with the idle time by gap length), and its kernels, grouped and one by one."""
    events = trace_events(trace)
    recs = records(events)
    idle, window = idle_fraction(recs)
    kernels = kernel_table(recs, steps)
    return {
        "gpu_window_ms_per_step": window / steps / 1e3,
        "gpu_busy_ms_per_step": window * (1 - idle) / steps / 1e3,
        "gpu_idle_fraction": idle,
        "idle_us_per_step_by_gap": idle_by_gap(recs, steps),
        "long_gaps": long_gaps(recs, steps),
        "mid_gaps": long_gaps(recs, steps, edges=GAP_EDGES_US),  # 5-50 µs
        "host_in_long_gaps": host_in_long_gaps(events, recs, steps),
        "groups": group_table(kernels),
        "kernels": kernels,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-3b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batch", default="1,64", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--eager", action="store_true", help="engine.cuda_graphs = false")
    ap.add_argument("--overlap", choices=["on", "off", "default"], default="default")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], help="extra config KEY=VALUE")
    ap.add_argument(
        "--trace-dir", default=None,
        help="keep each batch's chrome trace there (decode-<batch>.json); default: a temp dir",
    )  # fmt: skip
    ap.add_argument(
        "--blas", choices=["default", "cublas", "cublaslt"], default="default",
        help="torch.backends.cuda.preferred_blas_library for the GEMMs",
    )  # fmt: skip
    args = ap.parse_args()
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    overrides = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "model.dtype": "bfloat16",
        "kv_cache.memory": "20GiB",
        "engine.attention_backend": args.backend,
        "engine.cuda_graphs": not args.eager,
    }
    if args.overlap != "default":
        overrides["engine.overlap"] = args.overlap == "on"
    llm = LLM(load_config(None, with_sets(overrides, args.set)))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = Path(args.trace_dir or tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        for batch in [int(b) for b in args.batch.split(",")]:
            r = profile_batch(llm, batch, args.steps, trace_dir, args.prompt_len)
            results.append(r)
            print(
                f"\nbatch {batch}: step {r['step_ms_mean_unprofiled']:.3f} ms unprofiled "
                f"({r['step_ms_median_profiled']:.3f} profiled); GPU busy "
                f"{r['gpu_busy_ms_per_step']:.3f} ms of a {r['gpu_window_ms_per_step']:.3f} ms "
                f"window per step: idle {100 * r['gpu_idle_fraction']:.1f}%; idle µs/step by "
                f"gap length {r['idle_us_per_step_by_gap']}"
            )
            for label, key in ((">= 50", "long_gaps"), ("5-50", "mid_gaps")):
                for g in r[key]:
                    print(
                        f"gap {label} µs: {g['per_step']:.2f}/step, {g['us_per_step']:.1f} "
                        f"µs/step, after {g['before']!r}, before {g['after']!r}"
                    )
            for h in r["host_in_long_gaps"]:
                print(f"host in those gaps: {h['us_per_step']:.1f} µs/step in {h['host']!r}")
            slow = [
                i
                for i, w in enumerate(r["step_ms_profiled"])
                if w > 1.2 * r["step_ms_median_profiled"]
            ]
            print(f"steps over 1.2 x the median: {slow}; gc passes: {r['gc_passes']}")
            print_groups(r["groups"])
            print_kernels(r["kernels"], args.top)
    doc = {"args": vars(args), "commit": commit_id(), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
