"""gpt-oss chat in the harmony format: prompts as openai-harmony's documentation and test data
spell them, replies split into reasoning_content and content (whole, token by token, and through
the server), with the real o200k_harmony tokenizer and no network."""

from __future__ import annotations

import json
import os
from datetime import date
from typing import Any

import pytest
from chat_servers import openai_client, serve_scripted, tiny_gpt_oss_server
from conftest import FIXTURES

pytest.importorskip("openai_harmony")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inferx_core.chat_formats import harmony_format  # noqa: E402
from inferx_core.tokenizer import Tokenizer  # noqa: E402

GPT_OSS = FIXTURES / "tokenizers" / "gpt-oss"
RETURN, CALL = 200002, 200012

# The example output of docs/format.md in openai/harmony ("What is 2 + 2?"), and the token ids
# that document lists for it in its StreamableParser example.
DOC_REPLY = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide '
    "answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
DOC_REPLY_IDS = [
    200005, 35644, 200008, 1844, 31064, 25, 392, 4827, 382, 220, 17, 659, 220, 17, 16842, 12295,
    81645, 13, 51441, 6052, 13, 200007, 200006, 173781, 200005, 17196, 200008, 17, 659, 220, 17,
    314, 220, 19, 13, 200002,
]  # fmt: skip
DOC_REASONING = 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
DOC_CONTENT = "2 + 2 = 4."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(GPT_OSS)


@pytest.fixture(scope="module")
def fmt(tok: Tokenizer) -> Any:
    fmt = harmony_format(tok)
    assert fmt is not None
    return fmt


def test_harmony_is_picked_by_the_tokenizer(tok: Tokenizer) -> None:
    """o200k_harmony (no chat template in the fixture) gets harmony; a templated one does not.
    The fixture's eos is <|return|>, and harmony adds <|call|> as a stop token."""
    assert harmony_format(Tokenizer.from_dir(FIXTURES / "tokenizers" / "qwen")) is None
    assert harmony_format(None) is None
    assert tok.eos_token_ids == {RETURN}
    assert harmony_format(tok).stop_token_ids == (RETURN, CALL)


def test_missing_library_is_a_clear_error(tok: Tokenizer, monkeypatch: Any) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "openai_harmony", None)  # import fails
    with pytest.raises(RuntimeError, match=r"inferx-models\[gptoss\]"):
        harmony_format(tok)


def test_render_matches_the_documented_prompt(tok: Tokenizer, fmt: Any) -> None:
    """openai-harmony's test-data/test_simple_convo_high_effort.txt (v0.0.8), with the
    "Current date" line its docs/format.md system message has. OpenAI's system and developer
    roles both become harmony developer messages."""
    expected = (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n"
        "Current date: 2025-06-28\n\n"
        "Reasoning: high\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every "
        "message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\n"
        "Answer the user's questions like a robot.<|end|>"
        "<|start|>user<|message|>What is the capital of the largest country in the world?<|end|>"
        "<|start|>assistant"
    )
    user = "What is the capital of the largest country in the world?"
    for role in ("system", "developer"):
        messages = [
            {"role": role, "content": "Answer the user's questions like a robot."},
            {"role": "user", "content": user},
        ]
        ids = fmt.render(messages, reasoning_effort="high", today=date(2025, 6, 28))
        assert tok.decode(ids, skip_special_tokens=False) == expected
        assert ids == tok.encode(expected, add_special_tokens=False)


def test_render_effort_history_and_refusals(tok: Tokenizer, fmt: Any) -> None:
    chat = [{"role": "user", "content": "Hi"}]
    text = tok.decode(fmt.render(chat), skip_special_tokens=False)
    assert "\n\nReasoning: medium\n\n" in text  # the default
    assert f"Current date: {date.today().isoformat()}\n" in text
    history = [*chat, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
    text = tok.decode(fmt.render(history, reasoning_effort="low"), skip_special_tokens=False)
    assert "\n\nReasoning: low\n\n" in text
    assert text.endswith(
        "<|start|>user<|message|>Hi<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>"
        "<|start|>user<|message|>?<|end|><|start|>assistant"
    )
    without = tok.decode(fmt.render(chat, add_generation_prompt=False), skip_special_tokens=False)
    assert without.endswith("<|start|>user<|message|>Hi<|end|>")
    with pytest.raises(ValueError, match="reasoning_effort"):
        fmt.render(chat, reasoning_effort="max")
    with pytest.raises(ValueError, match="no earlier assistant message"):
        fmt.render([*chat, {"role": "tool", "content": "{}"}])


def test_parse_the_documented_reply_whole_and_token_by_token(tok: Tokenizer, fmt: Any) -> None:
    ids = tok.encode(DOC_REPLY, add_special_tokens=False)
    assert ids == DOC_REPLY_IDS
    assert fmt.parse(ids) == (DOC_REASONING, DOC_CONTENT)
    parser = fmt.parser()
    deltas = [parser.push([t]) for t in ids]
    assert "".join(r for r, _ in deltas) == DOC_REASONING
    assert "".join(c for _, c in deltas) == DOC_CONTENT
    # reasoning first, then content, never both from one token
    kinds = [("r" if r else "") + ("c" if c else "") for r, c in deltas if r or c]
    assert kinds == sorted(kinds, key=lambda k: k == "c") and "rc" not in kinds


def test_parse_holds_back_split_characters_and_keeps_tool_calls(tok: Tokenizer, fmt: Any) -> None:
    reply = "<|channel|>analysis<|message|>Think 🦜 日本<|end|><|start|>assistant<|channel|>final<|message|>𝔘𝔫𝔦 🦜 ok<|return|>"  # noqa: E501
    ids = tok.encode(reply, add_special_tokens=False)
    parser = fmt.parser()
    deltas = [parser.push([t]) for t in ids]
    assert all("\ufffd" not in r + c for r, c in deltas)
    assert ("".join(r for r, _ in deltas), "".join(c for _, c in deltas)) == (
        "Think 🦜 日本",
        "𝔘𝔫𝔦 🦜 ok",
    )
    # A tool call, for a request without tools: its raw arguments land in reasoning_content.
    call = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}<|call|>'
    )
    assert fmt.parse(tok.encode(call, add_special_tokens=False)) == (
        'Need the weather.{"city": "SF"}',
        "",
    )
    # A reply that ignores the format shows nothing, and does not fail.
    assert fmt.parse(tok.encode("Hello there, how are you?", add_special_tokens=False)) == ("", "")
    broken = tok.encode("<|channel|>final<|message|>Hi<|end|>stray", add_special_tokens=False)
    assert fmt.parse(broken) == ("", "Hi")


# -- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def harmony_server(tok: Tokenizer) -> Any:
    yield from serve_scripted(tok, "gpt-oss", DOC_REPLY_IDS, max_model_len=1024)


def _sse(body: str) -> list[dict[str, Any]]:
    events = [line[6:] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_server_chat_returns_reasoning_and_content(harmony_server: Any, tok: Tokenizer) -> None:
    import httpx

    executor = harmony_server.engine.executor
    executor.script = DOC_REPLY_IDS
    client = openai_client(harmony_server.url)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    whole = client.chat.completions.create(
        model="gpt-oss", messages=messages, reasoning_effort="low", max_tokens=100
    )
    choice = whole.choices[0]
    assert choice.message.content == DOC_CONTENT
    assert choice.message.model_extra["reasoning_content"] == DOC_REASONING
    assert choice.finish_reason == "stop"  # at <|return|>, the tokenizer's eos
    assert whole.usage.completion_tokens == len(DOC_REPLY_IDS)
    prompt = tok.decode(executor.prompt, skip_special_tokens=False)
    assert "\n\nReasoning: low\n\n" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in prompt
    assert prompt.endswith("<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    assert whole.usage.prompt_tokens == len(executor.prompt)

    # Streamed, two choices: each choice's deltas add up to the whole reply, reasoning first.
    stream = client.chat.completions.create(
        model="gpt-oss", messages=messages, max_tokens=100, n=2, stream=True
    )
    parts: dict[int, list[tuple[str, str]]] = {0: [], 1: []}
    finish = {}
    for chunk in stream:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            parts[c.index].append((extra.get("reasoning_content") or "", c.delta.content or ""))
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for index in (0, 1):
        assert "".join(r for r, _ in parts[index]) == DOC_REASONING
        assert "".join(c for _, c in parts[index]) == DOC_CONTENT
        # (a chunk may carry both, when the tokens of a few steps go out together)
        first_content = next(i for i, (_, c) in enumerate(parts[index]) if c)
        assert not any(r for r, _ in parts[index][first_content + 1 :]), parts[index]
    assert finish == {0: "stop", 1: "stop"}

    # reasoning_effort is one of three, and /v1/completions has none.
    body = {"messages": messages, "reasoning_effort": "extreme"}
    r = httpx.post(harmony_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    r = httpx.post(
        harmony_server.url + "/v1/completions", json={"prompt": "x", "reasoning_effort": "low"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
    # A tool message is a 400 that says why, not a 500.
    body = {"messages": [*messages, {"role": "tool", "content": "{}"}]}
    r = httpx.post(harmony_server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "tool" in r.json()["error"]["message"]


def test_server_chat_stops_at_call(harmony_server: Any, tok: Tokenizer) -> None:
    """<|call|> is no eos of the fixture: the server's harmony stop tokens end the reply, whose
    tool call (the request has no tools) comes back raw in reasoning_content, content empty."""
    import httpx

    call = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "SF"}<|call|>'
    )
    script = tok.encode(call, add_special_tokens=False)
    harmony_server.engine.executor.script = script
    body = {"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 50}
    r = httpx.post(harmony_server.url + "/v1/chat/completions", json=body)
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == ""
    assert choice["message"]["reasoning_content"] == '{"city": "SF"}'
    assert r.json()["usage"]["completion_tokens"] == len(script)
    events = _sse(
        httpx.post(harmony_server.url + "/v1/chat/completions", json={**body, "stream": True}).text
    )
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == '{"city": "SF"}'
    assert "".join(d.get("content", "") for d in deltas) == ""
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_tiny_gpt_oss_serves_harmony_chat(tmp_path: Any, tok: Tokenizer) -> None:
    """The real model path: tiny-gpt-oss's shapes with the tokenizer's full vocabulary (the
    preset's 320 ids would not cover o200k), random weights. Its reply is noise, so this checks
    that the harmony prompt runs and the response is well formed."""
    import httpx

    with tiny_gpt_oss_server(tmp_path, 512) as server:
        body = {
            "messages": [{"role": "user", "content": "Hi"}],
            "reasoning_effort": "high",
            "max_tokens": 8,
        }
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert isinstance(out["choices"][0]["message"]["content"], str)
        assert out["choices"][0]["finish_reason"] in ("stop", "length")
        ids = harmony_format(tok).render(body["messages"], reasoning_effort="high")
        assert out["usage"]["prompt_tokens"] == len(ids)
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200 and _sse(r.text)
