"""server.engine_process: the engine in a child process behind the same HTTP API. The child runs
test_server_api's deterministic FakeExecutor, so answers can be compared with the in-process
server's token for token."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from test_server_api import MODEL, QWEN, FakeExecutor, serve, serve_engine  # noqa: E402

from inferx_core.config import load_config  # noqa: E402
from inferx_server.engine_process import EngineProcess  # noqa: E402


def fake_engine(overrides: dict[str, Any]) -> Any:
    """Runs in the child: the Engine of test_server_api's servers."""
    from inferx_core.engine import Engine
    from inferx_core.tokenizer import Tokenizer

    config = load_config(None, {"model.served_name": MODEL, **overrides})
    return Engine(
        config, executor=FakeExecutor(step_delay=0.002), tokenizer=Tokenizer.from_dir(QWEN)
    )


def broken_engine() -> Any:
    raise ValueError("no such model: on purpose")


@contextlib.contextmanager
def serve_in_process_engine(**overrides: Any) -> Iterator[Any]:
    """serve() with the engine in a child process; the transport has .url and .engine (the
    EngineProcess), and the child is gone after."""
    config = load_config(None, {"model.served_name": MODEL, **overrides})
    proc = EngineProcess(partial(fake_engine, overrides))
    with serve_engine(proc, config) as transport:
        yield transport
    proc.process.join(10)
    assert not proc.process.is_alive(), "the engine process outlived the server"


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def completion(url: str, prompt: str, stream: bool) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": stream}
    status, raw = post(url + "/v1/completions", body)
    if status != 200:
        return status, raw.decode()
    if not stream:
        return status, json.loads(raw)["choices"][0]["text"]
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            text += json.loads(line[6:])["choices"][0]["text"]
    return status, text


PROMPTS = ["the cat sat", "a dog ran on the mat", "and"]


def test_answers_like_the_in_process_engine() -> None:
    """Streamed and whole answers, several requests at once, bad input as a 400 from the
    child's add_request, then a clean shutdown of both processes."""
    with serve() as local:
        want = [completion(local.url, p, stream=False) for p in PROMPTS]
    with serve_in_process_engine() as remote:
        got = [completion(remote.url, p, stream=False) for p in PROMPTS]
        assert got == want
        results: list[Any] = [None] * len(PROMPTS)

        def run(i: int) -> None:
            results[i] = completion(remote.url, PROMPTS[i], stream=True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == want
        long_prompt = "the " * 600  # over max_model_len (512): refused in the child
        status, body = post(
            remote.url + "/v1/completions",
            {"model": MODEL, "prompt": long_prompt, "max_tokens": 4},
        )
        assert status == 400 and b"invalid_request_error" in body
        # a schema the child's grammar backend cannot compile: its GrammarError, pickled back
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
        status, body = post(
            remote.url + "/v1/completions",
            {"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": bad},
        )
        error = json.loads(body)["error"]
        assert status == 400 and error["param"] == "response_format", body
        assert "Invalid type: foo" in error["message"]
        with urllib.request.urlopen(remote.url + "/health", timeout=10) as resp:
            assert resp.status == 200


def read_trace(path: Any) -> dict[str, list[list[str]]]:
    """INFERX_STEP_TRACE's lines by kind (add, step, gc), each split into its fields."""
    kinds: dict[str, list[list[str]]] = {"add": [], "step": [], "gc": []}
    for line in path.read_text().splitlines():
        fields = line.split()
        kinds[fields[1]].append(fields)
    return kinds


def test_step_trace_records_adds_and_steps(tmp_path, monkeypatch) -> None:
    """INFERX_STEP_TRACE: the child writes a line per add and per step; the trace accounts for
    every request (added once, running in some step) and ends idle."""
    trace = tmp_path / "steps.txt"
    monkeypatch.setenv("INFERX_STEP_TRACE", str(trace))  # the spawned child inherits it
    with serve_in_process_engine() as remote:
        for prompt in PROMPTS:
            assert completion(remote.url, prompt, stream=True)[0] == 200
    lines = read_trace(trace)
    adds, steps = lines["add"], lines["step"]
    assert [int(f[2]) for f in adds] == [1] * len(PROMPTS)
    assert all(0 <= float(f[3]) < 10_000 for f in adds)  # ms from the server's hand-over
    assert len(steps) >= len(PROMPTS) * 12 // 2  # 12 tokens each, one per step at best
    times = [float(f[0]) for f in adds + steps]
    assert all(float(f[2]) >= 0 and int(f[4]) <= 1 for f in steps)  # one request at a time
    assert max(int(f[4]) for f in steps) == 1 and steps[-1][4] == "0"
    assert min(times) == float(adds[0][0]) and max(times) == float(steps[-1][0])


def test_a_dead_engine_process_fails_health_and_requests() -> None:
    with serve_in_process_engine() as remote:
        remote.engine.process.kill()
        remote.engine.process.join(10)
        deadline = time.monotonic() + 10
        status = 200
        while status == 200 and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(remote.url + "/health", timeout=5) as resp:
                    status = resp.status
            except urllib.error.HTTPError as exc:
                status = exc.code
            time.sleep(0.05)
        assert status == 503
        status, _ = post(
            remote.url + "/v1/completions", {"model": MODEL, "prompt": "the", "max_tokens": 2}
        )
        assert status in (500, 503)


def test_an_engine_that_cannot_start_raises_its_error() -> None:
    with pytest.raises(ValueError, match="on purpose"):
        EngineProcess(broken_engine)


def test_a_burst_of_long_prompts_all_complete() -> None:
    """More pickled prompt tokens at once than a pipe buffer holds (the HTTP side's sends go
    through their own thread, so the event loop never waits on the pipe): every request ends."""
    prompt = "the cat sat on a mat and " * 55  # ~400 tokens each
    with serve_in_process_engine() as remote:
        results: list[int] = []

        def run() -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
            results.append(post(remote.url + "/v1/completions", body)[0])

        threads = [threading.Thread(target=run) for _ in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [200] * 40


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [("auto", "cpu", False), ("true", "cpu", True), ("false", "cpu", False), ("false", "auto", 0)],
)
def test_engine_process_auto_is_a_thread_on_a_cpu(value: str, device: str, expected: int) -> None:
    """auto: a child process only where the engine runs on a GPU (measured faster on the H200 at
    64 and 256 streams); on a CPU the child and the HTTP side would share the few cores."""
    from inferx_server.cli import engine_in_process

    config = load_config(None, {"server.engine_process": value, "engine.device": device})
    assert engine_in_process(config) is bool(expected)


def test_engine_process_auto_is_a_process_on_a_gpu(monkeypatch) -> None:
    from inferx_server import cli

    monkeypatch.setattr(cli, "cuda_devices", lambda: 1)
    assert cli.engine_in_process(load_config(None, {"engine.device": "auto"})) is True
    assert cli.engine_in_process(load_config(None, {"engine.device": "cpu"})) is False
    assert cli.engine_in_process(load_config(None, {"server.engine_process": "false"})) is False
    monkeypatch.setattr(cli, "cuda_devices", lambda: 0)
    assert cli.engine_in_process(load_config(None, {"engine.device": "cuda:1"})) is True
    assert cli.engine_in_process(load_config(None, {"engine.device": "auto"})) is False


def test_cuda_devices_counts_what_torch_sees() -> None:
    """The driver-level count that decides "auto" without torch agrees with torch."""
    import torch

    from inferx_server.cli import cuda_devices

    assert (cuda_devices() > 0) == torch.cuda.is_available()


def test_the_server_spawns_its_engine_before_importing_torch() -> None:
    """inferx-server's entry module and the engine-process module import no torch: the child
    starts while the parent's own imports run (start-up time, BENCHMARKS.md)."""
    import subprocess
    import sys

    code = (
        "import sys, inferx_server.cli, inferx_server.engine_process; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_process_rejects_other_values() -> None:
    from inferx_core.config import ConfigError

    with pytest.raises(ConfigError, match="engine_process"):
        load_config(None, {"server.engine_process": "maybe"})
