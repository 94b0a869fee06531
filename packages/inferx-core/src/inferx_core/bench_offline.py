"""Offline benchmarks of the engine itself, no HTTP: `inferx-bench latency` and `throughput`.

latency: batch-1 decode ms per output token (and the weight-bandwidth floor beside it), time to
first token for given prompt lengths. throughput: N random prompts of fixed input/output length
through the engine at once, output tokens per second. Both print a table and can write JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from typing import Any

import torch

from inferx_core.cli import add_config_flags, config_from_args
from inferx_core.engine import LLM
from inferx_core.sequence import SamplingParams


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), before or after a timed span."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, bytes read plus bytes written: the rate a
    weight-streaming decode step can hope for."""
    if device.type != "cuda":
        nbytes = 1 << 27
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def random_prompt(vocab: int, n: int, rng: random.Random) -> list[int]:
    # Stay clear of the first ids (special tokens in most vocabularies).
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def weight_bytes(model: torch.nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in model.parameters():  # every parameter once (a tied head is the embedding)
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def run_latency(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    ex = llm.engine.executor
    device = ex.device
    vocab = int(ex.hf_config["vocab_size"])
    rng = random.Random(0)
    out: dict[str, Any] = {}
    # Batch-1 decode: time between the first and the last token of one request.
    prompt = random_prompt(vocab, args.input_len, rng)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    per_token = []
    for _ in range(args.runs):
        first = last = None
        for _ in llm.stream(prompt, params):
            now = time.perf_counter()
            first = first or now
            last = now
        per_token.append((last - first) / (args.output_len - 1))
    decode = sorted(per_token)[len(per_token) // 2]
    wbytes = weight_bytes(ex.model)
    bw = copy_bandwidth(device)
    out["decode_ms_per_token"] = decode * 1e3
    out["weight_gb"] = wbytes / 1e9
    out["copy_bandwidth_tb_s"] = bw / 1e12
    out["floor_ms_per_token"] = wbytes / bw * 1e3
    # Time to first token for long prompts (one request, max_tokens=1).
    for n in args.ttft_lens:
        if n + 1 > llm.engine.max_model_len:
            continue
        p = random_prompt(vocab, n, rng)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate(p, one)  # warm, then fresh prompts so the prefix cache cannot help
        times = []
        for _ in range(args.runs):
            p = random_prompt(vocab, n, rng)
            sync(device)
            t0 = time.perf_counter()
            llm.generate(p, one)
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        out[f"ttft_ms_{n}"] = t * 1e3
        out[f"prefill_tok_s_{n}"] = n / t
    return out


def run_throughput(llm: LLM, args: argparse.Namespace) -> dict[str, Any]:
    vocab = int(llm.engine.executor.hf_config["vocab_size"])
    rng = random.Random(1)
    prompts = [random_prompt(vocab, args.input_len, rng) for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    done = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(d.token_ids) for d in done)
    return {
        "num_prompts": args.num_prompts,
        "elapsed_s": elapsed,
        "output_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + args.num_prompts * args.input_len) / elapsed,
        "requests_s": args.num_prompts / elapsed,
    }


def main(argv: list[str] | None = None, mode: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=f"inferx-bench {mode or ''}".strip(), description=__doc__)
    if mode is None:
        ap.add_argument("mode", choices=["latency", "throughput"])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--ttft-lens", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    add_config_flags(ap)
    args = ap.parse_args(argv)
    mode = mode or args.mode
    t0 = time.perf_counter()
    llm = LLM(config_from_args(args))
    ready = time.perf_counter() - t0
    result = run_latency(llm, args) if mode == "latency" else run_throughput(llm, args)
    ex = llm.engine.executor
    meta = {
        "mode": mode,
        "model": llm.engine.config.model.path or llm.engine.config.model.preset or "demo",
        "device": torch.cuda.get_device_name(ex.device)
        if ex.device.type == "cuda"
        else platform.processor() or platform.machine(),
        "dtype": str(ex.dtype).removeprefix("torch."),
        "attention_backend": type(ex.attention).__name__,
        "commit": os.environ.get("INFERX_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "startup_s": ready,
        "startup_parts_s": ex.report.seconds,
        "input_len": args.input_len,
        "output_len": args.output_len,
    }
    print(" ".join(f"{k}={v}" for k, v in meta.items() if k != "startup_parts_s"))
    for key, value in result.items():
        print(f"  {key:<24} {value:>12.3f}" if isinstance(value, float) else f"  {key:<24} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**meta, **result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
