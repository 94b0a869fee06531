"""Python's garbage-collector pauses inside the engine loop, with engine.gc_freeze on and off.

    python benchmarks/engine_gc_pauses.py [--tokenizer DIR] [--prompts 256] [--input-len 512]
        [--output-len 256] [--rounds 2] [--json OUT.json]

The host side of an offline run (scheduler, detokenizer, request bookkeeping) over an executor
that samples random tokens at once, after importing what a GPU deployment imports (torch,
triton, the model and kernel plugins). Each setting runs in its own process, since a frozen heap
stays frozen. Prints, per setting, the collections of each generation, their longest and total
pause, and the longest engine step.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import gc, json, random, sys, time
import torch, triton  # noqa: F401  (what a deployment imports before its engine starts)
import inferx_kernels_cuda, inferx_models  # noqa: F401
from inferx_core.config import load_config
from inferx_core.engine import Engine
from inferx_core.interfaces import StepResult
from inferx_core.sequence import SamplingParams
from inferx_core.tokenizer import Tokenizer

args = json.loads(sys.argv[1])


class RandomTokens:
    num_kv_blocks = 1 + args["prompts"] * (args["input_len"] + args["output_len"]) // 16
    block_size = 16
    vocab_size = 100_000

    def execute(self, out):
        return StepResult([random.randrange(1000, 90_000) for c in out.chunks if c.sample])


pauses = {0: [], 1: [], 2: []}
start = [0.0]


def on_gc(phase, info):
    if phase == "start":
        start[0] = time.perf_counter()
    else:
        pauses[info["generation"]].append(time.perf_counter() - start[0])


config = load_config(None, {
    "engine.gc_freeze": args["freeze"],
    "scheduler.max_batched_tokens": 8192,
    "scheduler.prefill_chunk": 8192,
    "scheduler.max_running": args["prompts"],
})
tok = Tokenizer.from_dir(args["tokenizer"]) if args["tokenizer"] else None
engine = Engine(config, executor=RandomTokens(), tokenizer=tok)
tracked = len(gc.get_objects())
gc.callbacks.append(on_gc)
rng = random.Random(0)
params = SamplingParams(max_tokens=args["output_len"], temperature=0, ignore_eos=True)
steps = []
t0 = time.perf_counter()
for _ in range(args["rounds"]):
    for _ in range(args["prompts"]):
        engine.add_request([rng.randrange(1000, 90_000) for _ in range(args["input_len"])], params)
    while engine.has_work():
        s = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - s)
print(json.dumps({
    "freeze": args["freeze"],
    "tracked_after_start": tracked,
    "frozen": gc.get_freeze_count(),
    "seconds": time.perf_counter() - t0,
    "steps": len(steps),
    "max_step_ms": max(steps) * 1e3,
    "gc": {g: {"n": len(p), "max_ms": max(p, default=0) * 1e3, "sum_ms": sum(p) * 1e3}
           for g, p in pauses.items()},
}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="a tokenizer directory (detokenizing)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = []
    for freeze in (False, True):
        child = {**vars(args), "freeze": freeze}
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(child)],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(
        f"{'gc_freeze':>9} {'tracked':>8} {'frozen':>8} {'steps':>6} {'max step ms':>11} | "
        "gen 0 / 1 / 2 collections: n, max ms, total ms"
    )
    for r in results:
        gens = "  ".join(
            f"{v['n']}, {v['max_ms']:.1f}, {v['sum_ms']:.1f}" for v in r["gc"].values()
        )
        print(
            f"{r['freeze']!s:>9} {r['tracked_after_start']:>8} {r['frozen']:>8} {r['steps']:>6} "
            f"{r['max_step_ms']:>11.1f} | {gens}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
