"""inferx-bench: the load client against a live server, and the transport benchmark, both tiny."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_server_api import QWEN, FakeExecutor, serve

from inferx_server import bench


def _run(tmp_path: Path, url: str, *extra: str) -> dict:
    out = tmp_path / "serve.json"
    argv = ["serve", "--base-url", url, "--num-prompts", "8", "--input-len", "40",
            "--output-len", "6", "--json", str(out), *extra]  # fmt: skip
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_serve_exact_lengths_concurrency_rate_prefix_chat(tmp_path: Path) -> None:
    with serve(FakeExecutor(step_delay=0.002)) as t:
        # Text prompts that the server counts as exactly 40 tokens (Qwen adds no BOS).
        r = _run(tmp_path, t.url, "--tokenizer", str(QWEN), "--concurrency", "4")
        assert r["completed"] == 8 and r["failed"] == 0
        assert r["total_input_tokens"] == 8 * 40 and r["total_output_tokens"] == 8 * 6
        assert r["ttft_ms"]["p99"] > 0 and r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["median"] > 0
        # Shared prefix over a Poisson arrival rate: the prefix cache serves later prompts.
        before = t.state.loop.stats.prefix_hits
        r = _run(tmp_path, t.url, "--tokenizer", str(QWEN), "--request-rate", "40",
                 "--shared-prefix-len", "32")  # fmt: skip
        assert r["completed"] == 8 and r["total_input_tokens"] == 8 * 40
        assert t.state.loop.stats.prefix_hits - before >= 7 * 32
        r = _run(tmp_path, t.url, "--tokenizer", str(QWEN), "--endpoint", "chat")
        assert r["completed"] == 8 and r["total_output_tokens"] == 8 * 6
        # With tools: each reply held by the lazy tool grammar (its text is free).
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        r = _run(tmp_path, t.url, "--tokenizer", str(QWEN), "--endpoint", "chat",
                 "--tools", json.dumps([tool]))  # fmt: skip
        assert r["completed"] == 8 and r["total_output_tokens"] == 8 * 6
        r = _run(tmp_path, t.url)  # token-id prompts, no tokenizer needed
        assert r["completed"] == 8 and r["total_input_tokens"] == 8 * 40


@pytest.mark.parametrize("engine", ["stub", "real", "process"])
def test_transport_benchmark_runs(tmp_path: Path, engine: str) -> None:
    """Every engine: the stub, and the real Engine (overlapping its host work with a sleeping
    stand-in for the GPU) with the stub tokenizer's decode_stream, on the server's thread or in
    its own process."""
    out = tmp_path / "transport.json"
    argv = ["transport", "--streams", "1,4", "--tokens", "8", "--step-ms", "1", "--json", str(out)]
    assert bench.main(argv + ["--engine", engine]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["streams"] for r in rows] == [1, 4]
    assert all(r["complete"] == r["streams"] and r["tokens"] == 8 * r["streams"] for r in rows)
    assert all(0 < r["added_latency_ms"]["median"] < 1000 for r in rows)


def test_transport_host_work_holds_the_gil(tmp_path: Path) -> None:
    """--host-ms: the sleeping executor spins that long per step (GIL held), so with steps of
    1 ms the engine's step period grows to at least the spin."""
    out = tmp_path / "transport.json"
    argv = ["transport", "--streams", "2", "--tokens", "16", "--step-ms", "1", "--engine", "real"]
    assert bench.main(argv + ["--host-ms", "4", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["host_ms"] == 4 and row["complete"] == 2
    assert row["step_period_ms"]["median"] >= 3.9


def test_serve_reuses_its_connections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As vLLM's client does, a run keeps a connection per request in flight and sends the next
    request over it; --no-keep-alive opens one per request."""
    opened = []
    real_open = bench.asyncio.open_connection

    async def counting_open(*args: object, **kw: object) -> object:
        opened.append(args)
        return await real_open(*args, **kw)

    monkeypatch.setattr(bench.asyncio, "open_connection", counting_open)
    with serve(FakeExecutor(step_delay=0.001)) as t:
        r = _run(tmp_path, t.url, "--concurrency", "2")
        assert r["completed"] == 8 and r["total_output_tokens"] == 8 * 6
        assert len(opened) == 2
        opened.clear()
        r = _run(tmp_path, t.url, "--concurrency", "2", "--no-keep-alive")
        assert r["completed"] == 8 and len(opened) == 8


def test_a_connection_the_server_closed_is_replaced() -> None:
    """A server may close an idle kept connection (uvicorn after 5 s): the next request over it
    opens a fresh one instead of failing. This server answers one request per connection and
    then closes it, though it announces nothing."""
    accepted = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await reader.readuntil(b"\r\n\r\n")
        head = await reader.readuntil(b"}")  # the JSON body
        assert head.startswith(b"{")
        chunks = [b"data: " + str(len(accepted)).encode() + b"\n\n", b"data: [DONE]\n\n"]
        body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    async def main() -> list[list[bytes]]:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
        pool = bench.Connections()
        got = []
        for _ in range(3):
            got.append([data async for _, data in bench.sse_post(url, {}, pool=pool)])
            await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        pool.close()
        server.close()
        return got

    got = asyncio.run(main())
    assert got == [[b"1", b"[DONE]"], [b"2", b"[DONE]"], [b"3", b"[DONE]"]]
    assert len(accepted) == 3
