"""Tool calling: the parsers per family on recorded replies (whole, streamed in awkward chunks,
malformed), and the server with a scripted "model" (real Qwen, Llama 3.1 and gpt-oss tokenizers)
through the official openai client: tools and tool messages rendered by the template (or
harmony), `message.tool_calls` and finish_reason "tool_calls", streamed call deltas exactly as
OpenAI streams them, and 400s naming the field."""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from chat_servers import llama31_tokenizer, openai_client, serve_scripted
from conftest import FIXTURES

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inferx_core.tokenizer import Tokenizer  # noqa: E402
from inferx_server.tool_parsers import (  # noqa: E402
    PARSERS,
    HermesParser,
    Llama3Parser,
    ToolCall,
    family_of,
    parse_all,
)

TOKENIZERS = FIXTURES / "tokenizers"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}

# Recorded replies, in each family's exact format.
QWEN_TWO_CALLS = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Paris"}}\n</tool_call>'
)
# A short template in Llama 3.1's way with tools (JSON calls, <|python_tag|>, ipython results).
LLAMA31_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    'Respond with a JSON function call {"name": ..., "parameters": ...}.\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>"
    "\n\n<|python_tag|>{% for c in m.tool_calls %}{{ {'name': c.function.name, "
    "'parameters': c.function.arguments} | tojson }}{% endfor %}<|eom_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
    "\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
LLAMA_CALL = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'


def _stream(parser: Any, text: str, cuts: list[int]) -> list[Any]:
    events = []
    last = 0
    for cut in [*cuts, len(text)]:
        events += parser.push(text[last:cut])
        last = cut
    return events + parser.finish()


def _merged(events: list[Any]) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    content = "".join(e for e in events if isinstance(e, str))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    return content, calls


def test_hermes_whole_reply() -> None:
    content, calls = parse_all("hermes", QWEN_TWO_CALLS)
    assert content == "Let me check both.\n\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("get_time", {"zone": "Europe/Paris"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse_all("hermes", "No tools needed.") == ("No tools needed.", [])


@pytest.mark.parametrize("seed", range(20))
def test_hermes_streamed_in_random_chunks_equals_whole(seed: int) -> None:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(QWEN_TWO_CALLS)), rng.randint(1, 30)))
    events = _stream(HermesParser(), QWEN_TWO_CALLS, cuts)
    parser = PARSERS["hermes"]()
    assert _merged(events) == _merged(parser.push(QWEN_TWO_CALLS))  # closed calls need no finish
    assert parser.finish() == []
    # No markup ever reaches content.
    assert all("<" not in e for e in events if isinstance(e, str))


def test_hermes_awkward_boundaries_and_held_back_text() -> None:
    p = HermesParser()
    assert p.push("Hi <tool") == ["Hi "]  # "<tool" may open a call: held back
    assert p.push("_ca") == []
    assert p.push('ll>{"name": "f", "argu') == []
    events = p.push('ments": {"a": [1, "</tool"]}}</tool_call> bye')
    assert _merged(events) == (" bye", [("f", {"a": [1, "</tool"]})])
    assert p.finish() == []
    # "<to" followed by something else is content after all.
    p = HermesParser()
    assert p.push("a <to") == ["a "]
    assert p.push("p> b") == ["<top> b"]
    # A lone "<" at the very end is released by finish.
    p = HermesParser()
    assert p.push("x <") == ["x "] and p.finish() == ["<"]


def test_hermes_malformed_falls_back_to_content() -> None:
    bad = "<tool_call>\n{name: get_weather}\n</tool_call>"
    assert parse_all("hermes", "A " + bad) == ("A " + bad, [])
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_all("hermes", no_name) == (no_name, [])
    # An unclosed call at the end: a complete JSON object is still a call; a cut one is text.
    content, calls = parse_all("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n')
    assert content == "" and [c.name for c in calls] == ["f"]
    cut = '<tool_call>{"name": "f", "argum'
    assert parse_all("hermes", cut) == (cut, [])
    # Arguments given as JSON text are decoded; anything but an object is no call.
    _, calls = parse_all(
        "hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert json.loads(calls[0].arguments) == {"a": 1}
    listy = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    assert parse_all("hermes", listy) == (listy, [])


@pytest.mark.parametrize("seed", range(10))
def test_llama3_calls_whole_and_streamed(seed: int) -> None:
    two = LLAMA_CALL + '; {"name": "get_time", "parameters": {"zone": "UTC"}}'
    rng = random.Random(seed)
    for reply, want in (
        (LLAMA_CALL, [("get_weather", {"city": "Paris"})]),
        (LLAMA_CALL.removeprefix("<|python_tag|>"), [("get_weather", {"city": "Paris"})]),
        (two, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]),
    ):
        cuts = sorted(rng.sample(range(1, len(reply)), 5))
        assert _merged(_stream(Llama3Parser(), reply, cuts)) == ("", want)
    # Plain text streams as it comes; malformed JSON comes back as content.
    p = Llama3Parser()
    assert p.push("  The") == ["  The"] and p.push(" answer") == [" answer"] and p.finish() == []
    for bad in ('{"name": "f", "parameters": ', '{"city": "Paris"}', '{"name": "f"} trailing'):
        assert parse_all("llama3", bad) == (bad, [])


def test_family_of_templates() -> None:
    qwen = Tokenizer.from_dir(TOKENIZERS / "qwen")
    llama = Tokenizer.from_dir(TOKENIZERS / "llama3")
    assert family_of(qwen.chat_template) == ("hermes", True)
    # The fixture is Llama 3's (no tools): the server renders the hermes fallback for it.
    assert family_of(llama.chat_template) == ("hermes", False)
    assert family_of(LLAMA31_TEMPLATE) == ("llama3", True)
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endfor %}"
    assert family_of(chatml) == ("hermes", False)


# -- through the server, with a scripted model ---------------------------------------------------


def _serve(name: str, template: str | None = None) -> Iterator[Any]:
    tok = Tokenizer.from_dir(TOKENIZERS / name)
    if template is not None:
        tok.chat_template = template
    yield from serve_scripted(tok, name)


@pytest.fixture(scope="module")
def qwen_server() -> Iterator[Any]:
    yield from _serve("qwen")


@pytest.fixture(scope="module")
def llama_server() -> Iterator[Any]:
    yield from _serve("llama3", LLAMA31_TEMPLATE)


def _client(server: Any) -> Any:
    return openai_client(server.url)


def _script(server: Any, reply: str, end: str) -> None:
    tok = server.tok
    server.engine.executor.script = tok.encode(reply + end, add_special_tokens=False)


def _stream_calls(stream: Any) -> tuple[str, dict[int, dict[str, Any]], list[str | None]]:
    """A streamed reply's content and calls joined by index, checking each delta's shape: a
    call's first delta has id, type, name and arguments ""; later ones index and arguments."""
    content, calls, finish = [], {}, []
    for chunk in stream:
        for c in chunk.choices:
            content.append(c.delta.content or "")
            finish.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                if d.index not in calls:
                    assert d.id.startswith("call_") and d.type == "function"
                    assert d.function.name and d.function.arguments == ""
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and d.type is None and d.function.name is None
                    calls[d.index]["arguments"] += d.function.arguments
    return "".join(content), calls, finish


def test_qwen_round_trip(qwen_server: Any) -> None:
    client = _client(qwen_server)
    _script(qwen_server, QWEN_TWO_CALLS, "<|im_end|>")
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    r = client.chat.completions.create(
        model="qwen", messages=messages, tools=[WEATHER, TIME], max_tokens=200
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check both.\n\n"
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "unit": "C"}),
        ("function", "get_time", {"zone": "Europe/Paris"}),
    ]
    prompt = qwen_server.tok.decode(qwen_server.engine.executor.prompt, skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in prompt

    # Streamed: the same calls as deltas, no markup in content.
    content, streamed, finish = _stream_calls(
        client.chat.completions.create(
            model="qwen", messages=messages, tools=[WEATHER, TIME], max_tokens=200, stream=True
        )
    )
    assert content == "Let me check both.\n\n" and finish[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]

    # The results fed back: the template renders the calls and the tool messages.
    _script(qwen_server, "It is 18 C in Paris.", "<|im_end|>")
    history = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": calls[1].id, "content": '"14:00"'},
    ]
    r = client.chat.completions.create(
        model="qwen", messages=history, tools=[WEATHER, TIME], max_tokens=50
    )
    assert r.choices[0].message.content == "It is 18 C in Paris."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    prompt = qwen_server.tok.decode(qwen_server.engine.executor.prompt, skip_special_tokens=False)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
        in prompt
    )
    assert '<tool_response>\n{"temp": 18}\n</tool_response>' in prompt
    assert '<tool_response>\n"14:00"\n</tool_response>' in prompt

    # tool_choice "none": tools are not shown and the reply is not parsed.
    _script(qwen_server, QWEN_TWO_CALLS, "<|im_end|>")
    r = client.chat.completions.create(
        model="qwen", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=200
    )
    assert r.choices[0].message.content == QWEN_TWO_CALLS and r.choices[0].finish_reason == "stop"
    prompt = qwen_server.tok.decode(qwen_server.engine.executor.prompt, skip_special_tokens=False)
    assert "get_weather" not in prompt


def test_qwen_malformed_call_is_content(qwen_server: Any, monkeypatch: Any) -> None:
    """With server.tool_call_grammar "off" (the default) a malformed call is content; with
    "lazy" the grammar refuses it (the scripted model ignores the mask: the reply ends at the
    refused token, which a sampling model could not have picked)."""
    bad = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    monkeypatch.setattr(qwen_server.state, "tool_call_grammar", "lazy")
    _script(qwen_server, bad, "<|im_end|>")
    client = _client(qwen_server)
    messages = [{"role": "user", "content": "?"}]
    r = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == '<tool_call>\n{"name": get'
    monkeypatch.setattr(qwen_server.state, "tool_call_grammar", "off")
    r = client.chat.completions.create(model="qwen", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"
    content, calls, _ = _stream_calls(
        client.chat.completions.create(
            model="qwen", messages=messages, tools=[WEATHER], stream=True
        )
    )
    assert content == bad and calls == {}


def test_llama3_round_trip(llama_server: Any) -> None:
    client = _client(llama_server)
    _script(llama_server, LLAMA_CALL, "<|end_of_text|>")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for stream in (True, False):
        r = client.chat.completions.create(
            model="llama3", messages=messages, tools=[WEATHER], max_tokens=100, stream=stream
        )
        if stream:
            content, calls, finish = _stream_calls(r)
            got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
            assert content == "" and finish[-1] == "tool_calls"
        else:
            msg = r.choices[0].message
            got = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
            assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
        assert got == [("get_weather", {"city": "Paris"})]
    prompt = llama_server.tok.decode(llama_server.engine.executor.prompt, skip_special_tokens=False)
    assert json.dumps(WEATHER) in prompt
    # The result fed back.
    _script(llama_server, "18 C.", "<|end_of_text|>")
    history = [
        *messages,
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 18}'},
    ]
    r = client.chat.completions.create(model="llama3", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "18 C." and r.choices[0].finish_reason == "stop"
    prompt = llama_server.tok.decode(llama_server.engine.executor.prompt, skip_special_tokens=False)
    assert (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>' in prompt
    )
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 18}<|eot_id|>' in prompt


def test_bad_tool_requests_are_400s_naming_the_field(qwen_server: Any) -> None:
    url = qwen_server.url + "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]

    def error(body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(url, json={"messages": user, **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    assert error({"tools": {"type": "function"}})["param"] == "tools"
    assert error({"tools": [{"type": "function"}]})["param"] == "tools[0]"
    assert error({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})["param"].startswith(
        "tools[0]"
    )
    err = error(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    )
    assert err["param"] == "tool_choice" and "nope" in err["message"]
    err = error({"tool_choice": "required"})
    assert err["param"] == "tool_choice" and "needs tools" in err["message"]
    assert error({"tool_choice": "sometimes"})["param"] == "tool_choice"
    bad_params = {**WEATHER, "function": {"name": "f", "parameters": {"type": "array"}}}
    err = error({"tools": [bad_params]})
    assert err["param"] == "tools[0].function.parameters" and "object" in err["message"]
    err = error({"tools": [WEATHER, WEATHER]})
    assert err["param"] == "tools" and "repeated" in err["message"]
    r = httpx.post(qwen_server.url + "/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
    'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}<|call|>'
)


@pytest.fixture(scope="module")
def harmony_server() -> Iterator[Any]:
    pytest.importorskip("openai_harmony")
    yield from _serve("gpt-oss")


def test_harmony_round_trip(harmony_server: Any) -> None:
    client = _client(harmony_server)
    _script(harmony_server, HARMONY_CALL, "")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "SF?"}]
    r = client.chat.completions.create(
        model="gpt-oss", messages=messages, tools=[WEATHER], max_tokens=100
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "SF"
    }
    prompt = harmony_server.tok.decode(harmony_server.engine.executor.prompt, False)
    assert (
        "# Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {" in prompt
    )
    assert "type get_weather = (_: {" in prompt

    # Streamed: arguments come in fragments as the model writes them.
    content, calls, finish = _stream_calls(
        client.chat.completions.create(
            model="gpt-oss", messages=messages, tools=[WEATHER], max_tokens=100, stream=True
        )
    )
    assert content == "" and finish[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "SF"})
    ]

    # The result fed back as the function's commentary message.
    _script(harmony_server, "<|channel|>final<|message|>18 C.", "<|return|>")
    history = [
        *messages,
        choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 18}'},
    ]
    r = client.chat.completions.create(model="gpt-oss", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "18 C." and r.choices[0].finish_reason == "stop"
    prompt = harmony_server.tok.decode(harmony_server.engine.executor.prompt, False)
    assert (
        "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
        '<|message|>{"city": "SF"}<|call|>'
    ) in prompt
    assert (
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>{"temp": 18}<|end|>'
    ) in prompt
    # A tool message that answers no call is a 400.
    bad = [*messages, {"role": "tool", "tool_call_id": "call_x", "content": "{}"}]
    r = httpx.post(harmony_server.url + "/v1/chat/completions", json={"messages": bad})
    assert r.status_code == 400 and "call_x" in r.json()["error"]["message"]

    # "required" and the named function: the recorded call is what the grammar allows.
    _script(harmony_server, HARMONY_CALL, "")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        r = client.chat.completions.create(
            model="gpt-oss", messages=messages, tools=[WEATHER, TIME], tool_choice=choice
        )
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather",
            {"city": "SF"},
        )
    # Naming the other function, the same reply is refused where it names get_weather (the
    # scripted model ignores the mask, so its reply ends there, with no call).
    other = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model="gpt-oss", messages=messages, tools=[WEATHER, TIME], tool_choice=other
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("parallel", [False, True])
def test_required_grammar_holds_qwen_to_a_call(parallel: bool) -> None:
    """The grammar of tool_choice "required" for Qwen: its markers are special tokens (written
    as token ids), the arguments held to the function's schema."""
    pytest.importorskip("llguidance")
    from inferx_server.grammar_llguidance import LLGuidanceBackend
    from inferx_server.tool_grammars import tool_grammar

    tok = Tokenizer.from_dir(TOKENIZERS / "qwen")
    funcs = [t["function"] for t in (WEATHER, TIME)]
    grammar = tool_grammar(tok, "hermes", funcs, required=True, parallel=parallel)
    assert "<[151657]>" in grammar and "<[151658]>" in grammar
    backend = LLGuidanceBackend(tok, 151936)
    compiled = backend.compile(grammar, "lark")

    def accepts(text: str) -> tuple[bool, bool]:
        m = backend.matcher(compiled)
        ok = all(m.accept(t) for t in tok.encode(text, add_special_tokens=False))
        return ok, m.is_terminated()

    one = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
        "\n</tool_call>"
    )
    assert accepts(one) == (True, not parallel)
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert accepts(two)[0] == parallel
    assert not accepts('<tool_call>\n{"name": "get_news", "arguments": {}}')[0]
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "K"')[0]
    assert not accepts("Sure")[0]


# -- Llama 3.1: Meta's template, replies ending at <|eom_id|> ------------------------------------

EOM, EOT, PYTHON_TAG = 128008, 128009, 128010
LLAMA31_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
PARIS = [("get_weather", {"city": "Paris"})]
ASK_WEATHER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def llama31(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(llama31_tokenizer(tmp_path_factory.mktemp("llama31")))


@pytest.fixture(scope="module")
def llama31_server(llama31: Tokenizer) -> Iterator[Any]:
    yield from serve_scripted(llama31, "llama31")


def _script_ids(server: Any, reply: str, end: int) -> list[int]:
    """The scripted model writes `reply`, then the token `end` (then "." until max_tokens)."""
    ids = server.tok.encode(reply, add_special_tokens=False) + [end]
    server.engine.executor.script = ids
    return ids


def test_llama31_replies_end_at_eom_and_eot(llama31: Tokenizer) -> None:
    """Llama 3's end of turn and 3.1's end of message both end a reply, from the tokenizer alone:
    this one has no generation_config.json and its eos_token is <|eot_id|>. Llama 3's own
    vocabulary (128008 a reserved token there) gets <|eot_id|> beside <|end_of_text|>."""
    assert llama31.eos_token_ids == {EOM, EOT}
    ids = llama31.encode("<|python_tag|>{}<|eom_id|>", add_special_tokens=False)
    assert ids[0] == PYTHON_TAG and ids[-1] == EOM
    assert Tokenizer.from_dir(TOKENIZERS / "llama3").eos_token_ids == {128001, EOT}
    assert family_of(llama31.chat_template) == ("llama3", True)


@pytest.mark.parametrize("grammar", ["lazy", "off"])
@pytest.mark.parametrize("tag", ["", "<|python_tag|>"])
def test_llama31_call_ending_at_eom(
    llama31_server: Any, monkeypatch: Any, caplog: Any, grammar: str, tag: str
) -> None:
    """A recorded call closed by <|eom_id|>, as Llama 3.1 closes one in its ipython environment
    (which Meta's template declares whenever tools are given), with and without <|python_tag|>:
    the reply stops there (the scripted model would write "." after it up to max_tokens) and
    is one tool call with finish_reason "tool_calls", whole and streamed. Under the lazy
    grammar <|eom_id|> is one of the call's allowed ends, not a token the grammar refuses."""
    monkeypatch.setattr(llama31_server.state, "tool_call_grammar", grammar)
    script = _script_ids(llama31_server, tag + LLAMA31_CALL, EOM)
    client = _client(llama31_server)
    kw: dict[str, Any] = dict(
        model="llama31", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=100
    )
    with caplog.at_level(logging.WARNING, logger="inferx"):
        r = client.chat.completions.create(**kw)
        content, calls, finish = _stream_calls(client.chat.completions.create(**kw, stream=True))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == PARIS
    assert r.usage.completion_tokens == len(script)
    assert content == "" and finish[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == PARIS
    assert "refused" not in caplog.text


def test_llama31_eom_kept_as_text_still_ends_the_call(llama31_server: Any) -> None:
    """With skip_special_tokens false the reply's text ends with "<|eom_id|>": the parser takes
    it as the call's end, not as content that would turn the call into text."""
    _script_ids(llama31_server, "<|python_tag|>" + LLAMA31_CALL, EOM)
    client = _client(llama31_server)
    kw: dict[str, Any] = dict(
        model="llama31", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=100,
        extra_body={"skip_special_tokens": False},
    )  # fmt: skip
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == PARIS
    content, calls, finish = _stream_calls(client.chat.completions.create(**kw, stream=True))
    assert content == "" and finish[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == PARIS
    # A text reply keeps its end marker as text, as asked.
    _script_ids(llama31_server, "Sunny.", EOT)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == "Sunny.<|eot_id|>"
    assert r.choices[0].finish_reason == "stop"


def test_llama31_round_trip_renders_as_metas_template(
    llama31_server: Any, llama31: Tokenizer
) -> None:
    """The conversation goes back through Meta's template exactly as transformers renders it:
    "Environment: ipython" in the system message (tools given), the tools in the first user
    message, the call as `{"name": ..., "parameters": ...}<|eot_id|>` and the result as an
    ipython message. The answer then ends at <|eot_id|> with finish_reason "stop". Two calls in
    one assistant turn are a 400 with the template's own reason: Meta's template renders one."""
    transformers = pytest.importorskip("transformers")
    client = _client(llama31_server)
    _script_ids(llama31_server, LLAMA31_CALL, EOM)
    r = client.chat.completions.create(model="llama31", messages=ASK_WEATHER, tools=[WEATHER])
    msg = r.choices[0].message
    first = llama31.decode(llama31_server.engine.executor.prompt, skip_special_tokens=False)
    assert first.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    )
    assert json.dumps(WEATHER, indent=4) + "\n\nWeather in Paris?<|eot_id|>" in first

    answer = _script_ids(llama31_server, "It is 18 C in Paris.", EOT)
    history = [
        *ASK_WEATHER,
        msg.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": '{"temp": 18}'},
    ]
    r = client.chat.completions.create(model="llama31", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 18 C in Paris."
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.usage.completion_tokens == len(answer)
    prompt = llama31_server.engine.executor.prompt
    text = llama31.decode(prompt, skip_special_tokens=False)
    assert (
        "<|start_header_id|>assistant<|end_header_id|>\n\n" + LLAMA31_CALL + "<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n"
        + json.dumps('{"temp": 18}')  # the template writes a string result as JSON text
        + "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ) in text
    # transformers, given the same conversation as its users write it (arguments decoded).
    hf = transformers.AutoTokenizer.from_pretrained(llama31.name_or_path)
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    reference = [
        *ASK_WEATHER,
        {"role": "assistant", "tool_calls": [{"type": "function", "function": call}]},
        history[2],
    ]
    rendered = hf.apply_chat_template(
        reference, tools=[WEATHER], tokenize=False, add_generation_prompt=True
    )
    assert prompt == llama31.encode(rendered, add_special_tokens=False)

    two = msg.model_dump(exclude_none=True)
    two["tool_calls"] = [two["tool_calls"][0], {**two["tool_calls"][0], "id": "call_2"}]
    body = {"model": "llama31", "messages": [*ASK_WEATHER, two], "tools": [WEATHER]}
    err = httpx.post(llama31_server.url + "/v1/chat/completions", json=body)
    assert err.status_code == 400 and "single tool-calls" in err.json()["error"]["message"]


@pytest.mark.parametrize("required", [False, True])
def test_llama31_grammar_lets_a_call_end_at_eom(llama31: Tokenizer, required: bool) -> None:
    """The grammar holding a Llama 3.1 call (tool_choice "auto" and "required"): once the
    call's JSON is complete, <|eom_id|> and <|eot_id|> are both allowed (the grammar's ends are
    the tokenizer's eos ids), so a sampling model may close its call as it was trained to."""
    pytest.importorskip("llguidance")
    import torch

    from inferx_server.grammar_llguidance import LLGuidanceBackend
    from inferx_server.tool_grammars import tool_grammar

    vocab = 128256
    backend = LLGuidanceBackend(llama31, vocab)
    grammar = tool_grammar(llama31, "llama3", [WEATHER["function"]], required=required)
    compiled = backend.compile(grammar, "lark")
    for reply in (LLAMA31_CALL, "<|python_tag|>" + LLAMA31_CALL):
        m = backend.matcher(compiled)
        assert all(m.accept(t) for t in llama31.encode(reply, add_special_tokens=False)), reply
        mask = torch.zeros(1, vocab // 32, dtype=torch.int32)
        backend.fill_bitmask([m], mask)

        def allowed(t: int, mask: torch.Tensor = mask) -> bool:
            return bool((int(mask[0, t // 32]) >> (t % 32)) & 1)

        assert allowed(EOM) and allowed(EOT) and not allowed(PYTHON_TAG)
        assert m.accept(EOM) and m.is_terminated()
