"""Where a batch-1 decode step spends its time: torch.profiler over a short greedy run.

    python benchmarks/profile_decode.py --preset qwen2.5-3b-instruct --tokenizer DIR \
        --backend triton [--batch 1] [--tokens 16]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from inferx_core.config import load_config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-3b-instruct")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    llm = LLM(
        load_config(
            None,
            {
                "model.preset": args.preset,
                "model.tokenizer": args.tokenizer,
                "model.dtype": "bfloat16",
                "kv_cache.memory": "20GiB",
                "engine.attention_backend": args.backend,
            },
        )
    )
    prompts = [list(range(1000 + i, 1128 + i)) for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)
    ex = llm.engine.executor
    # Split one decode step: engine overhead vs the executor vs the forward alone.
    rid = llm.engine.add_request(
        prompts[0], SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    )
    llm.engine.step()  # prefill
    t_step, t_exec, t_fwd = [], [], []
    real_execute, real_forward = ex.execute, ex.model.forward

    def timed_execute(out):
        t0 = time.perf_counter()
        r = real_execute(out)
        t_exec.append(time.perf_counter() - t0)
        return r

    def timed_forward(*a):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = real_forward(*a)
        torch.cuda.synchronize()
        t_fwd.append(time.perf_counter() - t0)
        return r

    ex.execute, ex.model.forward = timed_execute, timed_forward
    for _ in range(32):
        t0 = time.perf_counter()
        llm.engine.step()
        t_step.append(time.perf_counter() - t0)
    ex.execute, ex.model.forward = real_execute, real_forward
    llm.engine.abort(rid)
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    print(
        f"median ms: step {med(t_step):.2f}  execute {med(t_exec):.2f}  "
        f"forward(synced) {med(t_fwd):.2f}"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
