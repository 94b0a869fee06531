"""Fault soak: random client disconnects and aborts under load, then the server must be idle.

Starts `inferx-server` (the demo model unless --server-args say otherwise) or uses --url, keeps
--concurrency clients busy with a mix of requests (streams dropped after a few chunks, n=3
streams dropped, non-streaming requests whose client gives up, complete requests, bad
requests) until --faults disconnects have happened, then checks from /metrics that no request
runs or waits and no KV block is in use, that a greedy answer is the same as before the soak,
and that the server's memory stayed flat. Prints a table; exits 1 if a check fails.

    python benchmarks/fault_soak.py                      # 1,000 faults on the demo model
    python benchmarks/fault_soak.py --faults 100 --json  # what CI runs (tests/test_fault_soak.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

PROMPTS = [
    "Tell me a long story about a lighthouse keeper.",
    "List every prime number you know, one per line.",
    "Explain how a steam engine works, step by step.",
    "Write a poem about the sea that never ends.",
]
KINDS = ["stream_drop", "stream_n_drop", "timeout_drop", "complete", "bad"]
WEIGHTS = [4, 1, 2, 2, 1]
FAULTS = {"stream_drop", "stream_n_drop", "timeout_drop"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def gauges(text: str) -> dict[str, float]:
    out = {}
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "num_aborted_requests_total"):  # fmt: skip
        m = re.search(rf"^inferx:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out


async def one(c: httpx.AsyncClient, url: str, model: str, kind: str, rng: random.Random) -> str:
    """Runs one request of `kind`; returns what happened."""
    prompt = rng.choice(PROMPTS)
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": rng.randint(16, 64), "temperature": 0.8}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if kind == "bad":
        r = await c.post(url + path, json={**body, "temperature": -1})
        return "bad_400" if r.status_code == 400 else f"bad_{r.status_code}"
    if kind in ("stream_drop", "stream_n_drop"):
        body.update(stream=True, max_tokens=256)
        if kind == "stream_n_drop":
            body["n"] = 3
        keep = rng.randint(1, 6)
        async with c.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return f"{kind}_{r.status_code}"
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= keep:
                    return kind  # leaving the block closes the connection mid-stream
        return f"{kind}_finished_first"
    if kind == "timeout_drop":
        body["max_tokens"] = 256
        try:
            await asyncio.wait_for(c.post(url + path, json=body), rng.uniform(0.05, 0.6))
        except TimeoutError:
            return kind
        return f"{kind}_finished_first"
    r = await c.post(url + path, json=body)
    return "complete" if r.status_code == 200 else f"complete_{r.status_code}"


async def greedy(c: httpx.AsyncClient, url: str, model: str) -> str:
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16,
            "temperature": 0}  # fmt: skip
    r = await c.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def soak(url: str, pid: int | None, faults: int, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    # Each client uses a connection of its own: a dropped one is never reused.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        model = (await c.get(url + "/v1/models")).json()["data"][0]["id"]
        before = await greedy(c, url, model)
        counts: Counter[str] = Counter()
        done_faults = 0
        rss: list[float] = []
        warm = max(1, faults // 5)

        async def client() -> None:
            nonlocal done_faults
            while done_faults < faults:
                kind = rng.choices(KINDS, WEIGHTS)[0]
                what = await one(c, url, model, kind, rng)
                counts[what] += 1
                if what in FAULTS:
                    done_faults += 1
                    if pid is not None and done_faults in (warm, faults):
                        rss.append(rss_mib(pid))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        deadline = time.monotonic() + 15
        while True:  # the server frees what the last clients left at its next steps
            g = gauges((await c.get(url + "/metrics")).text)
            idle = g["num_requests_running"] == g["num_requests_waiting"] == 0
            if (idle and g["kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        after = await greedy(c, url, model)
        if pid is not None:
            rss.append(rss_mib(pid))
    return {
        "faults": done_faults,
        "requests": sum(counts.values()),
        "outcomes": dict(sorted(counts.items())),
        "seconds": round(elapsed, 1),
        "running": g["num_requests_running"],
        "waiting": g["num_requests_waiting"],
        "kv_usage": g["kv_cache_usage_perc"],
        "aborted": g["num_aborted_requests_total"],
        "greedy_same": before == after,
        "rss_mib": [round(r, 1) for r in rss],
    }


def check(r: dict, max_growth_mib: float) -> list[str]:
    bad = [f"{k} {r[k]}" for k in ("running", "waiting", "kv_usage") if r[k] != 0]
    if not r["greedy_same"]:
        bad.append("greedy answer changed after the soak")
    odd = [k for k in r["outcomes"] if k not in FAULTS | {"complete", "bad_400"}]
    bad += [f"unexpected outcome {k} x{r['outcomes'][k]}" for k in odd if "finished_first" not in k]
    if len(r["rss_mib"]) >= 2 and r["rss_mib"][-1] - r["rss_mib"][0] > max_growth_mib:
        bad.append(f"server memory grew {r['rss_mib'][0]} -> {r['rss_mib'][-1]} MiB")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (default: start inferx-server here)")
    ap.add_argument("--faults", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-growth-mib", type=float, default=64.0,
        help="memory the server may gain from the end of warm-up to the end",
    )  # fmt: skip
    ap.add_argument(
        "--server-args", default="--max-model-len 512",
        help="flags for the inferx-server this script starts",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    proc = None
    url, pid = args.url, None
    if url is None:
        cmd = [sys.executable, "-m", "inferx_server.cli", "--port", "0", *args.server_args.split()]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = proc.stdout.readline()  # the "listening on URL" line, once loaded
        if "listening on " not in line:
            print(f"server did not start: {line!r}", file=sys.stderr)
            return 1
        url, pid = line.rsplit(" ", 1)[1].strip(), proc.pid
    try:
        r = asyncio.run(soak(url, pid, args.faults, args.concurrency, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    problems = check(r, args.max_growth_mib)
    if args.json:
        print(json.dumps({**r, "problems": problems}))
    else:
        print("| faults | requests | s | running | waiting | KV in use | aborted | greedy same "
              "| RSS MiB (warm -> end) |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {r['faults']} | {r['requests']} | {r['seconds']} | {r['running']:g} | "
              f"{r['waiting']:g} | {r['kv_usage']:g} | {r['aborted']:g} | {r['greedy_same']} | "
              f"{' -> '.join(map(str, r['rss_mib']))} |")  # fmt: skip
        print("outcomes:", r["outcomes"])
        for p in problems:
            print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
