"""Python's collections during the table's offline figures on a real engine (the GPU's run).

    python benchmarks/offline_gc.py --tokenizer DIR [--preset llama-3.1-8b-instruct] [--runs 3]
        [--freeze] [--skip-latency] [--json OUT.json]

One engine, the figures in h200_table.py's order (decode, ttft, then the 256 x 512 / 256
throughput run `--runs` times), with a gc callback timing every collection. Per throughput run:
tok/s and the collections of each generation inside it (count, total ms; generation 2's start
and length), then what the collector still tracks (generation sizes, the frozen count, the
commonest types in generation 2). --freeze calls engine.freeze_heap() before each run (is a
collection in the run what an earlier figure left?). engine_gc_pauses.py measures the host side
alone, on the CPU, with a random-token executor.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
from h200_table import Sizes, fig_decode, fig_throughput, fig_ttft

from inferx_core.config import load_config
from inferx_core.engine import LLM, freeze_heap

Event = tuple[int, float, float, int]  # generation, start (perf_counter), ms, collected


class Collections:
    """A gc callback that records every collection while installed."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._start) * 1e3
            self.events.append((info["generation"], self._start, ms, info["collected"]))


def summarize(events: list[Event], t0: float) -> dict[str, Any]:
    """Per generation: collections and their total ms; generation 2's (s into the span, ms,
    objects collected) one by one."""
    gens = {g: [e for e in events if e[0] == g] for g in range(3)}
    return {
        "collections": {g: len(v) for g, v in gens.items()},
        "ms_total": {g: round(sum(e[2] for e in v), 2) for g, v in gens.items()},
        "gen2": [(round(e[1] - t0, 3), round(e[2], 2), e[3]) for e in gens[2]],
    }


def census() -> dict[str, Any]:
    objs = gc.get_objects(2)
    return {
        "counts": gc.get_count(),
        "sizes": [len(gc.get_objects(i)) for i in range(3)],
        "frozen": gc.get_freeze_count(),
        "gen2_types": collections.Counter(type(o).__name__ for o in objs).most_common(10),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-3.1-8b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--freeze", action="store_true", help="freeze_heap() before each run")
    ap.add_argument("--skip-latency", action="store_true", help="only the throughput runs")
    ap.add_argument("--json")
    a = ap.parse_args()
    overrides = {
        "model.preset": a.preset,
        "model.tokenizer": a.tokenizer,
        "kv_cache.memory": "0.9" if torch.cuda.is_available() else "256MiB",
        "scheduler.max_batched_tokens": "8192",
        "scheduler.prefill_chunk": "8192",
        "scheduler.prefix_cache": "false",
    }
    llm = LLM(load_config(None, overrides))
    doc: dict[str, Any] = {"preset": a.preset, "freeze": a.freeze, "ready": census(), "runs": []}
    record = Collections()
    gc.callbacks.append(record)
    sizes = Sizes()
    if not a.skip_latency:
        fig_decode(llm, sizes)
        fig_ttft(llm, sizes)
        doc["after_latency"] = census()
    for r in range(a.runs):
        if a.freeze:
            freeze_heap()
        record.events.clear()
        t0 = time.perf_counter()
        res = fig_throughput(llm, sizes)
        row = {"output_tok_s": res["output_tok_s"], "elapsed_s": res["elapsed_s"]}
        row |= summarize(record.events, t0) | {"after": census()}
        doc["runs"].append(row)
        print(
            f"run {r}: {row['output_tok_s']:,.0f} tok/s; collections {row['collections']}, "
            f"ms {row['ms_total']}; generation 2 (s, ms, collected) {row['gen2']}; "
            f"after: sizes {row['after']['sizes']}, frozen {row['after']['frozen']}",
            flush=True,
        )
    gc.callbacks.remove(record)
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
