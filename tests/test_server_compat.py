"""What OpenAI SDKs and frameworks send, over the server of test_server_api (fake executor, Qwen
tokenizer): `null` for any optional parameter, no-op values of features the server lacks, and
the refusals of values that would change the output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from test_server_api import FakeExecutor, _error, serve

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    with serve() as t:
        yield t


def _post(server: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


NULLABLE = [
    "model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "presence_penalty",
    "frequency_penalty", "stream", "stream_options", "logit_bias", "user", "metadata", "top_k",
    "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "skip_special_tokens",
    "include_stop_str_in_output", "tools", "tool_choice", "parallel_tool_calls",
    "response_format", "store", "logprobs",
]  # fmt: skip


def test_null_means_the_default(server: Any) -> None:
    base = {"temperature": 0, "max_tokens": 5}
    want = _post(server, "/v1/completions", {"prompt": "hi", **base}).json()["choices"]
    nulls = dict.fromkeys(NULLABLE) | base
    got = _post(server, "/v1/completions", {"prompt": "hi", **nulls})
    assert got.status_code == 200, got.text
    assert [c["text"] for c in got.json()["choices"]] == [c["text"] for c in want]
    chat_nulls = nulls | {"max_completion_tokens": None, "top_logprobs": None}
    r = _post(server, "/v1/chat/completions", {"messages": USER, **chat_nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None and len(r.json()["choices"]) == 1
    r = _post(server, "/tokenize", {"prompt": "hi", "add_special_tokens": None, "model": None})
    assert r.status_code == 200, r.text


NOOPS = {
    "tools": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "store": False,
    "metadata": {"trace": "abc", "nested": {"any": [1, 2]}},
    "parallel_tool_calls": True,
    "logit_bias": {},
    "user": "someone",
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_noop_values_change_nothing(server: Any, path: str) -> None:
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": USER}
    body |= {"temperature": 0, "max_tokens": 6}
    plain = _post(server, path, body).json()["choices"][0]
    r = _post(server, path, body | NOOPS | {"tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0] == plain


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("tool_choice", "required", "needs tools"),  # a choice of no tools
        ("tool_choice", {"type": "function", "function": {"name": "f"}}, "needs tools"),
        ("store", True, "stores nothing"),
    ],
)
def test_values_that_would_change_the_output_are_refused(
    server: Any, name: str, value: Any, says: str
) -> None:
    err = _error(_post(server, "/v1/chat/completions", {"messages": USER, name: value}), 400)
    assert err["param"] == name, err
    assert says in err["message"], err
    if name == "store":
        assert err["code"] == "unsupported_parameter"


def test_max_completion_tokens(server: Any) -> None:
    url = "/v1/chat/completions"
    r = _post(server, url, {"messages": USER, "max_completion_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"
    same = {"messages": USER, "max_completion_tokens": 3, "max_tokens": 3, "ignore_eos": True}
    assert _post(server, url, same).json()["usage"]["completion_tokens"] == 3
    err = _error(_post(server, url, same | {"max_tokens": 4}), 400, "max_tokens")
    assert "max_completion_tokens" in err["message"]


def test_openai_client_sends_nulls_and_noops(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    kw: dict[str, Any] = dict(
        model="fake-model", messages=USER, temperature=0, max_completion_tokens=4
    )
    plain = client.chat.completions.create(**kw)
    extra = client.chat.completions.create(
        **kw,
        n=None,
        logprobs=None,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        store=False,
        metadata={"who": "test"},
        parallel_tool_calls=False,
        logit_bias={},
        extra_body={"stream": None, "stop": None},
    )
    assert extra.choices[0].message.content == plain.choices[0].message.content
    assert extra.usage.completion_tokens == 4
    done = client.completions.create(
        model="fake-model", prompt="hi", max_tokens=3, n=None, logprobs=None, stream=None,
        extra_body={"ignore_eos": None},
    )  # fmt: skip
    assert done.choices[0].text
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**kw, response_format={"type": "json"})
    assert exc.value.body["param"] == "response_format.type"


def test_content_null(server: Any) -> None:
    url = "/v1/chat/completions"
    turns = USER + [{"role": "assistant", "content": None}, {"role": "user", "content": "more"}]
    r = _post(server, url, {"messages": turns, "max_tokens": 2})
    assert r.status_code == 200, r.text
    err = _error(_post(server, url, {"messages": [{"role": "user", "content": None}]}), 400)
    assert err["param"] == "messages[0].content" and "null" in err["message"]
    err = _error(_post(server, url, {"messages": [{"role": "user"}]}), 400)
    assert err["param"] == "messages[0].content"


def test_empty_body_says_so(server: Any) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for body in (b"", b"  \n"):
            r = httpx.post(server.url + path, content=body)
            err = _error(r, 400)
            assert err["message"] == "the request body is empty; expected a JSON object", path


def test_a_request_that_can_never_fit_is_a_400_not_a_429() -> None:
    with serve(FakeExecutor(num_kv_blocks=8), **{"scheduler.max_waiting": 10}) as t:
        url = t.url + "/v1/completions"
        err = _error(httpx.post(url, json={"prompt": ["a", "b", "c"], "n": 4}), 400, "prompt")
        assert "12 sequences" in err["message"] and "scheduler.max_waiting" in err["message"]
        err = _error(httpx.post(url, json={"prompt": "a", "n": 11}), 400, "n")
        assert err["code"] == "request_too_large"
        ok = httpx.post(url, json={"prompt": ["a", "b"], "n": 5, "max_tokens": 2})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 10
        # One sequence longer than the whole KV cache (7 usable blocks of 16 tokens).
        err = _error(httpx.post(url, json={"prompt": "a", "max_tokens": 200}), 400)
        assert "KV blocks" in err["message"]


def test_drain_timeout_ends_requests_with_an_error_not_abort() -> None:
    with serve(FakeExecutor(step_delay=0.01), **{"server.drain_timeout": 0.3}) as t:
        url = t.url + "/v1/completions"
        body = {"prompt": "drain", "max_tokens": 400, "ignore_eos": True}

        async def main() -> tuple[str, httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as c:
                whole = asyncio.ensure_future(c.post(url, json=body))
                async with c.stream("POST", url, json={**body, "stream": True}) as r:
                    it = r.aiter_lines()
                    lines = [await it.__anext__()]
                    t.drain()
                    lines += [line async for line in it]
                return "\n".join(lines), await whole

        text, whole = asyncio.run(main())
        events = [line.removeprefix("data: ") for line in text.split("\n") if line]
        assert events[-1] == "[DONE]" and "abort" not in text
        assert json.loads(events[-2])["error"]["code"] == "draining"
        assert _error(whole, 503)["code"] == "draining"
