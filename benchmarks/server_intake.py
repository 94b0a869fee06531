"""What a burst of requests costs the server before the engine sees them: time to first token
when N clients send a 512-token prompt at once, as text (the server tokenizes it) and as token
ids (it does not), over the real engine with an executor that sleeps a few ms a step.

    python benchmarks/server_intake.py --tokenizer DIR [--clients 64] [--rounds 3]
        [--step-ms 3] [--json OUT.json]

The gap between the two is the server's intake: tokenizing and submitting. Issue 4's serving
rows send text (inferx-bench serve --tokenizer), 64-256 prompts at once at the start of a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from commit_id import commit_id  # noqa: E402

from inferx_core.tokenizer import Tokenizer  # noqa: E402
from inferx_server.bench import exact_texts, sse_post  # noqa: E402

SERVER = """
import logging, sys
from inferx_core.config import load_config
from inferx_core.engine import Engine
from inferx_core.tokenizer import Tokenizer
from inferx_server.bench import SleepExecutor
from inferx_server.transport import LitestarTransport

tokenizer, step_ms = sys.argv[1], float(sys.argv[2])
config = load_config(None, {
    "server.port": 0, "server.drain_timeout": 0, "server.engine_process": False,
    "scheduler.max_running": 256, "scheduler.max_batched_tokens": 8192,
    "scheduler.prefill_chunk": 8192, "scheduler.prefix_cache": False,
})
executor = SleepExecutor(step_ms / 1000)
executor.max_model_len = 8192
engine = Engine(config, executor=executor, tokenizer=Tokenizer.from_dir(tokenizer))
logging.getLogger("inferx.server").setLevel(logging.ERROR)
LitestarTransport(engine, config).serve(on_ready=lambda url: print(url, flush=True))
"""


async def burst(url: str, prompts: list) -> list[float]:
    """Seconds to the first streamed token of each prompt, all sent at once."""

    async def one(prompt: object) -> float:
        t0 = time.perf_counter()
        body = {"model": "model", "prompt": prompt, "max_tokens": 2, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async for _ in sse_post(url + "/v1/completions", body):
            return time.perf_counter() - t0
        raise RuntimeError("the stream ended without a token")

    await one(prompts[0])  # a warm-up request
    return list(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=3.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    tok = Tokenizer.from_dir(args.tokenizer)
    kinds = {
        "text": exact_texts(tok, args.input_len, args.clients, rng),
        "ids": [
            [rng.randrange(1000, 20000) for _ in range(args.input_len)] for _ in range(args.clients)
        ],  # fmt: skip
    }
    cmd = [sys.executable, "-c", SERVER, args.tokenizer, str(args.step_ms)]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        for r in range(args.rounds):
            for kind, prompts in kinds.items():
                ttft = asyncio.run(burst(url, prompts))
                row = {"round": r + 1, "prompts": kind, "ttft_mean_ms": statistics.mean(ttft) * 1e3,
                       "ttft_max_ms": max(ttft) * 1e3}  # fmt: skip
                rows.append(row)
                print(f"round {r + 1}: {args.clients} x {args.input_len}-token {kind:<4} prompts "
                      f"at once: TTFT mean {row['ttft_mean_ms']:.1f} ms, max "
                      f"{row['ttft_max_ms']:.1f}")  # fmt: skip
    finally:
        server.terminate()
        server.wait(30)
    if args.json:
        doc = {"commit": commit_id(), "args": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
