"""The grammars that hold tool calls (inferx_server.tool_grammars), driven token by token with
the real tokenizers (Qwen, Llama 3, gpt-oss's o200k_harmony) through llguidance's matcher:
recorded replies in each family's format are accepted, a wrong function name, arguments off the
schema or (for a required call) a plain answer are refused. Then gpt-oss through the server: a
required and a named call on a tiny random gpt-oss (the mask makes the call), and the check of
the tools' schemas (400s naming the tool)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from chat_servers import openai_client, tiny_gpt_oss_server
from conftest import FIXTURES

pytest.importorskip("llguidance")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from inferx_core.tokenizer import Tokenizer  # noqa: E402
from inferx_server.grammar_llguidance import LLGuidanceBackend  # noqa: E402
from inferx_server.tool_grammars import schema_problem, tool_grammar  # noqa: E402

TOKENIZERS = FIXTURES / "tokenizers"
VOCAB = {"qwen": 151936, "llama3": 128256, "gpt-oss": 201088}
RETURN, CALL = 200002, 200012

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {}}}}
FUNCS = [WEATHER, TIME]

# Harmony replies as gpt-oss writes them (harmony's docs/format.md has both JSON spacings and
# the recipient in the channel part, with and without a space before <|constrain|>).
H_CALL = (
    "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}'
    "<|call|>"
)
H_ROLE_CALL = (
    ' to=functions.get_time<|channel|>commentary<|constrain|>json<|message|>{"zone": "UTC"}<|call|>'
)
H_PREAMBLE_CALL = (
    "<|channel|>commentary<|message|>Checking the weather.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF", '
    '"unit": "C"}<|call|>'
)
H_FINAL = (
    "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
    "Hi!<|return|>"
)
H_WRONG_NAME = "<|channel|>commentary to=functions.get_news <|constrain|>json<|message|>{}<|call|>"
H_WRONG_ARGS = (
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"unit":"K"}'
    "<|call|>"
)


@pytest.fixture(scope="module")
def toks() -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_dir(TOKENIZERS / name) for name in VOCAB}


_backends: dict[tuple[str, frozenset[int]], LLGuidanceBackend] = {}


def _run(tok: Tokenizer, name: str, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of `text` accepted, the grammar then complete), fed one token at a time."""
    key = (name, frozenset(tok.eos_token_ids))
    if key not in _backends:
        _backends[key] = LLGuidanceBackend(tok, VOCAB[name])
    backend = _backends[key]
    m = backend.matcher(backend.compile(grammar, "lark"))
    for token in tok.encode(text, add_special_tokens=False):
        if not m.accept(token):
            return False, False
    return True, m.is_terminated()


def _grammar(tok: Tokenizer, family: str, required: bool, funcs: Any = None, **kw: Any) -> str:
    return tool_grammar(tok, family, FUNCS if funcs is None else funcs, required=required, **kw)


@pytest.mark.parametrize("call_is_eos", [False, True])
def test_harmony_required_and_named(toks: dict[str, Tokenizer], call_is_eos: bool) -> None:
    """A required call: analysis or preamble messages, then a commentary message to one of the
    functions with `<|constrain|>json` and its arguments, ending at <|call|>. Real gpt-oss
    checkpoints list <|call|> among their eos ids; the fixture does not: both hold."""
    tok = toks["gpt-oss"]
    if call_is_eos:
        tok = Tokenizer.from_dir(TOKENIZERS / "gpt-oss")
        tok.eos_token_ids = {RETURN, 199999, CALL}
    g = _grammar(tok, "harmony", True)
    for reply in (H_CALL, H_ROLE_CALL, H_PREAMBLE_CALL):
        assert _run(tok, "gpt-oss", g, reply) == (True, True), reply
    for reply in (H_FINAL, H_WRONG_NAME, H_WRONG_ARGS, "Sure, it is sunny."):
        assert not _run(tok, "gpt-oss", g, reply)[0], reply
    # The call is not complete before <|call|>.
    assert _run(tok, "gpt-oss", g, H_CALL.removesuffix("<|call|>")) == (True, False)
    # Named: only that function.
    named = _grammar(tok, "harmony", True, [TIME])
    assert _run(tok, "gpt-oss", named, H_ROLE_CALL) == (True, True)
    assert not _run(tok, "gpt-oss", named, H_CALL)[0]


def test_harmony_lazy(toks: dict[str, Tokenizer]) -> None:
    """tool_choice auto: messages of the three channels, a final answer included; a header
    addressed `to=functions.` is a call, held to the tools' names and schemas. The same words
    in a message's text are text."""
    tok = toks["gpt-oss"]
    g = _grammar(tok, "harmony", False)
    for reply in (H_CALL, H_ROLE_CALL, H_PREAMBLE_CALL, H_FINAL):
        assert _run(tok, "gpt-oss", g, reply) == (True, True), reply
    assert not _run(tok, "gpt-oss", g, H_WRONG_NAME)[0]
    assert not _run(tok, "gpt-oss", g, H_WRONG_ARGS)[0]
    musing = (
        "<|channel|>analysis<|message|>Maybe to=functions.get_news? No.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>No news.<|return|>"
    )
    assert _run(tok, "gpt-oss", g, musing) == (True, True)
    # A call to a recipient that is no function of the request cannot end as a call.
    assert not _run(tok, "gpt-oss", g, "<|channel|>commentary to=python<|message|>1<|call|>")[0]


QWEN_ONE = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
    "</tool_call>"
)
QWEN_TWO = (
    QWEN_ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)


@pytest.mark.parametrize("name", ["qwen", "llama3"])
def test_hermes_lazy(toks: dict[str, Tokenizer], name: str) -> None:
    """Qwen's <tool_call> is one token (the trigger is that token); the Llama 3 fixture (with
    the hermes fallback) spells it in pieces (a lazy lexeme ends at the text). Text before,
    between and after calls is free, Qwen3's <think> tokens included."""
    tok = toks[name]
    g = _grammar(tok, "hermes", False)
    think = "<think>\nThe user wants the weather.\n</think>\n\n" if name == "qwen" else ""
    for reply in (
        "Paris is sunny today.",
        think + "Let me check.\n" + QWEN_TWO + "\nDone.",
        QWEN_ONE,
        "",
    ):
        assert _run(tok, name, g, reply) == (True, False), reply
    assert not _run(tok, name, g, 'Hm <tool_call>\n{"name": "get_news", "arguments": {}}')[0]
    assert not _run(tok, name, g, '<tool_call>\n{"name": "get_weather", "arguments": {"u')[0]
    assert not _run(tok, name, g, '<tool_call> {"name": "get_weather"')[0]  # the newline
    # parallel_tool_calls false: one call at most, which ends the reply.
    single = _grammar(tok, "hermes", False, parallel=False)
    assert _run(tok, name, single, "Sure.\n" + QWEN_ONE) == (True, True)
    assert _run(tok, name, single, "Sure, no tools.") == (True, False)
    assert not _run(tok, name, single, QWEN_ONE + " ok")[0]
    assert not _run(tok, name, single, QWEN_TWO)[0]


def test_hermes_required_in_pieces(toks: dict[str, Tokenizer]) -> None:
    tok = toks["llama3"]
    g = _grammar(tok, "hermes", True, parallel=False)
    assert '"<tool_call>"' in g  # no token of its own: text
    assert _run(tok, "llama3", g, QWEN_ONE) == (True, True)
    assert not _run(tok, "llama3", g, "Sure")[0]


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def test_llama3_lazy_and_required(toks: dict[str, Tokenizer]) -> None:
    """Llama 3.1: a reply opening with `{` (after spaces, or after <|python_tag|>) is a call;
    any other reply is text."""
    tok = toks["llama3"]
    g = _grammar(tok, "llama3", False)
    two = LLAMA_CALL + '; {"name": "get_time", "parameters": {"zone": "UTC"}}'
    for reply in ("It is sunny {probably}.", "", LLAMA_CALL, "  " + LLAMA_CALL, two):
        assert _run(tok, "llama3", g, reply)[0], reply
    assert _run(tok, "llama3", g, "<|python_tag|>" + LLAMA_CALL)[0]
    assert not _run(tok, "llama3", g, '{"city": "Paris"}')[0]
    assert not _run(tok, "llama3", g, '{"name": "get_news"')[0]
    required = _grammar(tok, "llama3", True, parallel=False)
    assert _run(tok, "llama3", required, LLAMA_CALL) == (True, True)
    assert not _run(tok, "llama3", required, "Sunny.")[0]
    assert not _run(tok, "llama3", required, two)[0]


def test_arguments_schema_keeps_its_refs(toks: dict[str, Tokenizer]) -> None:
    """A function's schema sits at the root of its %json, so its own $defs resolve."""
    tok = toks["qwen"]
    params = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/place"}},
        "required": ["at"],
        "$defs": {"place": {"type": "object", "properties": {"city": {"enum": ["Paris"]}}}},
    }
    g = _grammar(tok, "hermes", True, [{"name": "go", "parameters": params}], parallel=False)
    ok = '<tool_call>\n{"name": "go", "arguments": {"at": {"city": "Paris"}}}\n</tool_call>'
    assert _run(tok, "qwen", g, ok) == (True, True)
    assert not _run(tok, "qwen", g, ok.replace("Paris", "Rome"))[0]


BAD_SCHEMAS = [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, ".properties.a.type", "strin"),
    ({"type": "object", "properties": {"a": 5}}, ".properties.a", "object or a boolean"),
    ({"type": "object", "properties": []}, ".properties", "object of schemas"),
    ({"type": "object", "required": "a"}, ".required", "list of property names"),
    ({"type": "object", "properties": {"a": {"enum": "x"}}}, ".properties.a.enum", "list"),
    ({"type": "object", "properties": {"a": {"minimum": "0"}}}, ".properties.a.minimum", "number"),
    ({"type": "object", "properties": {"a": {"maxLength": -1}}}, ".maxLength", "non-negative"),
    ({"type": "object", "properties": {"a": {"pattern": "("}}}, ".properties.a.pattern", "regular"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, ".properties.a.anyOf", "non-empty"),
    ({"type": "object", "properties": {"a": {"items": 1}}}, ".properties.a.items", "schema"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}}, ".$ref", "#/$defs/b"),
]


@pytest.mark.parametrize(("schema", "where", "words"), BAD_SCHEMAS)
def test_schema_problems_are_named(schema: dict[str, Any], where: str, words: str) -> None:
    problem = schema_problem(schema, "tools[0].function.parameters")
    assert problem is not None and problem.startswith("tools[0].function.parameters"), problem
    assert where in problem and words in problem, problem


def test_valid_schemas_pass() -> None:
    for schema in (
        {"type": "object", "properties": {}},
        WEATHER["parameters"],
        {
            "type": "object",
            "properties": {
                "a": {"type": ["string", "null"], "maxLength": 3},
                "b": {"type": "array", "items": {"$ref": "#/definitions/n"}, "minItems": 1},
                "c": {"anyOf": [{"type": "integer", "minimum": 0}, True]},
                "d": {"pattern": "^[a-z]+$", "format": "anything", "x-custom": [1]},
            },
            "definitions": {"n": {"type": "number", "multipleOf": 0.5}},
            "additionalProperties": False,
        },
    ):
        assert schema_problem(schema, "p") is None, schema


# -- through the server --------------------------------------------------------------------------


def _plan(tok: Tokenizer, body: dict[str, Any], mode: str = "lazy", harmony: bool = False) -> Any:
    import msgspec

    from inferx_core.chat_formats import harmony_format
    from inferx_server.protocol import ChatCompletionRequest
    from inferx_server.requests import _tool_plan

    srv = SimpleNamespace(
        tokenizer=tok,
        chat_format=harmony_format(tok) if harmony else None,
        tool_call_grammar=mode,
    )
    req = msgspec.convert({"messages": [{"role": "user", "content": "?"}], **body},
                          ChatCompletionRequest)  # fmt: skip
    return _tool_plan(srv, req)


def test_plans_pick_the_grammar(toks: dict[str, Tokenizer]) -> None:
    pytest.importorskip("openai_harmony")
    tools = [{"type": "function", "function": f} for f in FUNCS]
    qwen = toks["qwen"]
    lazy = _plan(qwen, {"tools": tools})
    assert lazy.family == "hermes" and lazy.grammar[0] == "lark"
    assert lazy.grammar[1].startswith("%llguidance {}\nstart: seg* tail")
    assert _plan(qwen, {"tools": tools}, mode="off").grammar is None
    assert _plan(qwen, {"tools": tools, "tool_choice": "none"}).grammar is None
    # response_format holds an auto reply instead: no lazy grammar beside it.
    fmt = {"type": "json_object"}
    assert _plan(qwen, {"tools": tools, "response_format": fmt}).grammar is None
    oss = toks["gpt-oss"]
    named = {"type": "function", "function": {"name": "get_time"}}
    plan = _plan(oss, {"tools": tools, "tool_choice": named}, harmony=True)
    assert plan.family == "harmony" and '"commentary to=functions.get_time"' in plan.grammar[1]
    assert "get_weather" not in plan.grammar[1]
    plan = _plan(oss, {"tools": tools}, harmony=True)
    assert '("analysis" | "commentary" | "final")' in plan.grammar[1]


def test_config_key_is_checked() -> None:
    from inferx_core.config import load_config

    assert load_config(None, {}).server.tool_call_grammar == "off"
    lazy = load_config(None, {"server.tool_call_grammar": "lazy"})
    assert lazy.server.tool_call_grammar == "lazy"
    with pytest.raises(ValueError, match="tool_call_grammar"):
        load_config(None, {"server.tool_call_grammar": "eager"})


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory: Any) -> Iterator[Any]:
    """tiny-gpt-oss's shapes with o200k_harmony's full vocabulary, random weights, served."""
    pytest.importorskip("openai_harmony")
    with tiny_gpt_oss_server(tmp_path_factory.mktemp("tiny-gpt-oss"), 1024) as server:
        yield server


# Arguments the random model cannot run on with: an enum, required, nothing else.
UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["C", "F"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_hour",
        "parameters": {
            "type": "object",
            "properties": {"am": {"type": "boolean"}},
            "required": ["am"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tiny_gpt_oss_required_call(tiny_gpt_oss: Any, choice: str) -> None:
    """A random model, held by the grammar: its reply is a call that parses (finish_reason
    "tool_calls", arguments valid for the function). Analysis text would run on for ever in a
    random model, so <|end|> is biased up: it can only be taken where a message may end."""

    client = openai_client(tiny_gpt_oss.url)
    tool_choice: Any = "required"
    names = {"set_unit", "get_hour"}
    if choice == "named":
        tool_choice = {"type": "function", "function": {"name": "get_hour"}}
        names = {"get_hour"}
    kw: dict[str, Any] = dict(
        model="tiny", messages=[{"role": "user", "content": "Use a tool."}],
        tools=[UNIT, CLOCK], tool_choice=tool_choice, max_tokens=300, temperature=1.0,
        logit_bias={"200007": 100},
    )  # fmt: skip
    for seed in (0, 1):
        r = client.chat.completions.create(**kw, seed=seed)
        out = r.choices[0]
        assert out.finish_reason == "tool_calls", out
        [call] = out.message.tool_calls
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        if call.function.name == "set_unit":
            assert set(args) == {"unit"} and args["unit"] in ("C", "F")
        else:
            assert set(args) == {"am"} and isinstance(args["am"], bool)
    # Streamed: the call's deltas add up to a call.
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, seed=2, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] in names and isinstance(json.loads(calls[0]["arguments"]), dict)


def test_bad_tools_are_400s_naming_the_tool(tiny_gpt_oss: Any) -> None:
    url = tiny_gpt_oss.url + "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]

    def error(tools: list[Any], **body: Any) -> dict[str, Any]:
        r = httpx.post(url, json={"messages": user, "tools": tools, **body})
        assert r.status_code == 400, r.text
        return r.json()["error"]

    bad = {"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMAS[0][0]}}
    err = error([UNIT, bad])
    assert err["param"] == "tools[1].function.parameters" and err["code"] == "invalid_schema"
    assert "tools[1].function.parameters.properties.a.type" in err["message"]
    assert "strin" in err["message"] and err["type"] == "invalid_request_error"
    err = error([UNIT, UNIT], tool_choice="required")
    assert err["param"] == "tools" and "set_unit" in err["message"]
    # tool_choice "none" still checks them: a malformed tool is a malformed request.
    assert error([bad], tool_choice="none")["param"] == "tools[0].function.parameters"


def test_tiny_gpt_oss_auto_calls_are_valid(tiny_gpt_oss: Any, monkeypatch: Any) -> None:
    """tool_choice auto (server.tool_call_grammar "lazy"): the random model writes messages
    of any channel (ended at once by the <|end|> bias) or addresses a function; that call is
    held to the function's schema. Each reply is a valid call or no call at all. With "off"
    the same model writes no call: the grammar is what made them."""
    monkeypatch.setattr(tiny_gpt_oss.state, "tool_call_grammar", "lazy")

    client = openai_client(tiny_gpt_oss.url)
    kw: dict[str, Any] = dict(
        model="tiny", messages=[{"role": "user", "content": "Use a tool."}],
        tools=[UNIT, CLOCK], max_tokens=300, temperature=1.0, logit_bias={"200007": 100},
    )  # fmt: skip
    called = 0
    for seed in range(3):
        out = client.chat.completions.create(**kw, seed=seed).choices[0]
        if out.finish_reason == "tool_calls":
            called += 1
            [call] = out.message.tool_calls
            args = json.loads(call.function.arguments)
            assert (call.function.name, set(args)) in (("set_unit", {"unit"}), ("get_hour", {"am"}))
        else:
            assert out.finish_reason in ("length", "stop") and not out.message.tool_calls
    assert called, "no seed made a call"
    monkeypatch.setattr(tiny_gpt_oss.state, "tool_call_grammar", "off")
    for seed in range(2):
        out = client.chat.completions.create(**{**kw, "max_tokens": 60}, seed=seed).choices[0]
        assert out.finish_reason != "tool_calls" and not out.message.tool_calls


def test_harmony_response_format_grammar(toks: dict[str, Tokenizer]) -> None:
    """response_format for gpt-oss: free analysis, then the final channel's JSON."""
    from inferx_server.tool_grammars import harmony_final_json

    tok = toks["gpt-oss"]
    g = harmony_final_json(tok, UNIT["function"]["parameters"])
    final = '<|channel|>final<|message|>{"unit":"C"}'
    assert _run(tok, "gpt-oss", g, final) == (True, True)
    thought = "<|channel|>analysis<|message|>Celsius.<|end|><|start|>assistant"
    assert _run(tok, "gpt-oss", g, thought + final) == (True, True)
    assert not _run(tok, "gpt-oss", g, '<|channel|>final<|message|>{"unit":"K"}')[0]
    assert not _run(tok, "gpt-oss", g, "<|channel|>final<|message|>It is C.")[0]
    assert not _run(tok, "gpt-oss", g, H_CALL)[0]


def test_tiny_gpt_oss_response_format(tiny_gpt_oss: Any) -> None:
    """A chat request to gpt-oss with a JSON schema: the final message is JSON valid for it
    (reasoning first, free); a schema llguidance cannot compile is a 400 on response_format."""

    client = openai_client(tiny_gpt_oss.url)
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["C", "F"]}, "hot": {"type": "boolean"}},
        "required": ["unit", "hot"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    kw: dict[str, Any] = dict(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=200,
        temperature=1.0, logit_bias={"200007": 100}, response_format=fmt,
    )  # fmt: skip
    for seed in (0, 1):
        out = client.chat.completions.create(**kw, seed=seed).choices[0]
        assert out.finish_reason == "stop", out
        answer = json.loads(out.message.content)
        assert set(answer) == {"unit", "hot"} and answer["unit"] in ("C", "F")
        assert isinstance(answer["hot"], bool)
    text = "".join(
        c.delta.content or ""
        for chunk in client.chat.completions.create(**kw, seed=2, stream=True)
        for c in chunk.choices
    )
    assert set(json.loads(text)) == {"unit", "hot"}
    bad = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "strin"}}}
    r = httpx.post(
        tiny_gpt_oss.url + "/v1/chat/completions",
        json={"messages": kw["messages"], "response_format": bad},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    assert "strin" in r.json()["error"]["message"]
