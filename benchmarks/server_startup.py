"""Seconds from spawning `inferx-server` to its first 200 on /health, for config variants run in
alternation (start-up time varies run to run: compare rounds, not single runs). Each server then
answers one completion, so a ready server is also a working one.

    python benchmarks/server_startup.py [--rounds 3] [--variant "server.engine_process=true"]...
        [--set KEY=VALUE ...] [--json OUT.json]

With no --variant: the engine process and the thread (server.engine_process true, false).
Without --set model.* the server serves its built-in demo model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from commit_id import commit_id

from inferx_core.config import flag_name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flags(settings: list[str]) -> list[str]:
    out = []
    for kv in settings:
        key, value = kv.split("=", 1)
        out += [f"--{flag_name(key)}", value]
    return out


def time_to_ready(settings: list[str], timeout: float) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "inferx_server.cli", "--server-port", str(port), *flags(settings)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"inferx-server exited: {proc.stdout.read().decode()[-2000:]}")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"not ready in {timeout:.0f} s")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        ready = time.monotonic() - t0
        body = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(
            f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.load(r)["choices"][0]["text"] is not None
        return ready
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", help="space-separated KEY=VALUE settings")
    ap.add_argument("--set", action="append", default=[], help="config for every variant")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = args.variant or ["server.engine_process=true", "server.engine_process=false"]
    results: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants:
            s = time_to_ready(args.set + v.split(), args.timeout)
            results[v].append(s)
            print(f"round {r + 1}: {v}: ready in {s:.2f} s", flush=True)
    for v, times in results.items():
        print(f"{v}: {min(times):.2f}-{max(times):.2f} s over {len(times)} runs")
    if args.json:
        doc = {"commit": commit_id(), "set": args.set, "seconds": results}
        Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
