"""Tool calling end to end on the demo model (SmolLM2-135M on the CPU) with the official openai
client: its template renders no tools, so the server writes them in the hermes fallback (a
system message listing them, calls as <tool_call> blocks) and parses hermes replies. tool_choice
"required" or a named function holds the reply to a call through the grammar backend, so even
this tiny model calls reliably, and under "auto" a call it opens is held to the tools' schemas
(the lazy grammar); the results go back as tool messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from chat_servers import demo_server, openai_client, require_demo_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
require_demo_model()

pytestmark = pytest.mark.slow

CITY = {"type": "string", "maxLength": 16}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"hours": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hours"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    # the lazy tool-call grammar for tool_choice auto (off by default)
    with demo_server(1024, "--server-tool-call-grammar", "lazy") as (_, url):
        yield openai_client(url, timeout=600)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_named_function_whole_and_streamed(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw: dict[str, Any] = dict(
        model=_model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
        parallel_tool_calls=False, temperature=0, max_tokens=80,
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", r
    assert msg.content is None and len(msg.tool_calls) == 1
    _check_calls(msg.tool_calls, {"get_weather"})

    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments}
                else:
                    calls[d.index]["arguments"] += d.function.arguments
    assert finish == "tool_calls"
    # Greedy: the stream says what the whole reply said.
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (msg.tool_calls[0].function.name, json.loads(msg.tool_calls[0].function.arguments))
    ]


def test_required_then_results_fed_back(client: openai.OpenAI) -> None:
    model = _model(client)
    r = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=80,
    )  # fmt: skip
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(msg.tool_calls, {"get_weather", "get_time"})
    history = [
        *ASK,
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"celsius": 18}'},
    ]
    # "none": the model answers in words, with no call parsed.
    r = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=20,
        temperature=0,
    )  # fmt: skip
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    # "auto" on the same history: whatever the model does comes back well-formed.
    r = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER, TIME], max_tokens=40, temperature=0
    )
    m = r.choices[0].message
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name for c in m.tool_calls)
    else:  # markup in content only where max_tokens cut a call short
        assert isinstance(m.content, str)
        assert "<tool_call>" not in m.content or r.choices[0].finish_reason == "length"


def test_parallel_calls_with_n_2(client: openai.OpenAI) -> None:
    """Parallel calls allowed: each choice holds one or more valid calls of the tools."""
    r = client.chat.completions.create(
        model=_model(client), messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
        n=2, seed=1, max_tokens=120,
    )  # fmt: skip
    assert any(c.finish_reason == "tool_calls" for c in r.choices), r
    for choice in r.choices:
        if choice.finish_reason == "length":
            continue  # a call may be cut by max_tokens; then it is not a complete call
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def _token_ids(client: openai.OpenAI, text: str) -> list[int]:
    import httpx

    url = str(client.base_url).removesuffix("/").removesuffix("/v1") + "/tokenize"
    return httpx.post(url, json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_auto_call_is_held_to_the_schema(client: openai.OpenAI) -> None:
    """tool_choice "auto" (server.tool_call_grammar "lazy"): the model writes what it likes
    until it opens a <tool_call>; from there the call is held to a tool's name and parameters.
    The tiny model, shown an earlier call, answers with <tool_response> blocks of its own:
    a bias against "response" and for "call" (both pieces of the markup here) makes it open
    calls, which then all validate."""
    response = _token_ids(client, "<tool_response>")
    call = _token_ids(client, "<tool_call>")
    [(bad, good)] = [(r, c) for r, c in zip(response, call, strict=True) if r != c]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 18}'},
        {"role": "assistant", "content": "It is 18 C in Paris."},
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    kw: dict[str, Any] = dict(
        model=_model(client), messages=history, tools=[WEATHER, TIME], max_tokens=80,
        logit_bias={str(bad): -100, str(good): 10},
    )  # fmt: skip
    greedy = client.chat.completions.create(**kw, temperature=0).choices[0]
    assert greedy.finish_reason == "tool_calls", greedy
    _check_calls(greedy.message.tool_calls, {"get_weather", "get_time"})
    sampled = client.chat.completions.create(**kw, temperature=1.0, n=4, seed=3).choices
    assert any(c.finish_reason == "tool_calls" for c in sampled)
    for choice in sampled:
        if choice.finish_reason == "tool_calls":
            _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
        elif choice.finish_reason == "stop":  # no call opened at all
            assert "<tool_call>" not in choice.message.content
