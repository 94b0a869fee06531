"""The litestar app: OpenAI's completions and chat endpoints, models, tokenize, health, metrics.

Handlers validate on the event loop and tokenize there or, for long prompts, on a worker thread
(requests.py), hand token ids to the EngineLoop and turn its outputs into OpenAI's JSON or
server-sent events (responses.py). Every error leaves as OpenAI's error body; client mistakes
are 4xx, never 500.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.openapi.spec import OpenAPI, OpenAPIMediaType, OpenAPIType, Schema
from litestar.params import FromPath, JSONBody

from inferx_core.engine import RequestOutput
from inferx_server.engine_loop import EngineLoop
from inferx_server.metrics import CONTENT_TYPE, Metrics
from inferx_server.protocol import (
    UNSET,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenizeRequest,
    TokenizeResponse,
)
from inferx_server.requests import (
    RETRY_AFTER,
    _chat_ids,
    _check_accepting,
    _check_fits,
    _check_ids,
    _check_model,
    _check_stream_options,
    _encode,
    _max_tokens,
    _sampling,
    _start,
    _StrictBody,
    _tool_plan,
)
from inferx_server.responses import (
    _chat_logprobs,
    _Choice,
    _collect,
    _completion_logprobs,
    _deltas,
    _event,
    _http_error,
    _openai_error,
    _server_error,
    _sse,
    _stream_response,
    _Tools,
    _usage,
)


@dataclass
class ServerState:
    """What the handlers share: the loop, the tokenizer and what the server says about itself."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: Metrics
    aliases: frozenset[str] = frozenset()  # other names a request's `model` may use
    max_waiting: int | None = None  # scheduler.max_waiting: the most sequences ever queued
    api_key: str | None = None
    chat_format: Any = None  # harmony for gpt-oss (chat_formats.harmony_format); None: template
    tool_call_grammar: str = "off"  # server.tool_call_grammar: tool_choice "auto" constrained
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _token_strs: dict[int, str] = field(default_factory=dict)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s


_ERRORS = {
    400: ResponseSpec(ErrorResponse, description="Invalid request", generate_examples=False),
    404: ResponseSpec(ErrorResponse, description="Unknown model", generate_examples=False),
    429: ResponseSpec(
        ErrorResponse, description="Queue full; see Retry-After", generate_examples=False
    ),
    503: ResponseSpec(
        ErrorResponse, description="Draining; see Retry-After", generate_examples=False
    ),
}


def _needs(param: str, needs: str) -> Schema:
    """`param` absent or null, or `needs` true."""
    return Schema(
        any_of=[
            Schema(schema_not=Schema(required=[param])),
            Schema(properties={param: Schema(type=OpenAPIType.NULL)}),
            Schema(required=[needs], properties={needs: Schema(const=True)}),
        ]
    )


def _key_below(n: int, width: int = 10) -> str:
    """A regex for the decimal strings of at most `width` characters whose value is below `n`
    (leading zeros allowed, as int() reads them): logit_bias keys that name a token id."""
    top = str(n - 1)
    # (digits, regex) of the numbers below n without leading zeros, shortest first.
    alts = [(1, f"[0-{min(n - 1, 9)}]")]
    alts += [(d, f"[1-9][0-9]{{{d - 1}}}") for d in range(2, len(top))]
    if len(top) > 1:
        for i, c in enumerate(top):  # top's prefix, then a smaller digit, then any digits
            low = "1" if i == 0 else "0"
            if c > low:
                tail = len(top) - i - 1
                alts.append((len(top), f"{top[:i]}[{low}-{chr(ord(c) - 1)}][0-9]{{{tail}}}"))
        alts.append((len(top), top))
    return "^(?:" + "|".join(f"0{{0,{width - d}}}{r}" for d, r in alts) + ")$"


def _refine_openapi(openapi: OpenAPI, vocab: int) -> None:
    """Bounds of the request schemas that the structs cannot carry, so the schema says what the
    server accepts: token ids below the vocabulary size, the exact shapes of `prompt`, logit_bias
    keys, /tokenize's one of prompt or messages, and content that only an assistant may omit."""
    schemas = openapi.components.schemas
    token = Schema(type=OpenAPIType.INTEGER, minimum=0, maximum=vocab - 1)
    ids = Schema(type=OpenAPIType.ARRAY, items=token, min_items=1)

    def array(items: Schema) -> Schema:
        return Schema(type=OpenAPIType.ARRAY, items=items, min_items=1)

    text = Schema(type=OpenAPIType.STRING, min_length=1)  # "" encodes to no token with some
    schemas["CompletionRequest"].properties["prompt"] = Schema(
        one_of=[text, array(text), ids, array(ids)]
    )
    bias = Schema(
        one_of=[
            Schema(
                type=OpenAPIType.OBJECT,
                property_names=Schema(pattern=_key_below(vocab)),
                additional_properties=Schema(type=OpenAPIType.NUMBER, minimum=-100, maximum=100),
            ),
            Schema(type=OpenAPIType.NULL),
        ]
    )
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name].properties
        for positive in ("top_p", "repetition_penalty"):  # litestar drops Meta(gt=0)
            props[positive].exclusive_minimum = 0.0
        for natural in ("temperature", "min_p", "logprobs", "top_logprobs"):  # and ge=0
            if natural in props:
                props[natural].minimum = 0
        props["logit_bias"] = bias
        if name == "CompletionRequest":
            props["tools"] = Schema(  # ... and Meta(max_length=0)
                one_of=[Schema(type=OpenAPIType.ARRAY, max_items=0), Schema(type=OpenAPIType.NULL)]
            )
        props["stop_token_ids"] = Schema(
            one_of=[Schema(type=OpenAPIType.ARRAY, items=token), Schema(type=OpenAPIType.NULL)]
        )
    # Parameters that need another's value: null or absent, or with it.
    for name, param, needs in (
        ("CompletionRequest", "stream_options", "stream"),
        ("ChatCompletionRequest", "stream_options", "stream"),
        ("ChatCompletionRequest", "top_logprobs", "logprobs"),
    ):
        schemas[name].all_of = [*(schemas[name].all_of or []), _needs(param, needs)]
    # A tool_choice that calls needs tools to call.
    calls = Schema(
        required=["tool_choice"],
        properties={
            "tool_choice": Schema(
                one_of=[Schema(const="required"), Schema(type=OpenAPIType.OBJECT)]
            )
        },
    )
    # ... and holds the reply to the calls' grammar, so it takes no JSON response_format.
    plain = Schema(
        any_of=[
            Schema(type=OpenAPIType.NULL),
            Schema(type=OpenAPIType.OBJECT, properties={"type": Schema(const="text")}),
        ]
    )
    schemas["ChatCompletionRequest"].all_of = [
        *(schemas["ChatCompletionRequest"].all_of or []),
        Schema(
            any_of=[
                Schema(schema_not=calls),
                Schema(
                    required=["tools"],
                    properties={"tools": Schema(type=OpenAPIType.ARRAY, min_items=1)},
                ),
            ]
        ),
        Schema(
            any_of=[
                Schema(schema_not=calls),
                Schema(schema_not=Schema(required=["response_format"])),
                Schema(properties={"response_format": plain}),
            ]
        ),
    ]
    # Unknown parameters are refused (the structs forbid unknown fields).
    for name in (
        "CompletionRequest",
        "ChatCompletionRequest",
        "TokenizeRequest",
        "DetokenizeRequest",
        "ChatMessage",
        "TextPart",
        "StreamOptions",
        "ResponseFormatText",
        "ResponseFormatJSONObject",
        "ResponseFormatJSONSchema",
        "JSONSchema",
        "Tool",
        "FunctionDefinition",
        "ToolChoiceFunction",
        "MessageToolCall",
        "MessageFunctionCall",
        "FunctionName",
    ):
        schemas[name].additional_properties = False
    # With stream: true the 200 is server-sent events, each a JSON chunk (or an error) in
    # `data`, the last "[DONE]".
    event = Schema(
        type=OpenAPIType.OBJECT,
        required=["data"],
        properties={"data": Schema(type=OpenAPIType.STRING)},
    )
    for path in ("/v1/completions", "/v1/chat/completions"):
        ok = openapi.paths[path].post.responses["200"]
        ok.content["text/event-stream"] = OpenAPIMediaType(schema=event)
    schemas["DetokenizeRequest"].properties["tokens"] = Schema(type=OpenAPIType.ARRAY, items=token)
    schemas["TokenizeRequest"].one_of = [
        Schema(required=[name]) for name in TokenizeRequest.__openapi_one_of__
    ]
    schemas["ChatMessage"].any_of = [
        Schema(properties={"role": Schema(const="assistant")}),
        Schema(
            required=["content"],
            properties={"content": Schema(type=[OpenAPIType.STRING, OpenAPIType.ARRAY])},
        ),
    ]


def create_app(srv: ServerState) -> Litestar:
    """The litestar app over one ServerState. The EngineLoop starts and stops with it."""

    @post(
        "/v1/completions",
        status_code=200,
        dto=_StrictBody[CompletionRequest],
        return_dto=None,
        responses={
            200: ResponseSpec(
                CompletionResponse,
                description="A completion, or "
                "server-sent CompletionResponse chunks when stream is true",
                generate_examples=False,
            ),
            **_ERRORS,
        },
    )
    async def completions(data: JSONBody[CompletionRequest], request: Request) -> Response:
        """OpenAI's legacy completions."""
        _check_accepting(srv)
        _check_model(srv, data.model)
        if (
            data.tools
            or data.tool_choice in ("required",)
            or not isinstance(data.tool_choice, str | None)
        ):
            raise OpenAIError(
                400,
                "tools are for /v1/chat/completions; a completion has no tool calls",
                param="tools" if data.tools else "tool_choice",
                code="unsupported_parameter",
            )
        prompt = data.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, str | list) for p in prompt):
            prompts = list(prompt)
        else:
            raise OpenAIError(
                400,
                "prompt must be a string, a list of strings, a list of token ids or a list "
                "of lists of token ids",
                param="prompt",
            )
        _check_stream_options(data)
        _check_fits(srv, len(prompts), data.n)
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(await _encode(srv, texts))  # no texts: [] on the loop, no thread
        items = []
        for p in prompts:
            ids = next(encoded) if isinstance(p, str) else p
            _check_ids(srv, ids, "prompt")
            max_tokens = _max_tokens(srv, data.max_tokens, 16, len(ids), "max_tokens", "prompt")
            items += [(ids, sp) for sp in _sampling(srv, data, max_tokens, data.logprobs)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub = await _start(srv, items, rid)
        created = int(time.time())
        want_lp = data.logprobs is not None
        if not data.stream:
            choices = await _collect(srv, sub, request)
            return Response(
                CompletionResponse(
                    rid,
                    created,
                    srv.model_name,
                    [
                        CompletionChoice(
                            i,
                            "".join(c.text),
                            _completion_logprobs(srv, c, 0) if want_lp else None,
                            c.finish_reason,
                        )
                        for i, c in enumerate(choices)
                    ],
                    usage=_usage(choices, data.n),
                )
            )
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        totals = [_Choice() for _ in sub.rids]
        offsets = [0] * len(sub.rids)
        usage_field = None if include_usage else UNSET

        def render(batch: list[tuple[int, RequestOutput]] | None) -> bytes:
            if batch is None:
                if not include_usage:
                    return b""
                return _event(
                    CompletionResponse(
                        rid, created, srv.model_name, [], usage=_usage(totals, data.n)
                    )
                )
            events = []
            for index, text, c in _deltas(batch, totals, want_lp):
                lp = _completion_logprobs(srv, c, offsets[index]) if want_lp else None
                offsets[index] += len(text)
                choice = CompletionChoice(index, text, lp, c.finish_reason)
                events.append(
                    _event(
                        CompletionResponse(
                            rid, created, srv.model_name, [choice], usage=usage_field
                        )
                    )
                )
            return b"".join(events)

        return _stream_response(_sse(srv, sub, b"", render))

    @post(
        "/v1/chat/completions",
        status_code=200,
        dto=_StrictBody[ChatCompletionRequest],
        return_dto=None,
        responses={
            200: ResponseSpec(
                ChatCompletionResponse,
                description="A chat completion, or server-sent ChatCompletionChunk events "
                "when stream is true",
                generate_examples=False,
            ),
            **_ERRORS,
        },
    )
    async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request) -> Response:
        """OpenAI's chat completions, rendered with the model's chat template, or in harmony
        for gpt-oss (its analysis channel then comes back as `reasoning_content`)."""
        _check_accepting(srv)
        _check_model(srv, data.model)
        _check_stream_options(data)
        _check_fits(srv, 1, data.n)
        if data.top_logprobs is not None and not data.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        requested, param = data.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, param = data.max_tokens, "max_tokens"
        elif data.max_tokens is not None and data.max_tokens != requested:
            raise OpenAIError(
                400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens"
            )
        plan = _tool_plan(srv, data)
        ids = await _chat_ids(srv, data.messages, True, data.reasoning_effort, plan.tools)
        _check_ids(srv, ids, "messages")
        max_tokens = _max_tokens(srv, requested, None, len(ids), param, "messages")
        top_n = data.top_logprobs or 0
        logprobs = top_n if data.logprobs else None
        fmt = srv.chat_format
        stops = fmt.stop_token_ids if fmt is not None else ()
        items = [(ids, sp) for sp in _sampling(srv, data, max_tokens, logprobs, stops, plan)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await _start(srv, items, rid, "response_format" if plan.grammar is None else "tools")
        created = int(time.time())
        # A harmony reply is parsed from its token ids, per choice (responses._Choice).
        parsers = (
            [fmt.parser(tools=plan.family is not None) for _ in sub.rids]
            if fmt is not None
            else None
        )
        # Tool calls out of each choice's content, when the request has tools to call.
        tools = (
            [_Tools(plan.family, parsers[i] if parsers else None) for i in range(len(sub.rids))]
            if plan.family is not None
            else None
        )

        def message(i: int, c: _Choice) -> AssistantMessage:
            text = "".join(c.text)
            msg = AssistantMessage(text)
            if tools is not None:
                text, _ = tools[i].feed(text, True)
                if tools[i].calls:
                    msg = AssistantMessage(text or None, tool_calls=tools[i].calls)
                else:
                    msg = AssistantMessage(text)
            if parsers is not None:
                msg.reasoning_content = "".join(c.reasoning) or None
            return msg

        def reason(i: int, finish_reason: str | None) -> str | None:
            return tools[i].finish_reason(finish_reason) if tools is not None else finish_reason

        if not data.stream:
            choices = await _collect(srv, sub, request, parsers)
            return Response(
                ChatCompletionResponse(
                    rid,
                    created,
                    srv.model_name,
                    [
                        ChatChoice(
                            i,
                            message(i, c),
                            _chat_logprobs(srv, c, top_n) if data.logprobs else None,
                            reason(i, c.finish_reason),
                        )
                        for i, c in enumerate(choices)
                    ],
                    _usage(choices, data.n),
                )
            )
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        usage_field = None if include_usage else UNSET
        totals = [_Choice() for _ in sub.rids]

        def chunk(choices: list[ChatChunkChoice], usage: Any) -> bytes:
            return _event(ChatCompletionChunk(rid, created, srv.model_name, choices, usage=usage))

        first = b"".join(
            chunk(
                [ChatChunkChoice(i, Delta(role="assistant", content=""), None, None)], usage_field
            )
            for i in range(len(sub.rids))
        )

        def render(batch: list[tuple[int, RequestOutput]] | None) -> bytes:
            if batch is None:
                return chunk([], _usage(totals, data.n)) if include_usage else b""
            events = []
            for index, text, c in _deltas(batch, totals, bool(data.logprobs), parsers):
                lp = _chat_logprobs(srv, c, top_n) if data.logprobs else None
                calls: list[Any] = []
                if tools is not None:
                    text, calls = tools[index].feed(text, c.finish_reason is not None)
                delta = Delta(content=text) if text else Delta()
                if reasoning := "".join(c.reasoning):
                    delta.reasoning_content = reasoning
                finish = reason(index, c.finish_reason)
                if calls:
                    # One call's deltas per chunk: a client joins them by index.
                    for call in calls[:-1]:
                        events.append(
                            chunk(
                                [ChatChunkChoice(index, Delta(tool_calls=[call]), None, None)],
                                usage_field,
                            )
                        )
                    delta.tool_calls = [calls[-1]]
                elif not (text or delta.reasoning_content or finish or lp):
                    continue  # held back: it may be a call's markup
                events.append(chunk([ChatChunkChoice(index, delta, lp, finish)], usage_field))
            return b"".join(events)

        return _stream_response(_sse(srv, sub, first, render))

    @get("/v1/models")
    async def models() -> ModelList:
        """The one model this server serves."""
        return ModelList([ModelCard(srv.model_name, srv.created, srv.max_model_len)])

    @get("/v1/models/{model:str}", responses={404: _ERRORS[404]})
    async def model(model: FromPath[str]) -> ModelCard:
        _check_model(srv, model)
        return ModelCard(srv.model_name, srv.created, srv.max_model_len)

    @post(
        "/tokenize",
        status_code=200,
        dto=_StrictBody[TokenizeRequest],
        return_dto=None,
        responses={400: _ERRORS[400], 404: _ERRORS[404]},
    )
    async def tokenize(data: JSONBody[TokenizeRequest]) -> TokenizeResponse:
        """Token ids of a prompt (as /v1/completions encodes it) or of chat messages."""
        _check_model(srv, data.model)
        if (data.prompt is UNSET) == (data.messages is UNSET):
            raise OpenAIError(400, "give either prompt or messages, not both", param="prompt")
        if data.messages is not UNSET:
            ids = await _chat_ids(srv, data.messages, bool(data.add_generation_prompt))
        else:
            ids = (await _encode(srv, [data.prompt], bool(data.add_special_tokens)))[0]
        return TokenizeResponse(ids, len(ids), srv.max_model_len)

    @post(
        "/detokenize",
        status_code=200,
        dto=_StrictBody[DetokenizeRequest],
        return_dto=None,
        responses={400: _ERRORS[400], 404: _ERRORS[404]},
    )
    async def detokenize(data: JSONBody[DetokenizeRequest]) -> DetokenizeResponse:
        _check_model(srv, data.model)
        if data.tokens:
            _check_ids(srv, data.tokens, "tokens")
        return DetokenizeResponse(srv.tokenizer.decode(data.tokens, skip_special_tokens=False))

    @get(
        "/health",
        responses={
            503: ResponseSpec(
                Health, description="Engine dead, stuck, or draining", generate_examples=False
            )
        },
    )
    async def health() -> Response[Health]:
        """200 while the engine loop steps; 503 when it is dead, stuck or draining."""
        problem = srv.loop.health()
        if problem is not None:
            return Response(Health("unhealthy", problem), status_code=503)
        if srv.draining:
            return Response(
                Health("draining"), status_code=503, headers={"Retry-After": RETRY_AFTER}
            )
        return Response(Health("ok"))

    @get("/metrics", media_type=CONTENT_TYPE)
    async def metrics() -> bytes:
        """Prometheus text format."""
        return srv.metrics.render()

    async def before(request: Request) -> None:
        # litestar hands an empty body to no decoder and reports the missing handler argument
        # ('data'); say what is missing instead.
        if request.method == "POST" and not await request.body():
            raise OpenAIError(400, "the request body is empty; expected a JSON object")
        if srv.api_key is None or not request.url.path.startswith("/v1/"):
            return
        if request.headers.get("authorization", "") != f"Bearer {srv.api_key}":
            raise OpenAIError(
                401,
                "invalid or missing API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
            )

    async def start_loop() -> None:
        srv.loop.start()

    async def stop_loop() -> None:
        await asyncio.to_thread(srv.loop.stop)

    app = Litestar(
        [completions, chat_completions, models, model, tokenize, detokenize, health, metrics],
        before_request=before,
        exception_handlers={
            OpenAIError: _openai_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        on_startup=[start_loop],
        on_shutdown=[stop_loop],
        openapi_config=OpenAPIConfig(title="InferX", version="0.1.0"),
        logging_config=None,  # the process's logging belongs to whoever runs the server
    )
    _refine_openapi(app.openapi_schema, srv.tokenizer.vocab_size)
    return app
