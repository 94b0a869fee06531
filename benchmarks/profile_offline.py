"""Where the offline throughput run's GPU time goes, kernel by kernel (issue 4's 256 x 512/256).

    python benchmarks/profile_offline.py --preset llama-3.1-8b-instruct --tokenizer DIR \
        [--num-prompts 256 --input-len 512 --output-len 256] [--runs 2] [--json OUT.json]

The run of `h200_table.py --only throughput` (max_batched_tokens = prefill_chunk 8192, prefix
cache off, kv_cache.memory 0.9): `--runs` times unprofiled (output tok/s), then once under
torch.profiler. From that trace, for the whole run: the GPU's busy time against the run's wall
time, its idle time by gap length and the longest gaps (what ran before and after each), and
the kernels grouped (GEMM, attention, norm, ...) and one by one, in ms a run. --set KEY=VALUE
for A/B runs of config keys, one process each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from commit_id import commit_id
from profile_decode import gaps, gpu_records, print_groups, print_kernels, trace_summary
from step_breakdown import offline_arguments, offline_workload
from torch.profiler import ProfilerActivity, profile

from inferx_core.bench_offline import sync
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """(seconds, output tokens) of one LLM.generate over every prompt."""
    device = llm.engine.executor.device
    sync(device)
    t0 = time.perf_counter()
    done = llm.generate(prompts, params)
    sync(device)
    return time.perf_counter() - t0, sum(len(d.token_ids) for d in done)


def longest_gaps(trace: Path, top: int) -> list[dict[str, Any]]:
    """The run's `top` longest stretches of an idle GPU: ms, ms into the run, and the GPU
    activities before and after."""
    recs = gpu_records(trace)
    if not recs:
        return []
    t0 = recs[0][0]
    rows = [
        {"ms": (b - a) / 1e3, "at_ms": (a - t0) / 1e3, "before": x[:50], "after": y[:50]}
        for a, b, x, y in gaps(recs)
    ]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser()
    offline_arguments(ap)
    ap.add_argument("--runs", type=int, default=2, help="unprofiled runs before the profiled one")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gpu = {"model.dtype": "bfloat16", "kv_cache.memory": 0.9} if torch.cuda.is_available() else {}
    llm, prompts, params = offline_workload(args, gpu)
    tok_s = []
    for _ in range(args.runs):
        seconds, tokens = timed_generate(llm, prompts, params)
        tok_s.append(tokens / seconds)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "offline.json"
        with profile(activities=activities) as prof:
            profiled_s, tokens = timed_generate(llm, prompts, params)
        prof.export_chrome_trace(str(trace))
        summary = trace_summary(trace, steps=1)  # one "step": the whole run, in µs
        longest = longest_gaps(trace, top=8)
    busy_ms = summary["gpu_busy_ms_per_step"]
    print(
        f"{args.preset}: {args.num_prompts} x {args.input_len}/{args.output_len}, unprofiled "
        f"{', '.join(f'{t:,.0f}' for t in tok_s)} output tok/s; profiled run {profiled_s:.2f} s, "
        f"GPU busy {busy_ms / 1e3:.2f} s ({100 * busy_ms / 1e3 / profiled_s:.1f}%), idle by gap "
        + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in summary["idle_us_per_step_by_gap"].items())
    )
    print("longest idle stretches (ms, ms into the run, before -> after):")
    for g in longest:
        print(f"  {g['ms']:8.2f} {g['at_ms']:9.1f}  {g['before']} -> {g['after']}")
    print("\nµs a run:")
    print_groups(summary["groups"])
    print_kernels(summary["kernels"], args.top)
    if args.json:
        doc = {
            "commit": commit_id(),
            "args": vars(args),
            "output_tok_s_unprofiled": tok_s,
            "profiled_s": profiled_s,
            "longest_gaps": longest,
            **summary,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
