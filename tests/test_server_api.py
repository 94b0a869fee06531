"""The OpenAI-compatible server against the official openai client and raw HTTP, over a real
Engine (scheduler, KV manager, detokenizer) with a fake executor and the Qwen tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inferx_core.config import load_config
from inferx_core.engine import Engine
from inferx_core.interfaces import Executor, SchedulerOutput, StepResult

SHARED = Path(__file__).parents[1].parent / "shared"
QWEN = SHARED / "fixtures" / "tokenizers" / "qwen"
if not (QWEN / "tokenizer.json").is_file():
    pytest.skip(
        f"no Qwen tokenizer fixture at {QWEN} (shared/ beside the repo)", allow_module_level=True
    )

# Qwen token ids of " the", " cat", " sat", " on", " a", " mat", ".", " and", " dog", " ran".
WORDS = [279, 8251, 7578, 389, 264, 5517, 13, 323, 5562, 10613]
EOS = 151645  # <|im_end|>
MODEL = "fake-model"


class FakeExecutor(Executor):
    """A deterministic "model": the next token is a hash of the last tokens (and of the seed and
    position for seeded requests), one of WORDS; every `eos_every`-th output token is EOS.
    `step_delay` stands for the GPU's time per step (a sleep, so the GIL is free meanwhile)."""

    def __init__(
        self, num_kv_blocks: int = 512, block_size: int = 16, max_model_len: int = 512,
        step_delay: float = 0.0, eos_every: int = 0,
    ) -> None:  # fmt: skip
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.eos_every = eos_every

    def execute(self, out: SchedulerOutput) -> StepResult:
        if self.step_delay:
            time.sleep(self.step_delay)
        sampled, logprobs = [], []
        for c in out.chunks:
            if not c.sample:
                continue
            seq, end = c.seq, c.start + c.num_tokens
            n_out = end - seq.num_prompt + 1  # the position of the token sampled now
            h = hash(tuple(seq.token_ids[max(0, end - 4) : end]))
            if seq.params.seed is not None and not seq.params.greedy:
                h = hash((h, seq.params.seed, n_out))
            tok = WORDS[h % len(WORDS)]
            if self.eos_every and n_out % self.eos_every == 0:
                tok = EOS
            sampled.append(tok)
            k = seq.params.logprobs
            top = [(w, -0.1 * (i + 1)) for i, w in enumerate(WORDS[: k or 0])]
            logprobs.append(None if k is None else (-0.05, top))
        return StepResult(sampled, logprobs if any(lp is not None for lp in logprobs) else [])


@contextlib.contextmanager
def serve(executor: FakeExecutor | None = None, **overrides: Any) -> Iterator[Any]:
    """A live server on 127.0.0.1 (a free port) in a thread; yields the transport, with .url."""
    from inferx_core.tokenizer import Tokenizer

    config = load_config(None, {"model.served_name": MODEL, **overrides})
    engine = Engine(config, executor=executor or FakeExecutor(), tokenizer=Tokenizer.from_dir(QWEN))
    with serve_engine(engine, config) as transport:
        yield transport


@contextlib.contextmanager
def serve_engine(engine: Any, config: Any) -> Iterator[Any]:
    """serve() over a given engine (an Engine, or an EngineProcess); the transport has .url and
    .engine."""
    from inferx_server.transport import LitestarTransport, bind

    transport = LitestarTransport(engine, config)
    ready = threading.Event()
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=transport.serve, args=(sock, lambda url: ready.set()))
    thread.start()
    assert ready.wait(20), "the server did not start"
    transport.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    transport.engine = engine
    try:
        yield transport
    finally:
        stopping = time.monotonic()
        transport.stop()
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"
    # A handler left waiting (say, for a client that is gone) would hold shutdown for uvicorn's
    # 5 s grace period.
    assert time.monotonic() - stopping < 3, "a request outlived its client"


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with serve(FakeExecutor(eos_every=0)) as t:
        yield t


@pytest.fixture()
def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)


def _idle(engine: Engine, within: float = 5.0) -> bool:
    """True once nothing runs and every KV block is free again."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        kv = engine.kv
        if (
            not engine.has_work()
            and kv.usage() == 0
            and kv.num_free_blocks() == kv.num_usable_blocks
        ):
            return True
        time.sleep(0.02)
    return False


# -- the openai client -------------------------------------------------------------------------


def test_completion_usage_and_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # > 4 blocks of 16 tokens
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert first.object == "text_completion" and first.model == MODEL
    assert first.choices[0].finish_reason == "length"
    u = first.usage
    assert u.completion_tokens == 5 and u.total_tokens == u.prompt_tokens + 5
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < u.prompt_tokens


def test_completion_streaming_matches_whole(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_and_chat_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=8, temperature=0
    )
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert whole.usage.completion_tokens == 8
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_choices_and_seed_determinism(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Seeds", max_tokens=10, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1, "choices of one seeded request should differ"
    assert a.usage.completion_tokens == 30
    other = client.completions.create(**{**kw, "seed": 8})
    assert [c.text for c in other.choices] != texts
    streamed = client.completions.create(**kw, stream=True)
    joined = ["", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            joined[c.index] += c.text
    assert joined == texts


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content) == c.choices[0].message.content


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI, server: Any) -> None:
    kw = dict(model=MODEL, prompt="Stops", max_tokens=20, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    words = full.split(" ")
    stop = " " + words[3]  # cut at the third word's first appearance
    cut = full[: full.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "never appears"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True)
    )
    assert streamed == cut
    # A stop token ends the output; like vLLM, its text is kept unless it is a special token.
    tok = httpx.post(server.url + "/tokenize", json={"prompt": stop, "add_special_tokens": False})
    r = client.completions.create(**kw, extra_body={"stop_token_ids": tok.json()["tokens"]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == cut + stop


def test_eos_and_ignore_eos() -> None:
    with serve(FakeExecutor(eos_every=3)) as t:
        c = openai.OpenAI(base_url=t.url + "/v1", api_key="x", max_retries=0)
        r = c.completions.create(model=MODEL, prompt="EOS", max_tokens=10, temperature=0)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 3
        r = c.completions.create(
            model=MODEL, prompt="EOS", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10


def test_models_tokenize_detokenize(client: openai.OpenAI, server: Any) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200 and r.json()["tokens"] == [9707, 1879] and r.json()["count"] == 2
    r = httpx.post(server.url + "/detokenize", json={"tokens": [9707, 1879]})
    assert r.json() == {"prompt": "Hello world"}
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["count"] > 3


def test_health_metrics_openapi(client: openai.OpenAI, server: Any) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "detail": None}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "inferx:num_requests_running", "inferx:num_requests_waiting", "inferx:kv_cache_usage_perc",
        "inferx:prefix_cache_queries_total", "inferx:prefix_cache_hits_total",
        "inferx:time_to_first_token_seconds_bucket", "inferx:inter_token_latency_seconds_bucket",
        "inferx:e2e_request_latency_seconds_bucket", "inferx:prompt_tokens_total",
        "inferx:generation_tokens_total", "inferx:num_aborted_requests_total",
    ):  # fmt: skip
        assert f"\n{name}{{" in text, name
    schema = httpx.get(server.url + "/schema/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/health"):
        assert path in paths, path
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    ref = body["$ref"].rsplit("/", 1)[1]
    props = schema["components"]["schemas"][ref]["properties"]
    assert {"prompt", "max_tokens", "stop", "stream_options", "ignore_eos"} <= set(props)
    assert "200" in paths["/v1/completions"]["post"]["responses"]
    # The schema's logit_bias keys are exactly the ids the server takes: below the vocabulary.
    bias = props["logit_bias"]["oneOf"][0]["propertyNames"]["pattern"]
    vocab = props["stop_token_ids"]["oneOf"][0]["items"]["maximum"] + 1
    rng = random.Random()
    for key in ["0", "00", str(vocab - 1), str(vocab), "0" + str(vocab - 1), "0" + str(vocab)] + [
        str(rng.randrange(2 * vocab)).zfill(rng.randint(1, 10)) for _ in range(60)
    ]:
        body = {"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1.0}}
        r = httpx.post(server.url + "/v1/completions", json=body)
        assert (re.fullmatch(bias, key) is not None) == (r.status_code == 200), (key, r.text)
        assert (r.status_code == 200) == (int(key) < vocab), key


# -- raw HTTP: every error is OpenAI's error JSON with the right status --------------------------


def _error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (b'{"prompt": "hi", "max_tokens": ', None, "not valid JSON"),
        (b'["prompt"]', None, "object"),
        (b'{"max_tokens": 3}', None, "prompt"),
        (b'{"prompt": "hi", "max_tokens": "3"}', "max_tokens", "int"),
        (b'{"prompt": "hi", "temperature": 9}', "temperature", "<= 2"),
        (b'{"prompt": "hi", "n": 0}', "n", ">= 1"),
        (b'{"prompt": "hi", "stop_token_ids": [99999999]}', "stop_token_ids", "vocabulary"),
        (b'{"prompt": "hi", "frobnicate": 1}', "frobnicate", "unknown parameter"),
        (b'{"prompt": "hi", "logit_bias": {"99999999": 5}}', "logit_bias.99999999", "vocabulary"),
        (b'{"prompt": "hi", "logit_bias": {"1": 101}}', "logit_bias", "<= 100"),
        (b'{"prompt": "hi", "best_of": 2}', "best_of", "not supported"),
        (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options", ""),
        (b'{"prompt": [], "max_tokens": 3}', "prompt", ""),
        (b'{"prompt": [[1, 2], 3]}', "prompt", ""),
        (b'{"prompt": [99999999]}', "prompt", "vocabulary"),
        (b'{"prompt": "hi", "max_tokens": 100000}', "max_tokens", "context"),
        (b'{"prompt": "hi", "seed": 1180591620717411303424}', "seed", "<="),
        (b'{"prompt": "hi", "seed": -9223372036854775809}', "seed", ">="),
    ],
)
def test_bad_completion_requests(server: Any, body: bytes, param: str | None, words: str) -> None:
    r = httpx.post(
        server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    err = _error(r, 400, param)
    assert words in err["message"], err


def test_bad_chat_requests(server: Any) -> None:
    url = server.url + "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    _error(httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}), 400,
           "messages[0].role")  # fmt: skip
    err = _error(httpx.post(url, json={"messages": user, "tools": [{"type": "function"}]}), 400)
    assert err["param"] == "tools[0]" and "function" in err["message"], err
    _error(httpx.post(url, json={"messages": user, "top_logprobs": 2}), 400, "top_logprobs")
    _error(httpx.post(url, json={"messages": []}), 400, "messages")
    long = [{"role": "user", "content": "word " * 600}]  # > 512 tokens of context
    err = _error(httpx.post(url, json={"messages": long}), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    err = _error(httpx.post(url, json={"messages": user, "max_completion_tokens": 600}), 400)
    assert err["param"] == "max_completion_tokens"


def test_unknown_model_route_and_method(server: Any) -> None:
    err = _error(httpx.post(server.url + "/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                 404, "model")  # fmt: skip
    assert err["code"] == "model_not_found"
    _error(httpx.get(server.url + "/v1/models/gpt-9"), 404, "model")
    _error(httpx.get(server.url + "/v1/nothing"), 404)
    _error(httpx.get(server.url + "/v1/completions"), 405)


def test_api_key() -> None:
    with serve(**{"server.api_key": "sesame"}) as t:
        _error(httpx.get(t.url + "/v1/models"), 401)
        ok = httpx.get(t.url + "/v1/models", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200
        assert httpx.get(t.url + "/health").status_code == 200


def test_queue_full_is_429_with_retry_after() -> None:
    overrides = {"scheduler.max_waiting": 1, "scheduler.max_running": 1}
    with serve(FakeExecutor(step_delay=0.01), **overrides) as t:
        url = t.url + "/v1/completions"
        body = {"prompt": "long", "max_tokens": 400, "temperature": 0}

        async def main() -> httpx.Response:
            # One request running, one waiting behind it; the third finds the queue full.
            async with (
                httpx.AsyncClient(timeout=30) as c,
                c.stream("POST", url, json={**body, "stream": True}) as running,
            ):
                lines = running.aiter_lines()  # held: a dropped iterator closes the stream
                await lines.__anext__()
                waiting = asyncio.ensure_future(c.post(url, json=body))
                while t.state.loop.stats.waiting < 1:
                    await asyncio.sleep(0.01)
                refused = await c.post(url, json=body)
                waiting.cancel()
                return refused

        r = asyncio.run(main())
        err = _error(r, 429)
        assert r.headers["retry-after"] == "1" and err["code"] == "queue_full"
        assert _idle(t.engine)


def test_disconnected_streams_free_every_block() -> None:
    with serve(FakeExecutor(step_delay=0.005)) as t:
        url = t.url + "/v1/completions"

        async def one(c: httpx.AsyncClient, i: int) -> int:
            body = {"prompt": f"client {i} " * 20, "max_tokens": 400, "stream": True}
            async with c.stream("POST", url, json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen == 3:
                        return seen  # leaving the block closes the connection mid-stream
            return seen

        async def main() -> list[int]:
            limits = httpx.Limits(max_connections=20)
            async with httpx.AsyncClient(timeout=30, limits=limits) as c:
                return await asyncio.gather(*(one(c, i) for i in range(20)))

        assert asyncio.run(main()) == [3] * 20
        assert _idle(t.engine, within=3.0), "blocks still held after every client left"
        metrics = httpx.get(t.url + "/metrics").text
        assert 'inferx:num_aborted_requests_total{model_name="fake-model"} 20.0' in metrics


def test_non_streaming_disconnect_aborts() -> None:
    with serve(FakeExecutor(step_delay=0.005)) as t:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(t.url + "/v1/completions", json={"prompt": "x", "max_tokens": 400},
                       timeout=0.3)  # fmt: skip
        assert _idle(t.engine, within=3.0)


def test_drain_refuses_new_and_finishes_in_flight() -> None:
    with serve(FakeExecutor(step_delay=0.01), **{"server.drain_timeout": 10}) as t:
        url = t.url + "/v1/completions"

        async def main() -> tuple[str, httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                body = {"prompt": "drain", "max_tokens": 30, "stream": True}
                async with c.stream("POST", url, json=body) as r:
                    it = r.aiter_lines()
                    lines = [await it.__anext__()]
                    t.drain()
                    refused = await c.post(url, json={"prompt": "late"})
                    health = await c.get(t.url + "/health")
                    lines += [line async for line in it]
            return "\n".join(lines), refused, health

        text, refused, health = asyncio.run(main())
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
        assert refused.headers["retry-after"] == "1"
        assert _error(refused, 503)["code"] == "draining"
        assert health.status_code == 503


def test_health_fails_when_the_loop_is_stuck_or_dead() -> None:
    class Stuck(FakeExecutor):
        def execute(self, out: SchedulerOutput) -> StepResult:
            if out.chunks[0].seq.prompt_ids[-1] == 13:  # a prompt ending in "." hangs
                time.sleep(3.0)
            if out.chunks[0].seq.prompt_ids[-1] == 0:  # "!" kills the loop
                raise RuntimeError("device lost")
            return super().execute(out)

    def healthy_within(c: httpx.Client, url: str, seconds: float = 5.0) -> bool:
        # Polled: on a loaded machine the loop may take longer than health_timeout to tick.
        deadline = time.monotonic() + seconds
        while c.get(url + "/health").status_code != 200:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    with serve(Stuck(), **{"server.health_timeout": 0.5}) as t:
        assert healthy_within(httpx.Client(timeout=30), t.url)
        with httpx.Client(timeout=30) as c:
            fut = threading.Thread(target=c.post, args=(t.url + "/v1/completions",),
                                   kwargs={"json": {"prompt": "x.", "max_tokens": 1}})  # fmt: skip
            fut.start()
            # Polled: on a loaded machine the request may reach the stuck step late.
            deadline = time.monotonic() + 2.5
            stuck = c.get(t.url + "/health")
            while stuck.status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.1)
                stuck = c.get(t.url + "/health")
            fut.join()
            assert stuck.status_code == 503 and "not finished a step" in stuck.json()["detail"]
            assert healthy_within(c, t.url)
            r = c.post(t.url + "/v1/completions", json={"prompt": "x!", "max_tokens": 1})
            assert _error(r, 500)["type"] == "server_error"
            dead = c.get(t.url + "/health")
            assert dead.status_code == 503 and "died" in dead.json()["detail"]
            _error(c.post(t.url + "/v1/completions", json={"prompt": "x"}), 503)


def test_sigterm_drains_and_exits_zero(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_server_api import FakeExecutor, QWEN
        from inferx_core.config import load_config
        from inferx_core.engine import Engine
        from inferx_core.tokenizer import Tokenizer
        from inferx_server.transport import LitestarTransport
        config = load_config(None, {{"server.port": 0, "server.drain_timeout": 10}})
        engine = Engine(config, executor=FakeExecutor(step_delay=0.01),
                        tokenizer=Tokenizer.from_dir(QWEN))
        LitestarTransport(engine, config).serve(on_ready=lambda url: print(url, flush=True))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        with httpx.Client(timeout=30) as c, c.stream(
            "POST", url + "/v1/completions",
            json={"prompt": "bye", "max_tokens": 40, "stream": True},
        ) as r:  # fmt: skip
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        events = [line[6:] for line in rest if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        proc.wait()


def test_long_prompts_are_encoded_off_the_loop_alike(client: openai.OpenAI, server: Any) -> None:
    """Prompts past requests._OFF_LOOP_CHARS are encoded by Tokenizer.encode_batch on a worker
    thread: the same ids as encode(), in the order of the prompts, beside short text and token
    id prompts in one request."""
    from inferx_core.tokenizer import Tokenizer
    from inferx_server.requests import _OFF_LOOP_CHARS

    tok = Tokenizer.from_dir(QWEN)
    long_a = " the cat sat on a mat." * 60
    long_b = " and a dog ran on the mat." * 45
    assert min(len(long_a), len(long_b)) > _OFF_LOOP_CHARS
    for text, special in ((long_a, True), (long_b, False)):
        r = httpx.post(
            server.url + "/tokenize", json={"prompt": text, "add_special_tokens": special}
        )
        assert r.json()["tokens"] == tok.encode(text, add_special_tokens=special)
    prompts: list[Any] = [long_a, "hi", WORDS[:5], long_b]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4)
    assert both.usage.prompt_tokens == sum(
        len(tok.encode(p)) if isinstance(p, str) else len(p) for p in prompts
    )
    for i, p in enumerate(prompts):  # each choice continues its own prompt
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=4)
        assert both.choices[i].text == alone.choices[0].text, i
    chat = [{"role": "user", "content": long_a}]
    r = httpx.post(server.url + "/tokenize", json={"messages": chat})
    text = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
