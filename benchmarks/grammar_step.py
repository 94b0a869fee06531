"""Offline cost of structured output per engine step: N rows decoding greedily, plain against
json_object and a JSON schema, with the grammar worker (engine.grammar_worker) on and off.

For each (worker, mode): ms a step (wall time over engine steps), the rows decoding a step on
average, and per step the engine thread's wait for grammar work (inline: all of it; with the
worker: what is left on the critical path) and the grammar work itself (advancing the matchers
and filling the masks). With --profile, cProfile's top functions of one run of each.

python benchmarks/grammar_step.py --tokenizer DIR [--preset qwen2.5-3b-instruct] [--rows 64]
    [--prompt-len 512] [--steps 128] [--kv-memory 0.5] [--repeat 2] [--profile] [--json OUT]
    [--switch-interval S]

--switch-interval sets Python's GIL switch interval (5 ms by default): a thread that wants the
GIL back (the worker, after llguidance's calls) waits up to that long while another runs Python.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time

import torch
from commit_id import commit_id

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "city", "notes"],
}
MODES = {"plain": None, "json_object": {"type": "object"}, "json_schema": SCHEMA}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, prompts: list[list[int]], mode: str, steps: int) -> dict[str, float]:
    schema = MODES[mode]
    params = SamplingParams(
        max_tokens=steps,
        ignore_eos=True,
        temperature=0.0,
        json_schema=None if schema is None else json.dumps(schema),
    )
    engine = llm.engine
    worker = engine.grammars.worker
    real, count = engine.step, [0]

    def step():  # type: ignore[no-untyped-def]
        count[0] += 1
        return real()

    engine.step = step  # type: ignore[method-assign]
    wait0, work0 = worker.wait_s, worker.work_s
    try:
        sync()
        t0 = time.perf_counter()
        done = llm.generate(prompts, params)
        sync()
        wall = time.perf_counter() - t0
    finally:
        del engine.step
    n = count[0]
    tokens = sum(len(c.token_ids) for c in done)
    return {
        "ms_per_step": wall / n * 1e3,
        "steps": n,
        "rows_per_step": tokens / n,
        "grammar_wait_ms_per_step": (worker.wait_s - wait0) / n * 1e3,
        "grammar_work_ms_per_step": (worker.work_s - work0) / n * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="the preset's tokenizer directory")
    ap.add_argument("--preset", default="qwen2.5-3b-instruct")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--kv-memory", default="0.5")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--modes", default="plain,json_object,json_schema")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE config overrides")
    ap.add_argument("--profile", action="store_true", help="cProfile one run of each")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval, seconds")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    overrides = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "kv_cache.memory": args.kv_memory,
        "scheduler.prefix_cache": "false",
    }
    overrides.update(kv.split("=", 1) for kv in args.set)
    llm = LLM(load_config(None, overrides))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1000, 100000) for _ in range(args.prompt_len)] for _ in range(args.rows)
    ]
    modes = args.modes.split(",")
    worker = llm.engine.grammars.worker
    for mode in modes:  # warm-up: the grammar backend, the schemas' compiles, graphs
        run(llm, prompts, mode, 16)
    results = []
    print(
        f"commit {commit_id()}, {args.preset}, {args.rows} rows, overlap {llm.engine.overlap}, "
        f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms"
    )
    print("| worker | mode | ms/step | rows/step | grammar wait ms/step | grammar work ms/step |")
    print("|---|---|---:|---:|---:|---:|")
    for threaded in (True, False):
        worker.threaded = threaded  # read as each task is queued: no task is in flight here
        for _ in range(args.repeat):
            for mode in modes:
                r = run(llm, prompts, mode, args.steps)
                r |= {"worker": threaded, "mode": mode}
                results.append(r)
                print(
                    f"| {'thread' if threaded else 'inline'} | {mode} | {r['ms_per_step']:.3f} "
                    f"| {r['rows_per_step']:.1f} | {r['grammar_wait_ms_per_step']:.3f} "
                    f"| {r['grammar_work_ms_per_step']:.3f} |",
                    flush=True,
                )
        if args.profile:
            for mode in modes:
                prof = cProfile.Profile()
                prof.enable()
                run(llm, prompts, mode, args.steps)
                prof.disable()
                print(f"=== profile, worker {'thread' if threaded else 'inline'}, {mode}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit_id(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
