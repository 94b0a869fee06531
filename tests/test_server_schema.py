"""schemathesis against the server's own OpenAPI schema (the server of test_server_api: a real
Engine over a fake executor): no 5xx, every response as documented, and the schema and the
server agree both ways (what the schema allows is accepted, what it forbids is refused)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from test_server_api import serve  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live() -> Iterator[Any]:
    with serve() as t:
        yield t


@pytest.fixture(scope="module")
def api_schema(live: Any) -> Any:
    return schemathesis.openapi.from_url(live.url + "/schema/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def _ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    # JSON Schema counts 1.0 as an integer; the server, strict like OpenAI's, wants 1.
    return _ints(body)


# Refusals JSON Schema cannot express, so a schema-valid request may still earn them: the prompt's
# token count against the model's context (a fact of the tokenizer and the model), function
# names unique across `tools` (uniqueItems compares whole items), a tool_choice naming one of them,
# max_tokens equal to max_completion_tokens when both are given, and schemas given as values
# (a tool's parameters, a json_schema response_format) that are no JSON Schema or use what the
# grammar library lacks (code invalid_schema).
_BEYOND_SCHEMA = (
    "context_length_exceeded",
    "is repeated",
    "which is not in tools",
    "differ; give one",
    '"code":"invalid_schema"',
)


@schema.parametrize()
@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,  # hypothesis draws the same; the schema-derived cases may still vary
)
def test_server_matches_its_schema(case: Any) -> None:
    response = case.call(timeout=30)
    excluded = []
    if response.status_code == 400 and any(why in response.text for why in _BEYOND_SCHEMA):
        from schemathesis.specs.openapi.checks import positive_data_acceptance

        excluded.append(positive_data_acceptance)
    case.validate_response(response, excluded_checks=excluded)
