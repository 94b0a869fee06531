"""`inferx-bench`: the load client for any OpenAI-compatible server, and the transport benchmark.

`inferx-bench serve` streams requests of exact input/output lengths at a fixed concurrency or a
Poisson rate and reports TTFT, TPOT, ITL, request and output throughput. `inferx-bench
transport` measures our HTTP layer alone: a server whose engine is a stub that emits a token per
stream per step, with the emission time in the token's text, so the client sees the latency
the transport adds to every token. The HTTP client is a few lines of asyncio rather than httpx:
at tens of thousands of events per second the client must not be what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.decode


class HTTPError(Exception):
    pass


_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Connections:
    """Idle connections a load run keeps open for its next requests (HTTP/1.1 keep-alive), as
    vLLM's `bench serve` and OpenAI's SDK do: a request then costs no TCP connect, and the server
    no new connection, at every wave of a closed loop."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], list[_Conn]] = {}

    def take(self, key: tuple[str, int]) -> _Conn | None:
        conns = self.idle.get(key)
        return conns.pop() if conns else None

    def give_back(self, key: tuple[str, int], conn: _Conn) -> None:
        self.idle.setdefault(key, []).append(conn)

    def close(self) -> None:
        for conns in self.idle.values():
            for _, writer in conns:
                writer.close()
        self.idle.clear()


async def sse_post(
    url: str, body: dict[str, Any], api_key: str | None = None, pool: Connections | None = None
) -> AsyncIterator[tuple[float, bytes]]:
    """POST `body` as JSON and yield (arrival time, data) per server-sent event. http:// only.
    With a pool the connection is taken from it and, once the response was read to its end,
    given back to it; without one it is opened for this request and closed after it."""
    u = urlsplit(url)
    key = (u.hostname or "", u.port or 80)
    payload = json.dumps(body).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    request = (
        f"POST {u.path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n{auth}"
        f"Connection: {'keep-alive' if pool else 'close'}\r\n\r\n".encode()
        + payload
    )
    conn = pool.take(key) if pool else None
    if conn is not None:
        try:  # an idle connection the server may have closed meanwhile: then a fresh one
            conn[1].write(request)
            head = await conn[0].readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError):
            conn[1].close()
            conn = None
    if conn is None:
        conn = await asyncio.open_connection(*key)
        conn[1].write(request)
        head = await conn[0].readuntil(b"\r\n\r\n")
    reader, writer = conn
    finished = False  # the response read to its end: the connection can carry another
    try:
        status = int(head.split(b" ", 2)[1])
        lower = head.lower()
        chunked = b"transfer-encoding: chunked" in lower
        length = re.search(rb"content-length: *(\d+)", lower)
        if status != 200:
            raise HTTPError(f"HTTP {status}: {(await reader.read(2000)).decode(errors='replace')}")
        buf = b""
        left = int(length.group(1)) if length and not chunked else -1
        while True:
            if chunked:
                size = int((await reader.readuntil(b"\r\n")).strip() or b"0", 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # the (empty) trailer's end
                    finished = True
                    return
                data = (await reader.readexactly(size + 2))[:-2]
            elif left == 0:
                finished = True
                return
            else:
                data = await reader.read(65536 if left < 0 else min(left, 65536))
                if not data:
                    return
                left -= len(data) if left > 0 else 0
            now = time.monotonic()
            buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield now, event[6:]
    finally:
        if finished and pool is not None and b"connection: close" not in lower:
            pool.give_back(key, conn)
        else:
            writer.close()


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "mean": statistics.fmean(values) * scale,
        "median": statistics.median(values) * scale,
        "p99": p99 * scale,
    }


# -- serve: the load client -----------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[Any]:
    """Prompts of exactly --input-len tokens, the first --shared-prefix-len shared by all.

    With --tokenizer they are text that re-encodes to that many tokens; without, token ids
    (which /v1/completions accepts on our server and vLLM's).
    """
    prefix_len = min(args.shared_prefix_len, args.input_len)
    if args.tokenizer is None:
        if args.endpoint == "chat":
            raise SystemExit("error: --endpoint chat needs --tokenizer (prompts must be text)")
        prefix = [rng.randrange(1000, 20000) for _ in range(prefix_len)]
        return [
            prefix + [rng.randrange(1000, 20000) for _ in range(args.input_len - prefix_len)]
            for _ in range(args.num_prompts)
        ]
    from inferx_core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(args.tokenizer)
    return exact_texts(tok, args.input_len, args.num_prompts, rng, prefix_len)


def exact_texts(tok: Any, n: int, count: int, rng: random.Random, prefix_len: int = 0) -> list[str]:
    """`count` texts that `tok` encodes to exactly n tokens as a server counts them (special
    tokens included), the first `prefix_len` the same in all: random whole words, each one
    vocabulary entry with its leading space, which byte-level BPE never merges across. (Random
    token ids decoded to text rarely encode back to as many once prompts are long.)"""
    vocab = tok.backend.get_vocab(with_added_tokens=False)
    candidates = sorted(i for s, i in vocab.items() if re.fullmatch(r"[Ġ▁][a-z]{3,}", s))
    texts = [tok.decode([i]) for i in candidates]
    encoded = tok.backend.encode_batch(texts, add_special_tokens=False)
    words = [
        i
        for i, t, e in zip(candidates, texts, encoded, strict=True)
        if re.fullmatch(r" [a-z]{3,}", t) and e.ids == [i]
    ]
    if len(words) < 100:
        raise SystemExit(f"error: the tokenizer has too few whole-word tokens ({len(words)})")
    special = len(tok.encode("hello")) - len(tok.encode("hello", add_special_tokens=False))
    body = n - special
    if body < max(prefix_len, 1):
        raise SystemExit(f"error: {n} tokens leave no room for a prompt after special tokens")
    prefix = tok.decode(rng.choices(words, k=prefix_len)) if prefix_len else ""
    out = []
    for _ in range(count):
        for _ in range(20):
            text = prefix + tok.decode(rng.choices(words, k=body - prefix_len))
            if len(tok.encode(text)) == n:
                out.append(text)
                break
        else:
            raise SystemExit(f"error: found no text of exactly {n} tokens with this tokenizer")
    return out


async def one_request(
    args: argparse.Namespace, prompt: Any, pool: Connections | None = None
) -> RequestResult:
    body: dict[str, Any] = {
        "model": args.model, "max_tokens": args.output_len, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0,
    }  # fmt: skip
    if getattr(args, "response_format", None):
        body["response_format"] = json.loads(args.response_format)
    if getattr(args, "tools", None):
        body["tools"] = json.loads(args.tools)
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    res = RequestResult()
    t0 = last = time.monotonic()
    try:
        async with asyncio.timeout(args.timeout):
            async for now, data in sse_post(args.base_url + path, body, args.api_key, pool):
                if data == b"[DONE]":  # read on to the response's end: the connection is reused
                    continue
                event = _decode(data)
                if "error" in event:
                    raise HTTPError(str(event["error"]))
                if usage := event.get("usage"):
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                for choice in event.get("choices") or ():
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.monotonic() - t0
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "no usage in the stream"
    except (OSError, HTTPError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_load(
    args: argparse.Namespace, prompts: list[Any]
) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.concurrency or len(prompts))
    pool = None if args.no_keep_alive else Connections()

    async def limited(prompt: Any) -> RequestResult:
        async with limit:
            return await one_request(args, prompt, pool)

    t0 = time.monotonic()
    tasks = []
    try:
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.monotonic() - t0
    finally:
        if pool is not None:
            pool.close()


async def resolve_model(args: argparse.Namespace) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(args.base_url + "/v1/models", headers=headers)
        r.raise_for_status()
        return r.json()["data"][0]["id"]


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.latency for r in ok]),
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"{'completed / failed':<28}{s['completed']} / {s['failed']}")
    for e in s["errors"]:
        print(f"  error: {e}")
    print(f"{'duration (s)':<28}{s['duration_s']:.2f}")
    print(f"{'requests/s':<28}{s['request_throughput']:.2f}")
    print(f"{'output tokens/s':<28}{s['output_throughput']:.1f}")
    print(f"{'input / output tokens':<28}{s['total_input_tokens']} / {s['total_output_tokens']}")
    print(f"{'(ms)':<10}{'mean':>10}{'median':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        v = s[key]
        print(f"{key[:-3].upper():<10}{v['mean']:>10.2f}{v['median']:>10.2f}{v['p99']:>10.2f}")


def cmd_serve(args: argparse.Namespace) -> int:
    args.base_url = args.base_url.rstrip("/")
    if args.tools and args.endpoint != "chat":
        raise SystemExit("error: --tools needs --endpoint chat")
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)

    async def main() -> tuple[list[RequestResult], float]:
        if args.model is None:
            args.model = await resolve_model(args)
        return await run_load(args, prompts)

    results, duration = asyncio.run(main())
    summary = summarize(results, duration)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"config": config, **summary}, indent=1) + "\n")
    return 0 if summary["completed"] else 1


# -- transport: the HTTP layer alone --------------------------------------------------------------


class StubTokenizer:
    """Just enough of a tokenizer for the server. Every token decodes to the time of decoding in
    microseconds: the real engine detokenizes right after each step, so its text carries the
    emission time too (the stamps have one width, so incremental decoding cuts them cleanly)."""

    vocab_size = 1 << 20
    eos_token_ids: frozenset[int] = frozenset()
    has_chat_template = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return f"{int(time.monotonic() * 1e6)} " * len(ids)

    def decode_stream(self, skip_special_tokens: bool = True) -> Any:
        return lambda token_id: f"{int(time.monotonic() * 1e6)} "

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return "".join(str(m.get("content")) for m in messages)


class StubEngine:
    """Engine's surface with no model: each step sleeps `step_s` (a GPU's time, GIL released)
    and then emits one token per request whose text is its emission time in microseconds."""

    def __init__(self, step_s: float) -> None:
        from inferx_core.interfaces import SchedulerStats

        self.step_s = step_s
        self.tokenizer = StubTokenizer()
        self.max_model_len = 1 << 20
        self.active: dict[str, list[int]] = {}  # request id -> [prompt length, max, sent]
        self.periods: list[float] = []
        self._last = 0.0
        self.scheduler = self
        self._stats = SchedulerStats

    def add_request(self, ids: list[int], params: Any, request_id: str) -> str:
        self.active[request_id] = [len(ids), params.max_tokens, 0]
        return request_id

    def abort(self, request_id: str) -> bool:
        return self.active.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.active)

    def stats(self) -> Any:
        return self._stats(running=len(self.active), waiting=0, kv_usage=0.0)

    def step(self) -> list[Any]:
        from inferx_core.engine import RequestOutput

        time.sleep(self.step_s)  # 0 still yields the GIL, as a GPU wait would
        now = time.monotonic()
        if self._last:
            self.periods.append(now - self._last)
        self._last = now
        text = f"{int(now * 1e6)} "
        outs = []
        for rid, st in list(self.active.items()):
            st[2] += 1
            done = st[2] >= st[1]
            outs.append(RequestOutput(rid, [7], text, done, "length" if done else None,
                                      st[0], 0, st[2]))  # fmt: skip
            if done:
                del self.active[rid]
        if not self.active:
            self._last = 0.0
        return outs


class SleepExecutor:
    """For `--engine real`: the real Engine (scheduler, KV manager, detokenizer) over an
    executor that stands in for a GPU: each submitted step takes `step_s` of "device" time,
    queued behind the one before (as kernels are), and samples token 7. submit() returns at
    once, so the engine overlaps its host work with the sleep as it does with a GPU.
    `host_s`: Python work per submit that holds the GIL, as building a step's inputs and
    launching it does on a real executor."""

    supports_overlap = True

    def __init__(self, step_s: float, host_s: float = 0.0) -> None:
        self.step_s = step_s
        self.host_s = host_s
        self.num_kv_blocks, self.block_size, self.max_model_len = 32768, 16, 4096
        self.periods: list[float] = []
        self._last = 0.0
        self._busy_until = 0.0

    def submit(self, out: Any) -> Any:
        spin_until = time.monotonic() + self.host_s
        while time.monotonic() < spin_until:  # holds the GIL, unlike a sleep
            pass
        start = max(time.monotonic(), self._busy_until)
        self._busy_until = start + self.step_s
        return _SleptStep(self, self._busy_until, sum(c.sample for c in out.chunks))

    def execute(self, out: Any) -> Any:
        return self.submit(out).result()

    def _done(self, at: float) -> None:
        if self._last and at - self._last < 1.0:  # gaps while idle are not steps
            self.periods.append(at - self._last)
        self._last = at


class _SleptStep:
    """A SleepExecutor step: result() waits until its device time is over."""

    def __init__(self, executor: SleepExecutor, done_at: float, samples: int) -> None:
        self.executor, self.done_at, self.samples = executor, done_at, samples

    def result(self) -> Any:
        from inferx_core.interfaces import StepResult

        wait = self.done_at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self.executor._done(max(self.done_at, time.monotonic()))
        return StepResult([7] * self.samples)


_STUB_OVERRIDES = {"server.port": 0, "server.drain_timeout": 0, "scheduler.max_running": 256}


def sleeping_engine(step_s: float, host_s: float) -> Any:
    """The real Engine over a SleepExecutor and the stub tokenizer (also an engine process's
    factory: top-level, so that it pickles)."""
    from inferx_core.config import load_config
    from inferx_core.engine import Engine

    executor = SleepExecutor(step_s, host_s)
    return Engine(load_config(None, _STUB_OVERRIDES), executor=executor, tokenizer=StubTokenizer())


def cmd_stub_server(args: argparse.Namespace) -> int:
    """The transport benchmark's server: our transport over an engine stub, on a free port."""
    from functools import partial

    from inferx_core.config import load_config
    from inferx_server.transport import LitestarTransport

    logging.getLogger("inferx.server").setLevel(logging.ERROR)  # no "draining" line per row
    config = load_config(None, _STUB_OVERRIDES)
    periods: list[float] = []
    if args.engine == "process":  # step periods from the times the child sends with outputs
        from inferx_server.engine_process import EngineProcess

        engine: Any = EngineProcess(
            partial(sleeping_engine, args.step_ms / 1000, args.host_ms / 1000)
        )
    elif args.engine == "real":
        engine = sleeping_engine(args.step_ms / 1000, args.host_ms / 1000)
        periods = engine.executor.periods
    else:
        engine = StubEngine(args.step_ms / 1000)
        periods = engine.periods
    ready_cpu = [0.0]

    def ready(url: str) -> None:
        ready_cpu[0] = time.process_time()
        print(url, flush=True)

    transport = LitestarTransport(engine, config)
    if args.engine == "process":
        loop, deliver, last = transport.state.loop, transport.state.loop._deliver, [0.0]

        def timed(outputs: list[Any], t: float) -> None:
            if last[0] and t - last[0] < 1.0:  # gaps while idle are not steps
                periods.append(t - last[0])
            last[0] = t
            deliver(outputs, t)

        loop._deliver = timed  # type: ignore[method-assign]
    transport.serve(on_ready=ready)
    stats = {"steps": len(periods), "step_period_ms": _stats(periods or [0.0]),
             "server_cpu_s": time.process_time() - ready_cpu[0]}  # fmt: skip
    print(json.dumps(stats), flush=True)
    return 0


async def _transport_round(url: str, streams: int, tokens: int) -> dict[str, Any]:
    body = {"prompt": [1, 2, 3], "max_tokens": tokens, "stream": True, "ignore_eos": True}
    lat: list[float] = []
    counts: list[int] = []
    events = 0

    async def one() -> None:
        nonlocal events
        n = 0
        async for now, data in sse_post(url + "/v1/completions", body):
            if data == b"[DONE]":
                break
            events += 1
            for choice in _decode(data)["choices"]:
                for stamp in choice["text"].split():
                    lat.append(now - int(stamp) / 1e6)
                    n += 1
        counts.append(n)

    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(streams))), 600)
    wall = time.monotonic() - t0
    return {
        "streams": streams,
        "tokens": sum(counts),
        "complete": sum(c == tokens for c in counts),
        "seconds": wall,
        "tokens_per_s": sum(counts) / wall,
        "events": events,
        "added_latency_ms": {**_stats(lat), "max": max(lat) * 1000 if lat else 0.0},
    }


def offline_step_periods(step_s: float, streams: int, tokens: int) -> dict[str, float]:
    """The real engine's step period over SleepExecutor with no HTTP at all: the baseline that
    the served step periods of `--engine real` are compared with."""
    from inferx_core.config import load_config
    from inferx_core.engine import Engine
    from inferx_core.sequence import SamplingParams

    timer = SleepExecutor(step_s)
    config = load_config(None, {"scheduler.max_running": 256})
    engine = Engine(config, executor=timer, tokenizer=StubTokenizer())
    for i in range(streams):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=tokens, ignore_eos=True), f"r{i}")
    while engine.has_work():
        engine.step()
    return _stats(timer.periods)


def cmd_transport(args: argparse.Namespace) -> int:
    if args.offline:
        for step_ms in args.step_ms:
            for streams in args.streams:
                p = offline_step_periods(step_ms / 1000, streams, args.tokens)
                print(
                    f"step {step_ms:>4g} ms  streams {streams:>4}  no HTTP: engine step ms "
                    f"p50 {p['median']:5.2f}  mean {p['mean']:5.2f}  p99 {p['p99']:5.2f}"
                )
        return 0
    rows = []
    for step_ms in args.step_ms:
        for streams in args.streams:
            # A fresh server per row, so that each row's engine step periods are its own.
            cmd = [sys.executable, "-m", "inferx_server.bench", "_stub-server", "--step-ms",
                   str(step_ms), "--engine", args.engine,
                   "--host-ms", str(args.host_ms)]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            try:
                url = proc.stdout.readline().strip()  # type: ignore[union-attr]
                if not url.startswith("http://"):
                    raise SystemExit(f"error: the stub server did not start ({url!r})")
                row = asyncio.run(_transport_round(url, streams, args.tokens))
            finally:
                proc.terminate()
                out, _ = proc.communicate(timeout=30)
            row.update(json.loads(out.strip().splitlines()[-1]))
            row["step_ms"], row["engine"], row["host_ms"] = step_ms, args.engine, args.host_ms
            rows.append(row)
            lat = row["added_latency_ms"]
            print(
                f"step {step_ms:>4g} ms  streams {streams:>4}  "
                f"tokens/s {row['tokens_per_s']:>8,.0f}"
                f"  added latency ms p50 {lat['median']:6.2f} p99 {lat['p99']:6.2f} max "
                f"{lat['max']:6.1f}  engine step ms p50 {row['step_period_ms']['median']:5.2f}"
                f"  complete {row['complete']}/{streams}",
                flush=True,
            )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {"tokens_per_stream": args.tokens, "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",")]


def _floats(value: str) -> list[float]:
    return [float(v) for v in value.split(",")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inferx-bench", description=__doc__.split("\n")[0])
    # The metavar lists the public commands: _stub-server is internal (the transport benchmark
    # runs it as a child process) and stays out of --help.
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{latency,throughput,serve,transport}"
    )
    for mode in ("latency", "throughput"):  # handled in main(); listed here for --help
        sub.add_parser(
            mode, help=f"offline {mode} of the engine itself (see inferx_core.bench_offline)"
        )

    s = sub.add_parser("serve", help="load-test an OpenAI-compatible server over HTTP")
    s.add_argument("--base-url", default="http://127.0.0.1:8000")
    s.add_argument("--model", help="default: the server's first model")
    s.add_argument("--api-key")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    s.add_argument("--tokenizer", help="tokenizer directory for text prompts; else token ids")
    s.add_argument("--input-len", type=int, default=128)
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt shares")
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--concurrency", type=int, default=0, help="requests in flight (0: no cap)")
    s.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument(
        "--no-keep-alive",
        action="store_true",
        help="a new connection per request, closed after it (default: connections are reused)",
    )
    s.add_argument(
        "--response-format",
        metavar="JSON",
        help='every request\'s response_format, e.g. \'{"type": "json_object"}\' (structured '
        "output's cost against plain decoding)",
    )
    s.add_argument(
        "--tools",
        metavar="JSON",
        help="every chat request's tools (tool_choice auto: the cost of the lazy tool-call "
        "grammar, against a server run with --server-tool-call-grammar off)",
    )
    s.add_argument("--json", metavar="PATH")
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("transport", help="our HTTP layer alone, over an engine stub")
    t.add_argument("--streams", type=_ints, default=[1, 64, 256], help="e.g. 1,64,256")
    t.add_argument("--tokens", type=int, default=256, help="tokens per stream")
    t.add_argument(
        "--step-ms",
        type=_floats,
        default=[10.0, 0.0],
        help="engine step times to try, e.g. 10,0 (0: back to back)",
    )
    t.add_argument(
        "--engine",
        choices=["stub", "real", "process"],
        default="stub",
        help="stub: no scheduler at all; real: the Engine over a sleeping executor, on the "
        "server's thread; process: the same in its own process (server.engine_process)",
    )
    t.add_argument(
        "--host-ms",
        type=float,
        default=0.0,
        help="with --engine real: GIL-holding executor work per step (input building, launches)",
    )
    t.add_argument(
        "--offline",
        action="store_true",
        help="no server: the real engine's step periods alone (the baseline)",
    )
    t.add_argument("--json", metavar="PATH")
    t.set_defaults(func=cmd_transport)

    stub = sub.add_parser("_stub-server")
    stub.add_argument("--step-ms", type=float, default=0.0)
    stub.add_argument("--engine", choices=["stub", "real", "process"], default="stub")
    stub.add_argument("--host-ms", type=float, default=0.0)
    stub.set_defaults(func=cmd_stub_server)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("latency", "throughput"):  # the engine alone, no HTTP
        from inferx_core.bench_offline import main as offline

        return offline(argv[1:], mode=argv[0])
    args = build_parser().parse_args(argv)
    if getattr(args, "concurrency", 0) == 0 and not getattr(args, "request_rate", 1):
        args.concurrency = 16  # neither given: a fixed concurrency of 16
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
