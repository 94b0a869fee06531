"""Structured output end to end on the built-in demo model (SmolLM2-135M on the CPU):
`inferx-server` in a subprocess, the official openai client, `response_format` json_schema over
30+ schemas and json_object, streaming, n=2, /v1/completions, bad schemas as 400s; and the
offline LLM API with and without a step in flight. Every output must parse and validate against
its schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from chat_servers import demo_server, openai_client, require_demo_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
require_demo_model()

pytestmark = pytest.mark.slow

NAME = {"type": "string", "maxLength": 24}
PERSON = {
    "type": "object",
    "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

# (what to ask for, schema). Strings are bounded (maxLength) where a small model could otherwise
# ramble to max_tokens; the grammar is what is under test, not the model's taste.
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", PERSON),
    ("a city", {"type": "object", "properties": {"city": NAME}, "required": ["city"]}),
    ("a yes or no answer", {"type": "boolean"}),
    ("a number between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    (
        "a temperature",
        {
            "type": "object",
            "properties": {
                "celsius": {"type": "integer", "minimum": -50, "maximum": 60},
                "unit": {"const": "C"},
            },
            "required": ["celsius", "unit"],
            "additionalProperties": False,
        },
    ),
    ("a colour", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("nothing", {"type": "null"}),
    ("a constant", {"const": "fixed"}),
    (
        "a status",
        {
            "type": "object",
            "properties": {"status": {"enum": ["active", "inactive", "banned"]}},
            "required": ["status"],
            "additionalProperties": False,
        },
    ),
    (
        "a priority",
        {
            "type": "object",
            "properties": {"p": {"enum": [1, 2, 3]}},
            "required": ["p"],
            "additionalProperties": False,
        },
    ),
    (
        "three fruits",
        {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "one to two tags",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 10},
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["tags"],
        },
    ),
    ("an empty list", {"type": "array", "maxItems": 0}),
    (
        "a list of small numbers",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 4,
        },
    ),
    (
        "a team of people",
        {
            "type": "object",
            "properties": {
                "team": {"type": "string", "maxLength": 16},
                "members": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2},
            },
            "required": ["team", "members"],
            "additionalProperties": False,
        },
    ),
    (
        "an address",
        {
            "type": "object",
            "properties": {
                "street": NAME,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
            },
            "required": ["street", "zip", "country"],
            "additionalProperties": False,
        },
    ),
    (
        "a date",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}
            },
            "required": ["date"],
        },
    ),
    ("a product code", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}),
    (
        "a shape",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"radius": {"type": "number", "minimum": 0, "maximum": 100}},
                    "required": ["radius"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "w": {"type": "integer", "minimum": 1, "maximum": 50},
                        "h": {"type": "integer", "minimum": 1, "maximum": 50},
                    },
                    "required": ["w", "h"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
    ("a number or a word", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]}),
    (
        "an optional nickname",
        {
            "type": "object",
            "properties": {"name": NAME, "nickname": NAME},
            "required": ["name"],
            "additionalProperties": False,
        },
    ),
    (
        "a score",
        {
            "type": "object",
            "properties": {
                "score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}
            },
            "required": ["score"],
        },
    ),
    (
        "a point",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -100, "maximum": 100},
                "y": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "a short word",
        {"type": "string", "minLength": 2, "maxLength": 6},
    ),
    (
        "a config",
        {
            "type": "object",
            "properties": {
                "debug": {"type": "boolean"},
                "level": {"enum": ["low", "high"]},
                "limits": {
                    "type": "object",
                    "properties": {
                        "cpu": {"type": "integer", "minimum": 1, "maximum": 64},
                        "memory": {"type": "integer", "minimum": 1, "maximum": 512},
                    },
                    "required": ["cpu", "memory"],
                    "additionalProperties": False,
                },
            },
            "required": ["debug", "level", "limits"],
            "additionalProperties": False,
        },
    ),
    (
        "a grid",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 1},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "a nullable note",
        {
            "type": "object",
            "properties": {"note": {"anyOf": [{"type": "null"}, NAME]}},
            "required": ["note"],
        },
    ),
    (
        "a tree",
        {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
            "required": ["left", "right"],
            "additionalProperties": False,
        },
    ),
    (
        "a weekday",
        {
            "type": "object",
            "properties": {
                "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                "open": {"type": "boolean"},
            },
            "required": ["day", "open"],
            "additionalProperties": False,
        },
    ),
    (
        "a price",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0, "maximum": 1000},
                "currency": {"enum": ["USD", "EUR"]},
            },
            "required": ["amount", "currency"],
            "additionalProperties": False,
        },
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
                "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
                "isbn": {"type": "string", "pattern": "^[0-9]{10}$"},
            },
            "required": ["title", "year", "authors"],
            "additionalProperties": False,
        },
    ),
    (
        "an event",
        {
            "type": "object",
            "properties": {
                "kind": {"const": "event"},
                "at": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "where": {"anyOf": [NAME, {"type": "null"}]},
            },
            "required": ["kind", "at", "where"],
            "additionalProperties": False,
        },
    ),
]

CHAT_TOKENS = 96


def schema_of(what: str) -> dict[str, Any]:
    return next(schema for w, schema in SCHEMAS if w == what)


def ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON only: {what}."}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with demo_server(512) as (_, url):
        yield url


MODEL = ""  # the served model's name, set by the client fixture


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    global MODEL
    c = openai_client(server, timeout=600)
    MODEL = c.models.list().data[0].id
    return c


def _format(schema: dict[str, Any], name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def answers(client: openai.OpenAI) -> list[Any]:
    """Every schema's greedy chat reply, the requests sent at once (the engine batches them)."""

    def one(item: tuple[str, dict[str, Any]]) -> Any:
        what, schema = item
        return client.chat.completions.create(
            model=MODEL,
            messages=ask(what),
            max_tokens=CHAT_TOKENS,
            temperature=0,
            response_format=_format(schema),
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        return list(pool.map(one, SCHEMAS))


def _check(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_the_suite_is_large_enough() -> None:
    assert len(SCHEMAS) >= 30
    for _, schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("index", range(len(SCHEMAS)), ids=[w for w, _ in SCHEMAS])
def test_every_reply_parses_and_validates(answers: list[Any], index: int) -> None:
    choice = answers[index].choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    _check(choice.message.content, SCHEMAS[index][1])


def test_the_constraint_changes_the_reply(client: openai.OpenAI, answers: list[Any]) -> None:
    """Unconstrained, the demo model does not answer in bare JSON of this shape."""
    free = client.chat.completions.create(
        model=MODEL, messages=ask(SCHEMAS[0][0]), max_tokens=24, temperature=0
    )
    assert free.choices[0].message.content != answers[0].choices[0].message.content


def test_streaming_equals_the_whole_reply(client: openai.OpenAI, answers: list[Any]) -> None:
    index = next(i for i, (w, _) in enumerate(SCHEMAS) if w == "a team of people")
    what, schema = SCHEMAS[index]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ask(what),
        max_tokens=CHAT_TOKENS,
        temperature=0,
        response_format=_format(schema),
        stream=True,
    )
    parts, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert len([p for p in parts if p]) > 3  # it did stream
    assert "".join(parts) == answers[index].choices[0].message.content
    assert finish == "stop"
    _check("".join(parts), schema)


def test_a_stream_left_mid_way_leaves_the_engine_serving(
    client: openai.OpenAI, answers: list[Any]
) -> None:
    """Structured streams (n = 2) closed after a few chunks: their requests are aborted with a
    step in flight and grammar work queued; nothing hangs, and the next reply is whole."""
    index = next(i for i, (w, _) in enumerate(SCHEMAS) if w == "a team of people")
    what, schema = SCHEMAS[index]
    kw: dict[str, Any] = dict(
        model=MODEL, messages=ask(what), max_tokens=CHAT_TOKENS, response_format=_format(schema)
    )
    for _ in range(3):
        stream = client.chat.completions.create(**kw, temperature=1.0, n=2, stream=True)
        for _, _ in zip(stream, range(3), strict=False):
            pass
        stream.close()
    reply = client.chat.completions.create(**kw, temperature=0)
    assert reply.choices[0].message.content == answers[index].choices[0].message.content


def test_n_2_gives_each_choice_its_own_grammar(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model=MODEL,
            messages=ask("a team of people"),
            max_tokens=CHAT_TOKENS,
            temperature=1.0,
            seed=11,
            n=2,
            response_format=_format(schema_of("a team of people")),
        )
        texts = ["", ""]
        if stream:
            for chunk in client.chat.completions.create(**kw, stream=True):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
        else:
            texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
        values = [_check(t, schema_of("a team of people")) for t in texts]
        assert values[0] != values[1]  # sampled apart, each held to the schema


def test_json_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("the name of the capital of France"),
        max_tokens=CHAT_TOKENS,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    value = json.loads(reply.choices[0].message.content)
    assert isinstance(value, dict), reply.choices[0].message.content


def test_completions_endpoint(client: openai.OpenAI) -> None:
    schema = SCHEMAS[0][1]
    reply = client.completions.create(
        model=MODEL,
        prompt="A person, as JSON:",
        max_tokens=48,
        temperature=0,
        extra_body={"response_format": _format(schema)},
    )
    _check(reply.choices[0].text, schema)
    stream = client.completions.create(
        model=MODEL,
        prompt="A person, as JSON:",
        max_tokens=48,
        temperature=0,
        stream=True,
        extra_body={"response_format": _format(schema)},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == reply.choices[0].text


@pytest.mark.parametrize(
    ("response_format", "param", "problem"),
    [
        (_format({"type": "foo"}), "response_format", "Invalid type: foo"),
        (_format({"type": "string", "pattern": "[a-"}), "response_format", "regex"),
        (
            _format({"type": "integer", "minimum": 5, "maximum": 1}),
            "response_format",
            "minimum",
        ),
        (_format({"not": {"type": "string"}}), "response_format", "not"),
        (_format({"$ref": "#/$defs/missing"}), "response_format", "missing"),
        (
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema",
            "schema",
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
            "response_format.json_schema.schema",
            "object",
        ),
        ({"type": "xml"}, "response_format.type", "xml"),
        (_format({"type": "object"}, name="no spaces"), "response_format.json_schema.name", ""),
    ],
)
def test_bad_schemas_are_400s_that_name_the_problem(
    client: openai.OpenAI, response_format: dict[str, Any], param: str, problem: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL, messages=ask("x"), max_tokens=8, response_format=response_format
        )
    err = exc.value.body
    assert err["param"] == param, err
    assert problem in err["message"], err
    ok = client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2)
    assert ok.choices[0].finish_reason is not None  # the server is fine afterwards


def test_offline_llm_with_and_without_a_step_in_flight() -> None:
    """SamplingParams.json_schema in the offline API, stepped in series and with a step in
    flight: overlapped, a structured row's matcher reads the previous step's token from that
    step's result before masking (`_previous_tokens`), and the outputs equal the serial ones,
    next to an unconstrained request."""
    from inferx_core.engine import LLM
    from inferx_core.sequence import SamplingParams

    schema = schema_of("a point")
    llm = LLM(None, {"engine.overlap": True, "model.max_model_len": 256})
    assert llm.engine.overlap
    prompt = llm.chat_prompt(ask("a point"))
    params = [
        SamplingParams(max_tokens=24, temperature=0, json_schema=schema),
        SamplingParams(max_tokens=24, temperature=0.8, seed=4, json_schema=schema),
        SamplingParams(max_tokens=8, temperature=0),
    ]
    executor = llm.engine.executor
    real, asked = executor._previous_tokens, []

    def spy() -> Any:
        previous = real()
        if previous is None:
            return None

        def ask(seq: Any) -> int:
            asked.append(seq.request_id)
            return previous(seq)

        return ask

    executor._previous_tokens = spy
    outs = []
    for overlap in (False, True):
        llm.engine.overlap = overlap
        done = llm.generate([prompt] * 3, params)
        assert bool(asked) == overlap
        for c in done[:2]:
            assert c.finish_reason == "stop", c.text
            _check(c.text, schema)
        outs.append([(c.token_ids, c.finish_reason) for c in done])
        assert llm.engine.kv.usage() == 0.0
    assert outs[0] == outs[1]
