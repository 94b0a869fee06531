"""Where prefill steps spend their time: the kernels of the steps that prefill a batch of prompts.

    python benchmarks/profile_prefill.py --preset llama-3.1-8b-instruct --tokenizer DIR \
        [--prompts 16] [--prompt-len 512] [--chunk 8192] [--json OUT.json]

`--prompts` prompts of `--prompt-len` tokens arrive at once, with scheduler.max_batched_tokens
and scheduler.prefill_chunk set to `--chunk` (the offline benchmark's 8192: 16 prompts of 512
are one step), prefix caching off. The steps until every prompt has its first token run under
torch.profiler, after one unprofiled round of the same shape (kernels compiled, caches warm).
It prints the steps and their wall time, prefill tok/s and the GEMM rate it implies (2 x
parameters per token; attention not counted), the GPU's busy time, and the kernels grouped
(GEMM, attention, norm, rotary + KV write, SiLU-and-mul, copies, other), then one by one,
largest first.
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
from profile_decode import print_groups, print_kernels, trace_summary, with_sets
from torch.profiler import ProfilerActivity, profile

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


def gemm_tflops(params: int, tokens: int, seconds: float) -> float:
    """The dense-layer FLOP rate a prefill of `tokens` in `seconds` implies: 2 x params a token."""
    return 2.0 * params * tokens / seconds / 1e12


def run_prefill(llm: LLM, prompts: list[list[int]]) -> int:
    """Add every prompt, step until each has its first token, abort them; the steps taken."""
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]

    def waiting() -> bool:  # a request that already finished is gone from engine.requests
        return any(i in engine.requests and engine.requests[i].seq.num_output == 0 for i in ids)

    steps = 0
    while waiting():
        engine.step()
        steps += 1
    for i in ids:
        if i in engine.requests:
            engine.abort(i)
    return steps


def profile_prefill(llm: LLM, prompts: list[list[int]], trace_dir: Path) -> dict[str, Any]:
    run_prefill(llm, prompts)  # warm: the same shapes once, unprofiled
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run_prefill(llm, prompts)
    sync()
    plain_s = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    trace = trace_dir / "prefill.json"
    with profile(activities=activities) as prof:
        steps = run_prefill(llm, prompts)
        sync()
    prof.export_chrome_trace(str(trace))
    tokens = sum(len(p) for p in prompts)
    model_params = sum(p.numel() for p in llm.engine.executor.model.parameters())
    return {
        "prompts": len(prompts),
        "prompt_len": len(prompts[0]),
        "steps": steps,
        "seconds_unprofiled": plain_s,
        "prefill_tok_s": tokens / plain_s,
        "gemm_tflops": gemm_tflops(model_params, tokens, plain_s),
        "params": model_params,
        **trace_summary(trace, steps),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-3.1-8b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-memory", default="20GiB", help="kv_cache.memory")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], help="extra config KEY=VALUE")
    args = ap.parse_args()
    overrides = {
        "model.preset": args.preset,
        "model.tokenizer": args.tokenizer,
        "model.dtype": args.dtype,
        "kv_cache.memory": args.kv_memory,
        "engine.attention_backend": args.backend,
        "scheduler.max_batched_tokens": args.chunk,
        "scheduler.prefill_chunk": args.chunk,
        "scheduler.prefix_cache": False,  # the rounds repeat the prompts
    }
    llm = LLM(load_config(None, with_sets(overrides, args.set)))
    vocab = int(llm.engine.executor.hf_config["vocab_size"])
    prompts = [
        [(1000 + 7 * i + j) % vocab for j in range(args.prompt_len)] for i in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        r = profile_prefill(llm, prompts, Path(tmp))
    print(
        f"{r['prompts']} prompts x {r['prompt_len']} tokens in {r['steps']} steps: "
        f"{r['seconds_unprofiled'] * 1e3:.1f} ms unprofiled, {r['prefill_tok_s']:,.0f} tok/s, "
        f"{r['gemm_tflops']:.0f} TFLOPS of dense layers ({r['params'] / 1e9:.2f} B params); "
        f"GPU idle {100 * r['gpu_idle_fraction']:.1f}% of {r['gpu_window_ms_per_step']:.2f} "
        "ms a step"
    )
    print_groups(r["groups"])
    print_kernels(r["kernels"], args.top)
    doc = {"args": vars(args), "commit": commit_id(), "result": r}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
