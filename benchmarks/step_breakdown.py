"""Where the offline throughput run spends its time, step by step (issue 4's 256 x 512/256).

    python benchmarks/step_breakdown.py --preset qwen2.5-3b-instruct --tokenizer DIR \
        [--num-prompts 256 --input-len 512 --output-len 256] [--json OUT.json]

Runs LLM.generate over random prompts and times, for every engine.step() call, its parts on the
host clock: schedule() and submit() of the next step, waiting for the step's result, and
applying it (update, detokenize), and the time Python's garbage collector ran inside it (and
whether a full, generation-2, collection did). Steps are grouped by what they ran: decode-only
steps (CUDA graphs) and steps with prompt tokens; the slowest steps are listed with their parts,
and the Triton kernels compiled during the run (a mid-run compile stalls a step). Then
torch.profiler over a window of decode steps at the largest batch gives the GPU's busy and idle
time per step there (profile_decode.py's measure). A second run (--api-prompts) under
torch.profiler gives the CUDA runtime calls the host spent longest in (a cudaStreamSynchronize
or cudaFree there is a step waiting on the GPU), and a third under torch's sync debug mode the
torch ops that synchronised. The caching allocator's retries (a failed cudaMalloc, then every
cached block freed, which waits for the device) are counted per step of the timed run. Prints
a table; --json keeps it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from commit_id import commit_id  # noqa: E402
from h200_table import triton_kernels  # noqa: E402
from profile_decode import gpu_records, idle_fraction, not_started, with_sets  # noqa: E402

from inferx_core.bench_offline import random_prompt  # noqa: E402
from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import LLM  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402


class StepTimer:
    """Wraps an engine's parts to time them per engine.step() call."""

    def __init__(self, engine: Any) -> None:
        self.rows: list[dict[str, Any]] = []
        self.cur: dict[str, Any] = {}
        eng = engine
        real_submit, real_apply, real_step = eng._submit, eng._apply, eng.step

        def submit(idle_ok: bool):
            t0 = time.perf_counter()
            got = real_submit(idle_ok)
            self.cur["submit_ms"] = self.cur.get("submit_ms", 0) + (time.perf_counter() - t0) * 1e3
            if got is not None:
                chunks = got[0].chunks
                self.cur["next_tokens"] = sum(c.num_tokens for c in chunks)
                self.cur["next_seqs"] = len(chunks)
            return got

        def apply(out, result):
            self.cur["wait_ms"] = (time.perf_counter() - self.t_wait) * 1e3
            t0 = time.perf_counter()
            r = real_apply(out, result)
            self.cur["apply_ms"] = (time.perf_counter() - t0) * 1e3
            self.cur["tokens"] = sum(c.num_tokens for c in out.chunks)
            self.cur["seqs"] = len(out.chunks)
            return r

        def step():
            self.cur = {}
            t0 = time.perf_counter()
            self.t_wait = t0
            out = real_step()
            self.cur["step_ms"] = (time.perf_counter() - t0) * 1e3
            retries = alloc_retries()
            self.cur["alloc_retries"] = retries - self.retries
            self.retries = retries
            self.rows.append(self.cur)
            return out

        # result() is called right before _apply; time from the end of the last submit.
        def submit_then_mark(idle_ok: bool):
            got = submit(idle_ok)
            self.t_wait = time.perf_counter()
            return got

        self._engine, self._real = eng, (real_submit, real_apply, real_step)
        eng._submit, eng._apply, eng.step = submit_then_mark, apply, step
        self.retries = alloc_retries()
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        """Collector time inside the current step, and full collections (generation 2)."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        self.cur["gc_ms"] = self.cur.get("gc_ms", 0.0) + (time.perf_counter() - self._gc_t0) * 1e3
        if info["generation"] == 2:
            self.cur["gc_full"] = self.cur.get("gc_full", 0) + 1

    def close(self) -> None:
        """Stop timing: the engine's own methods back, so later runs add no rows."""
        gc.callbacks.remove(self._on_gc)
        eng = self._engine
        eng._submit, eng._apply, eng.step = self._real


def alloc_retries() -> int:
    """The caching allocator's cudaMalloc retries so far (each frees every cached block first,
    which waits for the device); 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if "tokens" not in r:
            continue
        kind = "decode" if r["tokens"] == r["seqs"] else "with prompt tokens"
        groups[kind].append(r)
    out = {}
    for kind, rs in groups.items():
        n = len(rs)
        out[kind] = {
            "steps": n,
            "total_s": sum(r["step_ms"] for r in rs) / 1e3,
            "mean_seqs": sum(r["seqs"] for r in rs) / n,
            "mean_tokens": sum(r["tokens"] for r in rs) / n,
            **{
                f"mean_{k}": sum(r.get(k, 0.0) for r in rs) / n
                for k in ("step_ms", "submit_ms", "wait_ms", "apply_ms", "gc_ms")
            },
            "gc_full": sum(r.get("gc_full", 0) for r in rs),
            "alloc_retries": sum(r.get("alloc_retries", 0) for r in rs),
        }
    return out


def slowest(rows: list[dict[str, Any]], n: int = 5) -> list[dict[str, Any]]:
    """The n slowest steps, each with its index in the run, slowest first."""
    timed = [{"index": i, **r} for i, r in enumerate(rows) if "step_ms" in r]
    return sorted(timed, key=lambda r: -r["step_ms"])[:n]


def offline_arguments(ap: argparse.ArgumentParser) -> None:
    """The offline run's options (also profile_offline.py's)."""
    ap.add_argument("--preset", default="qwen2.5-3b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], help="extra config KEY=VALUE")


def offline_workload(
    args: argparse.Namespace, extra: dict[str, Any]
) -> tuple[LLM, list[list[int]], SamplingParams]:
    """The engine (max_batched_tokens = prefill_chunk 8192, prefix cache off, plus `extra`
    and --set), the run's random prompts and its params, after 16 short requests warmed it."""
    overrides = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "engine.attention_backend": args.backend,
        "scheduler.max_batched_tokens": 8192,
        "scheduler.prefill_chunk": 8192,
        "scheduler.prefix_cache": False,
        **extra,
    }
    llm = LLM(load_config(None, with_sets(overrides, args.set)))
    vocab = int(llm.engine.executor.hf_config["vocab_size"])
    rng = random.Random(2)
    prompts = [random_prompt(vocab, args.input_len, rng) for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:16], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return llm, prompts, params


def main() -> None:
    ap = argparse.ArgumentParser()
    offline_arguments(ap)
    ap.add_argument(
        "--api-prompts", type=int, default=256, help="prompts of the profiled run of CUDA calls"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm, prompts, params = offline_workload(args, {"model.dtype": "bfloat16"})
    kernels = triton_kernels()
    timer = StepTimer(llm.engine)
    t0 = time.perf_counter()
    done = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    timer.close()
    compiled = sorted(triton_kernels() - kernels)
    out_tokens = sum(len(d.token_ids) for d in done)
    summary = summarize(timer.rows)
    print(
        f"{args.preset}: {args.num_prompts} x {args.input_len}/{args.output_len}: {elapsed:.2f} s, "
        f"{out_tokens / elapsed:,.0f} output tok/s, {len(timer.rows)} steps"
    )
    print(
        f"{'steps':<20} {'n':>5} {'total s':>8} {'seqs':>6} {'tokens':>7} {'step ms':>8} "
        f"{'submit':>7} {'wait':>7} {'apply':>7} {'gc':>6} {'gc full':>7} {'retries':>7}"
    )
    for kind, s in summary.items():
        print(
            f"{kind:<20} {s['steps']:>5} {s['total_s']:>8.2f} {s['mean_seqs']:>6.0f} "
            f"{s['mean_tokens']:>7.0f} {s['mean_step_ms']:>8.2f} {s['mean_submit_ms']:>7.2f} "
            f"{s['mean_wait_ms']:>7.2f} {s['mean_apply_ms']:>7.2f} {s['mean_gc_ms']:>6.2f} "
            f"{s['gc_full']:>7} {s['alloc_retries']:>7}"
        )
    print(
        "slowest steps: index, tokens, ms (submit / wait / apply; gc, full collections; "
        "allocator retries)"
    )
    for r in slowest(timer.rows):
        print(
            f"  {r['index']:>4} {r.get('tokens', 0):>6} {r['step_ms']:>8.1f} "
            f"({r.get('submit_ms', 0):.1f} / {r.get('wait_ms', 0):.1f} / "
            f"{r.get('apply_ms', 0):.1f}; {r.get('gc_ms', 0):.1f}, {r.get('gc_full', 0)}; "
            f"{r.get('alloc_retries', 0)})"
        )
    print(f"Triton kernels compiled during the run: {compiled or 'none'}")
    doc = {
        "commit": commit_id(),
        "args": vars(args),
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "summary": summary,
        "slowest": slowest(timer.rows),
        "triton_compiled": compiled,
        "rows": timer.rows,
    }
    if torch.cuda.is_available():
        doc["decode_full_batch"] = gpu_idle(llm, prompts, params)
        doc["runtime_calls"] = runtime_calls(llm, prompts[: args.api_prompts], params)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


def gpu_idle(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """GPU busy and idle time per decode step with every prompt running."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    while not_started(engine, ids):
        engine.step()
    for _ in range(4):
        engine.step()
    steps = 20
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(trace))
        recs = gpu_records(trace)
    for i in ids:
        engine.abort(i)
    idle, window = idle_fraction(recs)
    busy_ms = window * (1 - idle) / steps / 1e3
    print(
        f"decode at batch {len(ids)}: GPU busy {busy_ms:.2f} ms of {window / steps / 1e3:.2f} "
        f"ms per step (idle {100 * idle:.1f}%)"
    )
    return {"gpu_busy_ms": busy_ms, "window_ms": window / steps / 1e3, "idle": idle}


def runtime_calls(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, top: int = 8
) -> dict[str, Any]:
    """Over one generate run under torch.profiler (with Python stacks): the CUDA runtime and
    driver calls the host spent longest in, in total and the longest single calls with the
    torch op and our code that made them. Then the same run under torch's sync debug mode: the
    torch ops that made the host wait for the device, where our code called them."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    totals = [
        {"name": e.key, "count": e.count, "host_ms": e.cpu_time_total / 1e3}
        for e in prof.key_averages()
        if e.key.startswith("cu") and not e.key.startswith("cutlass")
    ]
    totals.sort(key=lambda c: -c["host_ms"])
    print(f"CUDA calls the host spent longest in, {len(prompts)} prompts (ms, count):")
    for c in totals[:top]:
        print(f"  {c['name']:<36} {c['host_ms']:>9.1f} {c['count']:>7}")
    calls = [e for e in prof.events() if e.name.startswith("cu") and e.device_type.name == "CPU"]
    calls.sort(key=lambda e: -e.cpu_time_total)
    longest = []
    print("longest single calls (ms; the op that made it; where in our code):")
    for e in calls[:top]:
        parent = e.cpu_parent
        while parent is not None and not parent.stack and parent.cpu_parent is not None:
            parent = parent.cpu_parent
        ours = [f for f in (parent.stack if parent is not None else []) if "inferx" in f][:3]
        op = parent.name if parent is not None else "-"
        longest.append({"name": e.name, "ms": e.cpu_time_total / 1e3, "op": op, "stack": ours})
        print(f"  {e.name:<28} {e.cpu_time_total / 1e3:>8.1f}  {op:<28} {' < '.join(ours)}")
    syncs: dict[str, int] = defaultdict(int)
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm.generate(prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        if "synchroniz" in str(w.message):
            syncs[f"{w.filename}:{w.lineno}: {str(w.message)[:80]}"] += 1
    print(f"torch ops that synchronized ({sum(syncs.values())}):")
    for where, n in sorted(syncs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {n:>6}  {where}")
    return {"totals": totals[:top], "longest": longest, "syncs": dict(syncs)}


if __name__ == "__main__":
    main()
