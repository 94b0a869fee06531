"""The engine's own host work per decode step (scheduler, update, detokenizing, outputs) with a
trivial executor, so the number is what the CPU spends beside the GPU at a given batch.

    python benchmarks/bench_engine_host.py --tokenizer ../shared/fixtures/tokenizers/qwen \
        [--batch 256] [--steps 100] [--runs 3] [--text incremental|final]

--text final: the requests' text is decoded once when they finish (LLM.generate's way), not
streamed token by token (a server's).

With overlap this work runs while the GPU computes a step; it must stay under the GPU's step
time (5.3 ms at batch 256 for Qwen2.5-3B shapes on an H200) or the GPU waits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from inferx_core.config import load_config
from inferx_core.engine import Engine
from inferx_core.interfaces import Executor, SchedulerOutput, StepResult
from inferx_core.sequence import SamplingParams
from inferx_core.tokenizer import Tokenizer


class InstantExecutor(Executor):
    """Samples a random token per sampling chunk at once: no model, no device."""

    def __init__(self, seed: int = 0) -> None:
        self.num_kv_blocks, self.block_size = 60_000, 16
        self.rng = random.Random(seed)

    def execute(self, out: SchedulerOutput) -> StepResult:
        return StepResult([self.rng.randrange(1000, 30000) for c in out.chunks if c.sample])


def run_once(tok: Tokenizer, batch: int, steps: int, stream_text: bool = True) -> float:
    config = load_config(
        None,
        {
            "scheduler.max_batched_tokens": 8192,
            "scheduler.prefill_chunk": 8192,
            "scheduler.prefix_cache": False,
            "scheduler.max_running": max(batch, 1),
        },
    )
    engine = Engine(config, executor=InstantExecutor(), tokenizer=tok)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0)
    for _ in range(batch):
        prompt = [rng.randrange(1000, 50000) for _ in range(512)]
        engine.add_request(prompt, params, stream_text=stream_text)
    while any(r.seq.num_output == 0 for r in engine.requests.values()):
        engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--text", choices=["incremental", "final"], default="incremental")
    args = ap.parse_args()
    tok = Tokenizer.from_dir(args.tokenizer)
    stream_text = args.text == "incremental"
    times = [run_once(tok, args.batch, args.steps, stream_text) for _ in range(args.runs)]
    print(
        f"engine host work at batch {args.batch}, {args.text} text: median "
        f"{statistics.median(times):.2f} ms/step "
        f"over {args.runs} runs of {args.steps} steps ({', '.join(f'{t:.2f}' for t in times)})"
    )


if __name__ == "__main__":
    main()
