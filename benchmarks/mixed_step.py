"""Is an eager step (prompt tokens beside decodes) bound by the host or by the GPU?

    python benchmarks/mixed_step.py --preset qwen2.5-3b-instruct --tokenizer DIR \
        [--decodes 0,8,64] [--chunks 16,128,512,2048] [--json OUT.json]

For each number of running decodes and each prompt chunk length, one step runs a fresh prompt of
that length beside the decodes. The GPU is idle when the step is submitted (synchronised first),
so the host's time to submit it (build inputs, launch every kernel) and the GPU's time for it
(CUDA events around the submit, read after a synchronise) are measured apart: a host time above
the GPU time means the step is launch-bound. Then cProfile over one submit names where the host
time goes, and a micro-benchmark gives the host cost of one Triton launch and one torch op.

--burst N (e.g. 8 for a c=8 round of 512-token prompts, --burst-len): N prompts reach an idle
engine at once, as a closed loop's round does; the host time from the last add to the prompt
step being on the GPU (the scheduler, then the executor's submit) is what the GPU waits for.
Timed over --repeats bursts, then cProfiled over one.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from commit_id import commit_id

from inferx_core.bench_offline import random_prompt
from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


class SubmitTimer:
    """Wraps the executor's submit: syncs first, then times the host and the GPU."""

    def __init__(self, executor: Any) -> None:
        self.real = executor.submit
        self.last: dict[str, float] = {}
        self.profiler: cProfile.Profile | None = None
        executor.submit = self.submit

    def submit(self, out: Any) -> Any:
        cuda = torch.cuda.is_available()  # on the CPU (a smoke run) the GPU time is the host's
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        if self.profiler is not None:
            self.profiler.enable()
        got = self.real(out)
        if self.profiler is not None:
            self.profiler.disable()
        host = time.perf_counter() - t0
        gpu = host * 1e3
        if cuda:
            end.record()
            torch.cuda.synchronize()
            gpu = start.elapsed_time(end)
        self.last = {
            "host_ms": host * 1e3,
            "gpu_ms": gpu,
            "tokens": sum(c.num_tokens for c in out.chunks),
            "seqs": len(out.chunks),
        }
        return got


def burst_host(engine: Any, vocab: int, n: int, length: int, repeats: int) -> dict[str, Any]:
    """Host ms from the last of n adds to the burst's prompt step queued on the device: the
    engine's schedule() and the executor's submit(), timed apart, then cProfiled over one."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)  # as the table's
    sched = engine.scheduler
    real_schedule, real_submit = sched.schedule, engine.executor.submit
    times: dict[str, list[float]] = {"schedule_ms": [], "submit_ms": []}
    profiler: cProfile.Profile | None = None

    def timed_schedule() -> Any:
        t0 = time.perf_counter()
        out = real_schedule()
        times["schedule_ms"].append((time.perf_counter() - t0) * 1e3)
        return out

    def timed_submit(out: Any) -> Any:
        t0 = time.perf_counter()
        got = real_submit(out)
        times["submit_ms"].append((time.perf_counter() - t0) * 1e3)
        return got

    samples = []
    for i in range(repeats + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for _ in range(n):
            engine.add_request(random_prompt(vocab, length, rng), params)
        for t in times.values():
            t.clear()
        sched.schedule, engine.executor.submit = timed_schedule, timed_submit
        if i == repeats:
            profiler = cProfile.Profile()
            profiler.enable()
        engine.step()  # the burst's step, then (overlap) the next one, then waits
        if profiler is not None:
            profiler.disable()
        sched.schedule, engine.executor.submit = real_schedule, real_submit
        if i < repeats:
            samples.append({k: v[0] for k, v in times.items()})
        while engine.has_work():
            engine.step()
    schedule = statistics.median(s["schedule_ms"] for s in samples)
    submit = statistics.median(s["submit_ms"] for s in samples)
    print(f"burst of {n} x {length}: host ms to the prompt step, schedule {schedule:.2f} + "
          f"submit {submit:.2f} (median of {repeats})")  # fmt: skip
    assert profiler is not None
    buf = io.StringIO()
    pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
    text = buf.getvalue()
    print(text[text.find("function calls") :])
    return {"n": n, "length": length, "samples": samples, "schedule_ms": schedule,
            "submit_ms": submit, "cprofile": text}  # fmt: skip


def launch_costs(llm: LLM, calls: int = 300) -> dict[str, float]:
    """Host µs per call of a Triton kernel (add + RMSNorm on one row) and of a torch op."""
    from inferx_kernels_cuda.ops import TritonOps

    ops = TritonOps()
    hidden = int(llm.engine.executor.hf_config["hidden_size"])
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    out: dict[str, float] = {}

    def timed(fn: Any) -> float:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host = (time.perf_counter() - t0) / calls * 1e6
        torch.cuda.synchronize()
        return host

    out["torch_add_us"] = timed(lambda: torch.add(x, res))
    out["torch_linear_us"] = timed(lambda: torch.nn.functional.linear(x, torch.ones_like(w)[None]))
    out["triton_add_rms_norm_us"] = timed(lambda: ops.rms_norm(x, w, 1e-6, res))
    import triton
    import triton.language as tl

    @triton.jit
    def _touch(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(x_ptr + offs, v, mask=offs < n)

    out["triton_minimal_kernel_us"] = timed(lambda: _touch[(1,)](x, 16, BLOCK=16))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-3b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--decodes", default="0,8,64")
    ap.add_argument("--chunks", default="16,128,512,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile-decodes", type=int, default=64, help="decodes of the profiled step")
    ap.add_argument("--profile-chunk", type=int, default=512, help="its prompt chunk")
    ap.add_argument("--burst", type=int, default=0, help="prompts reaching an idle engine at once")
    ap.add_argument("--burst-len", type=int, default=512, help="tokens of each burst prompt")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    overrides: dict[str, Any] = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "model.dtype": "bfloat16" if torch.cuda.is_available() else "float32",
        "engine.attention_backend": args.backend,
        "kv_cache.memory": "40GiB" if torch.cuda.is_available() else "1GiB",
        "scheduler.max_batched_tokens": 8192,
        "scheduler.prefill_chunk": 8192,
    }
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = value
    llm = LLM(load_config(None, overrides))
    engine = llm.engine
    vocab = int(engine.executor.hf_config["vocab_size"])
    long = SamplingParams(max_tokens=4000, ignore_eos=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    burst = {}
    if args.burst:
        burst = burst_host(engine, vocab, args.burst, args.burst_len, args.repeats)
    timer = SubmitTimer(engine.executor)  # after the burst: its submits are not synchronised
    print(f"{args.preset}, {args.backend}; eager steps submitted with the GPU idle")
    print(f"{'decodes':>7} {'chunk':>6} | {'host ms':>8} {'GPU ms':>8} {'host/GPU':>8}")
    rng = random.Random(0)
    for decodes in [int(v) for v in args.decodes.split(",")]:
        ids = [engine.add_request(random_prompt(vocab, 128, rng), long) for _ in range(decodes)]
        while any(engine.requests[i].seq.num_output < 2 for i in ids):
            engine.step()
        for chunk in [int(v) for v in args.chunks.split(",")]:
            samples = []
            for _ in range(args.repeats):
                rid = engine.add_request(random_prompt(vocab, chunk, rng), one)
                while rid in engine.requests and engine.requests[rid].seq.num_computed == 0:
                    engine.step()
                    if timer.last.get("tokens", 0) >= chunk:
                        samples.append(dict(timer.last))
                while rid in engine.requests:
                    engine.step()
            if not samples:
                continue
            host = statistics.median(s["host_ms"] for s in samples)
            gpu = statistics.median(s["gpu_ms"] for s in samples)
            rows.append({"decodes": decodes, "chunk": chunk, "host_ms": host, "gpu_ms": gpu})
            print(f"{decodes:>7} {chunk:>6} | {host:8.2f} {gpu:8.2f} {host / gpu:8.2f}")
        for i in ids:
            engine.abort(i)
        while engine.has_work():
            engine.step()

    # Where one step's host time goes: --profile-decodes decodes beside a --profile-chunk
    # chunk (64 and 512 by default).
    ids = [
        engine.add_request(random_prompt(vocab, 128, rng), long)
        for _ in range(args.profile_decodes)
    ]
    while any(engine.requests[i].seq.num_output < 2 for i in ids):
        engine.step()
    timer.profiler = cProfile.Profile()
    rid = engine.add_request(random_prompt(vocab, args.profile_chunk, rng), one)
    while rid in engine.requests and engine.requests[rid].seq.num_computed == 0:
        engine.step()
    timer.profiler, prof = None, timer.profiler
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    profile_text = buf.getvalue()
    print(profile_text[profile_text.find("function calls") :])
    for i in ids:
        engine.abort(i)
    while engine.has_work():
        engine.step()

    costs = launch_costs(llm) if torch.cuda.is_available() else {}
    print("host µs per call: " + ", ".join(f"{k} {v:.1f}" for k, v in costs.items()))
    if args.json:
        doc = {
            "meta": {
                "commit": commit_id(),
                "preset": args.preset,
                "backend": args.backend,
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            },
            "rows": rows,
            "launch_costs_us": costs,
            "burst": burst,
            "cprofile_decodes": args.profile_decodes,
            "cprofile_chunk": args.profile_chunk,
            "cprofile": profile_text,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
