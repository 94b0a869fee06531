"""`inferx-server` end to end on the built-in demo model (SmolLM2-135M on the CPU): the real CLI
in a subprocess, the official openai client, a few short generations, then SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from chat_servers import demo_server, openai_client, require_demo_model

require_demo_model()

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen, str]]:
    with demo_server(512) as served:
        yield served


@pytest.fixture(scope="module")
def client(server: tuple[subprocess.Popen, str]) -> openai.OpenAI:
    return openai_client(server[1], timeout=60)


def test_chat_answers_paris_and_reuses_the_prefix(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    first = client.chat.completions.create(**kw)
    assert "Paris" in first.choices[0].message.content
    assert first.choices[0].finish_reason == "stop"
    again = client.chat.completions.create(**kw)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streaming_equals_whole(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 8


def test_logit_bias_forces_and_bans_a_token(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="The capital of France is", max_tokens=4, temperature=0)
    plain = client.completions.create(**kw, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    forced = client.completions.create(**kw, logit_bias={str(_id(client, "=")): 100})
    assert forced.choices[0].text == "===="
    banned = client.completions.create(**kw, logprobs=0, logit_bias={str(_id(client, first)): -100})
    assert banned.choices[0].logprobs.tokens[0] != first


def _id(client: openai.OpenAI, token: str) -> int:
    r = httpx.post(str(client.base_url).removesuffix("/v1/") + "/tokenize",
                   json={"prompt": token, "add_special_tokens": False})  # fmt: skip
    return r.json()["tokens"][0]


def test_sigterm_exits_zero(server: tuple[subprocess.Popen, str]) -> None:
    proc, url = server
    assert httpx.get(url + "/health").status_code == 200
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert proc.wait(30) == 0
    assert time.monotonic() - t0 < 10
