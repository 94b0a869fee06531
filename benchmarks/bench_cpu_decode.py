"""CPU decode speed of the demo model: InferX against transformers' generate, same threads.

python benchmarks/bench_cpu_decode.py --threads 2 --new-tokens 64 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from commit_id import commit_id

from inferx_core.config import Config
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams

QUESTION = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def bench_inferx(new_tokens: int, runs: int) -> dict:
    llm = LLM(Config())
    prompt = llm.chat_prompt(QUESTION)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))  # warm-up
    times = []
    for _ in range(runs):
        first = None
        t0 = time.perf_counter()
        n = 0
        for out in llm.stream(prompt, params):
            n += len(out.token_ids)
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        times.append(((first - t0), (end - first) / max(n - 1, 1)))
    return _summary("inferx", times, len(prompt), new_tokens)


def bench_transformers(new_tokens: int, runs: int) -> dict:
    import transformers

    from inferx_models.gguf import find_demo_gguf

    path = find_demo_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = tok.apply_chat_template(
        QUESTION, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    kw = dict(
        attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    times = []
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, **kw)  # warm-up
        for _ in range(runs):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kw)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, **kw)
            total = time.perf_counter() - t0
            times.append((ttft, (total - ttft) / (new_tokens - 1)))
    return _summary("transformers " + transformers.__version__, times, ids.shape[1], new_tokens)


def _summary(name: str, times: list[tuple[float, float]], prompt_len: int, new: int) -> dict:
    ttft = sorted(t for t, _ in times)[len(times) // 2]
    tpot = sorted(t for _, t in times)[len(times) // 2]
    return {
        "engine": name,
        "prompt_tokens": prompt_len,
        "new_tokens": new,
        "ttft_ms": round(ttft * 1e3, 2),
        "decode_ms_per_token": round(tpot * 1e3, 2),
        "decode_tok_s": round(1 / tpot, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [
        bench_inferx(args.new_tokens, args.runs),
        bench_transformers(args.new_tokens, args.runs),
    ]
    sha = commit_id()
    print(
        f"demo model SmolLM2-135M-Instruct (fp32, CPU, {args.threads} threads), "
        f"commit {sha}, {platform.processor() or platform.machine()}"
    )
    print(f"{'engine':<22} {'prompt':>6} {'new':>4} {'TTFT ms':>8} {'ms/token':>9} {'tok/s':>7}")
    for r in rows:
        print(
            f"{r['engine']:<22} {r['prompt_tokens']:>6} {r['new_tokens']:>4} {r['ttft_ms']:>8} "
            f"{r['decode_ms_per_token']:>9} {r['decode_tok_s']:>7}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": sha, "threads": args.threads, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
