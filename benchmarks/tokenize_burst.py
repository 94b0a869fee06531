"""What tokenizing a c=8 round's burst costs on this host: 8 prompts of 512 tokens (text as
`inferx-bench serve` sends it), encoded the way the server does (tokenizers' encode_batch_fast
of one text a call) one after another, on 8 threads at once (the server's worker threads), on 8
threads after 0.3 s idle (as between rounds), in one encode_batch_fast call of all 8, and on 8
worker processes.

    python benchmarks/tokenize_burst.py --tokenizer DIR [--rounds 3] [--json OUT.json]

Run it with TOKENIZERS_PARALLELISM=true and =false: the library's own thread pool changes
both the single-text and the concurrent times. The worker processes are forked after this
process has tokenized, so tokenizers turns its thread pool off in them (as in a server that
forks its workers once it has a tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from commit_id import commit_id

from inferx_core.tokenizer import Tokenizer
from inferx_server.bench import exact_texts

_backend: Any = None  # the tokenizers object _encode uses: this process's, or a worker's own


def _load(path: str) -> Tokenizer:
    global _backend
    tok = Tokenizer.from_dir(path)
    _backend = tok.backend
    return tok


def _encode(text: str) -> list[int]:
    return _backend.encode_batch_fast([text], add_special_tokens=False)[0].ids


def _ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tok = _load(args.tokenizer)  # one tokenizer for every variant run in this process
    n = args.prompts
    threads = ThreadPoolExecutor(n)
    procs = ProcessPoolExecutor(n, initializer=_load, initargs=(args.tokenizer,))
    list(procs.map(_encode, exact_texts(tok, args.prompt_len, 2 * n, random.Random(0))))
    list(threads.map(_encode, exact_texts(tok, args.prompt_len, 2 * n, random.Random(1))))
    rounds = []
    for r in range(args.rounds):
        one_by_one, at_once, idle, batch, workers = (
            exact_texts(tok, args.prompt_len, n, random.Random(1000 * k + r)) for k in range(1, 6)
        )
        row = {
            "serial_ms": _ms(lambda t=one_by_one: [_encode(x) for x in t]),
            "threads_ms": _ms(lambda t=at_once: list(threads.map(_encode, t))),
        }
        time.sleep(0.3)
        row["threads_after_idle_ms"] = _ms(lambda t=idle: list(threads.map(_encode, t)))
        row["one_call_ms"] = _ms(
            lambda t=batch: _backend.encode_batch_fast(t, add_special_tokens=False)
        )
        row["processes_ms"] = _ms(lambda t=workers: list(procs.map(_encode, t)))
        rounds.append(row)
        print(f"round {r}: {n} prompts of {args.prompt_len} tokens, ms: " + ", ".join(
            f"{k[:-3]} {v:.2f}" for k, v in row.items()))  # fmt: skip
    threads.shutdown()
    procs.shutdown()
    if args.json:
        meta = {"commit": commit_id(), "cpus": os.cpu_count(),
                "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM")}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "args": vars(args), "rounds": rounds}))


if __name__ == "__main__":
    main()
