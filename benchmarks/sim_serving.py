"""Closed-loop serving with the real engine and scheduler over a modeled GPU: what a scheduling
policy does to throughput and time to first token, on a CPU, in seconds.

    python benchmarks/sim_serving.py [--concurrency 8,64,256] [--requests 2] \
        [--variant NAME:KEY=VALUE,KEY=VALUE ...] [--model KEY=VALUE ...] [--json OUT.json]

Each of `concurrency` clients sends a 512-token prompt for 256 tokens (ignore_eos) and sends the
next as soon as one finishes, until `requests` x concurrency requests are done: the shape of
`inferx-bench serve` in issue 4's table. The executor returns at once and charges a virtual
clock what the step would cost on the H200 for Qwen2.5-3B's shapes (STEP_MODEL_3B). This is a
model, not a measurement: it ranks scheduler settings before any GPU time is spent on them,
and the H200 decides. --model changes the step model (e.g. decode_ms_per_640=0.0056: the decode
attention twice as fast) to ask what a kernel change would be worth.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from commit_id import commit_id  # noqa: E402

from inferx_core.config import load_config  # noqa: E402
from inferx_core.engine import Engine  # noqa: E402
from inferx_core.interfaces import Executor, SchedulerOutput, StepResult  # noqa: E402
from inferx_core.sequence import SamplingParams  # noqa: E402

# ms a step for Qwen2.5-3B on the H200 (bf16, CUDA graphs), fitted to sessions 6-10's figures:
# a decode step is 2.51 ms at batch 1 and 3.21-3.25 at batch 64 with 640-token contexts; the
# attention's share grows with the context each decode reads; past ~192 tokens a step's GEMMs
# are compute-bound, ~9.3 µs a token (profile_prefill: 38.3 ms of GPU a 4096-token step of
# 512-token prompts; a 2048-token prompt's TTFT 21.5 ms). Sessions 8-9 had 7.8 µs here, which put
# c=64 at 15.2k tok/s against the 14.1k measured; 9.3 gives 14.5k.
# ride_ms (0 here): ms a token from 64 rows (past the decode GEMVs) to the knee; session 35
# measured 8B's prompt tokens beside 64 decodes at 18-24 µs each (benchmarks/ride_along.py).
STEP_MODEL_3B = {
    "fixed_ms": 2.5,
    "decode_ms_per_640": 0.0113,
    "knee": 192,
    "token_ms": 0.0093,
    "ride_ms": 0.0,
}


def step_ms(decodes_context: int, tokens: int, model: dict[str, float]) -> float:
    """Modeled GPU time of a step: decodes_context is the sum of its decodes' context lengths,
    tokens all the tokens it runs."""
    attention = model["decode_ms_per_640"] * decodes_context / 640
    ride = model["ride_ms"] * min(max(0, tokens - 64), max(0, model["knee"] - 64))
    compute = model["token_ms"] * max(0, tokens - model["knee"])
    return model["fixed_ms"] + attention + ride + compute


class ModeledExecutor(Executor):
    """Samples token 1000 for every sampling chunk at once and advances a virtual clock. It
    has no supports_overlap, so the engine runs one step at a time and each is charged once."""

    def __init__(self, model: dict[str, float]) -> None:
        self.num_kv_blocks, self.block_size = 200_000, 16
        self.model = model
        self.clock_ms = 0.0
        self.steps = 0

    def execute(self, out: SchedulerOutput) -> StepResult:
        decodes = sum(c.start + 1 for c in out.chunks if c.num_tokens == 1)
        tokens = sum(c.num_tokens for c in out.chunks)
        self.clock_ms += step_ms(decodes, tokens, self.model)
        self.steps += 1
        return StepResult([1000 for c in out.chunks if c.sample])


def simulate(
    concurrency: int,
    num_requests: int,
    overrides: dict[str, Any],
    model: dict[str, float] = STEP_MODEL_3B,
    input_len: int = 512,
    output_len: int = 256,
) -> dict[str, float]:
    """Output tok/s and mean TTFT (modeled ms) of a closed loop of `concurrency` clients."""
    config = load_config(None, {"scheduler.prefix_cache": False, **overrides})
    executor = ModeledExecutor(model)
    engine = Engine(config, executor=executor, tokenizer=None)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}

    def send() -> None:
        prompt = [rng.randrange(1000, 30000) for _ in range(input_len)]
        arrived[engine.add_request(prompt, params)] = executor.clock_ms

    for _ in range(min(concurrency, num_requests)):
        send()
    while engine.has_work():
        for out in engine.step():
            if out.request_id not in first and out.num_output_tokens:
                first[out.request_id] = executor.clock_ms
            if out.finished and len(arrived) < num_requests:
                send()
    seconds = executor.clock_ms / 1e3
    return {
        "output_tok_s": num_requests * output_len / seconds,
        "ttft_ms": sum(first[r] - arrived[r] for r in first) / len(first),
        "steps": executor.steps,
        "seconds": seconds,
    }


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """NAME:KEY=VALUE,KEY=VALUE -> (NAME, overrides)."""
    name, _, sets = text.partition(":")
    return name, dict(kv.split("=", 1) for kv in sets.split(",") if kv)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="8,64,256")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME:KEY=VALUE,... (default: 8192-, 2048- and 512-token steps)",
    )
    ap.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a what-if change to the step model, one of {sorted(STEP_MODEL_3B)}",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = dict(STEP_MODEL_3B)
    for kv in args.model:
        key, _, value = kv.partition("=")
        if key not in model:
            ap.error(f"--model {kv!r}: KEY must be one of {sorted(model)}")
        model[key] = float(value)
    variants = [parse_variant(v) for v in args.variant] or [
        (f"{n} tokens", {"scheduler.max_batched_tokens": n, "scheduler.prefill_chunk": n})
        for n in (8192, 2048, 512)
    ]
    rows = []
    print(f"{'clients':>7} {'requests':>8}  {'variant':<16} {'tok/s':>8} {'TTFT ms':>8} "
          f"{'steps':>6}")  # fmt: skip
    for c in (int(x) for x in args.concurrency.split(",")):
        for name, overrides in variants:
            r = simulate(c, c * args.requests, overrides, model)
            rows.append({"concurrency": c, "variant": name, "overrides": overrides, **r})
            print(f"{c:>7} {c * args.requests:>8}  {name:<16} {r['output_tok_s']:>8,.0f} "
                  f"{r['ttft_ms']:>8.1f} {r['steps']:>6}")  # fmt: skip
    if args.json:
        doc = {"commit": commit_id(), "model": model, "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
