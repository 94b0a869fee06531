"""What prompt tokens cost when they ride in decode steps: the step time of D decodes plus a
P-token prompt chunk, against D decodes alone.

    python benchmarks/ride_along.py --preset llama-3.1-8b-instruct --tokenizer DIR \
        [--decodes 64] [--context 640] [--chunks 0,64,128,192,256,448] [--steps 40] \
        [--profile-steps 12] [--set KEY=VALUE ...] [--json OUT.json]

For each chunk length P, `--decodes` requests of a `--context`-token prompt are prefilled and
decode; then every step gets one fresh random prompt of P tokens (max_tokens 1: it finishes in
the step that prefills it), added before the step is scheduled, so each step runs the D decodes
and P prompt tokens, as a closed loop whose clients are out of step would. Timed over `--steps`
steps (the engine's overlap as configured, synchronised at both ends), then `--profile-steps`
more under torch.profiler, whose GPU kernels are grouped as profile_decode.py groups them.

It prints ms a step, the extra over P = 0, and that extra per prompt token, beside what the same
tokens cost in a full prompt step (--prompt-step-us, default 21.7 µs a token: 8B's 8192-token
steps of 178 ms, BENCHMARKS.md sessions 33-34). Where the extra per token is well under that,
prompt tokens ride almost free and out-of-step clients would be served faster than waves.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from commit_id import commit_id
from profile_decode import not_started, print_groups, trace_summary, with_sets
from torch.profiler import ProfilerActivity, profile

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


def sync() -> None:
    if torch.cuda.is_available():  # on the CPU (a smoke run) there is nothing to wait for
        torch.cuda.synchronize()


def run_chunk(
    llm: LLM,
    chunk: int,
    decodes: int,
    context: int,
    steps: int,
    profile_steps: int,
    rng: random.Random,
    trace_dir: Path,
) -> dict[str, Any]:
    engine = llm.engine
    vocab = engine.executor.vocab_size
    low = 1000 if vocab > 4000 else 0  # clear of the special tokens where there is room

    def prompt(n: int) -> list[int]:
        return [rng.randrange(low, vocab) for _ in range(n)]

    long = SamplingParams(max_tokens=steps + profile_steps + 64, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt(context), long) for _ in range(decodes)]
    while not_started(engine, ids):
        engine.step()
    for _ in range(4):  # the last prompt step's outputs, then plain decode steps
        engine.step()
    running = len(engine.scheduler.running)

    def ride(n: int) -> list[int]:
        """Run n steps with a chunk each; the number of waiting requests after each."""
        waiting = []
        for _ in range(n):
            if chunk:
                engine.add_request(prompt(chunk), one)
            engine.step()
            waiting.append(len(engine.scheduler.waiting))
        return waiting

    ride(4)  # the chunk's graph and kernels warm
    sync()
    t0 = time.perf_counter()
    waiting = ride(steps)
    sync()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    trace = trace_dir / f"ride-{chunk}.json"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ride(profile_steps)
        sync()
    prof.export_chrome_trace(str(trace))
    summary = trace_summary(trace, profile_steps)
    for i in list(engine.requests):
        engine.abort(i)
    while engine.has_work():
        engine.step()
    return {
        "chunk": chunk,
        "decodes": decodes,
        "running": running,
        "context": context,
        "steps": steps,
        "step_ms": step_ms,
        "max_waiting": max(waiting),
        "gpu_busy_ms_per_step": summary["gpu_busy_ms_per_step"],
        "groups": summary["groups"],
        "kernels": summary["kernels"][:20],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--context", type=int, default=640, help="tokens of each decode's prompt")
    ap.add_argument("--chunks", default="0,64,128,192,256,448")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-steps", type=int, default=12)
    ap.add_argument("--prompt-step-us", type=float, default=21.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    overrides = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "model.dtype": "bfloat16",
        "kv_cache.memory": "20GiB",
        "engine.attention_backend": args.backend,
        "scheduler.prefix_cache": False,
    }
    llm = LLM(load_config(None, with_sets(overrides, args.set)))
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for chunk in (int(c) for c in args.chunks.split(",")):
            r = run_chunk(
                llm, chunk, args.decodes, args.context, args.steps, args.profile_steps, rng,
                Path(tmp),
            )  # fmt: skip
            rows.append(r)
            print(f"\n{args.decodes} decodes + {chunk}-token chunk: {r['step_ms']:.3f} ms a step "
                  f"(GPU busy {r['gpu_busy_ms_per_step']:.3f}); {r['running']} ran; at most "
                  f"{r['max_waiting']} waiting")  # fmt: skip
            print_groups(r["groups"])
    base = next((r["step_ms"] for r in rows if r["chunk"] == 0), None)
    print(f"{'chunk':>6} {'ms/step':>8} {'extra ms':>9} {'µs/token':>9} {'in a prompt step':>17}")
    for r in rows:
        extra = r["step_ms"] - base if base is not None else float("nan")
        per = extra / r["chunk"] * 1e3 if r["chunk"] and base is not None else float("nan")
        r["extra_ms"], r["extra_us_per_token"] = extra, per
        print(f"{r['chunk']:>6} {r['step_ms']:>8.3f} {extra:>9.3f} {per:>9.1f} "
              f"{args.prompt_step_us * r['chunk'] / 1e3:>14.3f} ms")  # fmt: skip
    if args.json:
        doc = {"args": vars(args), "commit": commit_id(), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
