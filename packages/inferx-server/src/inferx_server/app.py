"""The litestar app: OpenAI's completions and chat endpoints, models, tokenize, health, metrics.

Handlers validate and tokenize on the event loop, hand token ids to the EngineLoop and turn its
outputs into OpenAI's JSON or server-sent events. Every error leaves as OpenAI's error body;
client mistakes are 4xx, never 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jinja2
import msgspec
import pydantic
from litestar import Litestar, Request, Response, get, post
from litestar.dto import MsgspecDTO
from litestar.exceptions import HTTPException, ValidationException
from litestar.openapi import OpenAPIConfig, ResponseSpec
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from litestar.typing import FieldDefinition

from inferx_core.engine import RequestOutput
from inferx_core.interfaces import QueueFullError
from inferx_core.sequence import SamplingParams
from inferx_server.engine_loop import EngineDead, EngineLoop, Submission
from inferx_server.metrics import CONTENT_TYPE, Metrics
from inferx_server.protocol import (
    UNSET,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
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
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    TopLogprob,
    Usage,
    decode_request,
)

if TYPE_CHECKING:
    from litestar._openapi.schema_generation import SchemaCreator

log = logging.getLogger("inferx.server")

RETRY_AFTER = "1"  # seconds, for 429 and 503
_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


@dataclass
class ServerState:
    """What the handlers share: the loop, the tokenizer and what the server says about itself."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str
    max_model_len: int
    metrics: Metrics
    aliases: frozenset[str] = frozenset()  # other names a request's `model` may use
    api_key: str | None = None
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    _token_strs: dict[int, str] = field(default_factory=dict)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = s
        return s


class _StrictBody(MsgspecDTO):
    """Decodes bodies strictly (litestar's own decoding coerces "3" to 3), and documents the
    struct itself rather than a transfer model, whose constraints litestar misplaces."""

    def decode_bytes(self, value: bytes) -> Any:
        return decode_request(value, self.model_type)

    @classmethod
    def create_openapi_schema(
        cls, field_definition: FieldDefinition, handler_id: str, schema_creator: SchemaCreator
    ) -> Any:
        return schema_creator.for_field_definition(FieldDefinition.from_annotation(cls.model_type))


# -- helpers shared by the endpoints -----------------------------------------------------------


def _check_model(srv: ServerState, model: str | None) -> None:
    if model is not None and model != srv.model_name and model not in srv.aliases:
        raise OpenAIError(
            404,
            f"the model '{model}' does not exist; this server serves '{srv.model_name}'",
            param="model",
            code="model_not_found",
        )


def _check_accepting(srv: ServerState) -> None:
    if srv.draining:
        raise OpenAIError(
            503,
            "the server is shutting down and accepts no new requests",
            type="service_unavailable",
            code="draining",
            headers={"Retry-After": RETRY_AFTER},
        )


def _check_ids(srv: ServerState, ids: list[int], param: str) -> None:
    vocab = srv.tokenizer.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise OpenAIError(
            400, f"token id {bad} is outside the vocabulary [0, {vocab})", param=param
        )
    if not ids:
        raise OpenAIError(400, "the prompt is empty", param=param)


def _max_tokens(
    srv: ServerState,
    requested: int | None,
    default: int | None,
    n_prompt: int,
    param: str,
    prompt_param: str,
) -> int:
    room = srv.max_model_len - n_prompt
    if room < 1:
        raise OpenAIError(
            400,
            f"the prompt has {n_prompt} tokens, which leaves no room to generate in the model's "
            f"context of {srv.max_model_len} tokens",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise OpenAIError(
            400,
            f"{param} is {requested}, but the prompt has {n_prompt} tokens and the model's context "
            f"is {srv.max_model_len}: at most {room} tokens can be generated",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def _sampling(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None
) -> list[SamplingParams]:
    """One SamplingParams per choice; a seeded request gives choice i the seed seed + i, so the
    choices differ from each other and each is reproducible."""
    stop = req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else []
    if any(not s for s in stop):
        raise OpenAIError(400, "stop strings must not be empty", param="stop")
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens,
        stop=tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
    )
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    try:
        return [
            SamplingParams(**kw, seed=None if req.seed is None else req.seed + i)
            for i in range(req.n)
        ]
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise OpenAIError(400, f"{param}: {err['msg']}", param=param) from None


def _chat_ids(
    srv: ServerState, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    chat = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # Templates know "system"; OpenAI's newer "developer" role means the same to them.
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        message["content"] = content
        if m.name is not None:
            message["name"] = m.name
        chat.append(message)
    try:
        text = srv.tokenizer.apply_chat_template(chat, add_generation_prompt=add_generation_prompt)
    except (jinja2.TemplateError, ValueError) as exc:
        raise OpenAIError(
            400, f"the chat template refused the messages: {exc}", param="messages"
        ) from None
    # The template writes the special tokens itself.
    return srv.tokenizer.encode(text, add_special_tokens=False)


async def _start(
    srv: ServerState, items: list[tuple[list[int], SamplingParams]], request_id: str
) -> Submission:
    try:
        return await srv.loop.submit(items, request_id)
    except QueueFullError as exc:
        raise OpenAIError(
            429,
            str(exc),
            type="rate_limit_exceeded",
            code="queue_full",
            headers={"Retry-After": RETRY_AFTER},
        ) from None
    except EngineDead as exc:
        raise OpenAIError(503, str(exc), type="service_unavailable", code="engine_dead") from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None


class _Choice:
    """One choice's outputs so far: the full text for a response, the counts for usage."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "prompt", "cached", "output")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.finish_reason: str | None = None
        self.prompt = self.cached = self.output = 0

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids += out.token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason = out.finish_reason
        self.count(out)

    def count(self, out: RequestOutput) -> None:
        # A drained request's closing "abort" output carries no counts.
        self.prompt = max(self.prompt, out.num_prompt_tokens)
        self.cached = max(self.cached, out.num_cached_tokens)
        self.output = max(self.output, out.num_output_tokens)


def _merge(batch: list[tuple[int, RequestOutput]]) -> dict[int, _Choice]:
    """A batch's outputs joined per choice, in the order the choices first appear."""
    merged: dict[int, _Choice] = {}
    for index, out in batch:
        choice = merged.get(index)
        if choice is None:
            choice = merged[index] = _Choice()
        choice.add(out)
    return merged


def _usage(choices: list[_Choice], n: int) -> Usage:
    # The prompt of each group of n choices counts once, as OpenAI counts it.
    firsts = choices[::n]
    prompt = sum(c.prompt for c in firsts)
    completion = sum(c.output for c in choices)
    cached = sum(c.cached for c in firsts)
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def _completion_logprobs(srv: ServerState, c: _Choice, offset: int) -> CompletionLogprobs:
    tokens, lps, tops, offsets = [], [], [], []
    for tok_id, (lp, top) in zip(c.token_ids, c.logprobs, strict=False):
        s = srv.token_str(tok_id)
        tokens.append(s)
        lps.append(lp)
        alts = {srv.token_str(t): v for t, v in top}
        alts.setdefault(s, lp)
        tops.append(alts)
        offsets.append(offset)
        offset += len(s)
    return CompletionLogprobs(tokens, lps, tops, offsets)


def _chat_logprobs(srv: ServerState, c: _Choice, top_n: int) -> ChatLogprobs:
    content = []
    for tok_id, (lp, top) in zip(c.token_ids, c.logprobs, strict=False):
        s = srv.token_str(tok_id)
        alts = [TopLogprob(srv.token_str(t), v, list(srv.token_str(t).encode())) for t, v in top]
        content.append(TokenLogprob(s, lp, list(s.encode()), alts[:top_n]))
    return ChatLogprobs(content)


async def _abort_on_disconnect(request: Request, srv: ServerState, sub: Submission) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            srv.loop.abort(sub)
            return


async def _collect(srv: ServerState, sub: Submission, request: Request) -> list[_Choice]:
    choices = [_Choice() for _ in sub.rids]
    watch = asyncio.ensure_future(_abort_on_disconnect(request, srv, sub))
    try:
        async for batch in srv.loop.outputs(sub):
            for index, out in batch:
                choices[index].add(out)
    except EngineDead as exc:
        raise OpenAIError(500, f"the engine failed: {exc}", type="server_error") from None
    finally:
        watch.cancel()
        srv.loop.abort(sub)
    return choices


async def _sse(
    srv: ServerState, sub: Submission, first: bytes, render: Any
) -> AsyncIterator[bytes]:
    """Server-sent events: `first`, then render(batch) per batch of outputs, then [DONE].

    Leaving early (client gone: litestar cancels the stream) aborts the engine requests.
    """
    try:
        if first:
            yield first
        async for batch in srv.loop.outputs(sub):
            if data := render(batch):
                yield data
        if data := render(None):
            yield data
    except EngineDead as exc:
        err = OpenAIError(500, f"the engine failed: {exc}", type="server_error")
        yield b"data: " + _encode(err.body()) + b"\n\n"
    finally:
        srv.loop.abort(sub)
    yield _DONE


def _event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _stream_response(events: AsyncIterator[bytes]) -> Stream:
    return Stream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -- the app -------------------------------------------------------------------------------------

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
        if data.stream_options is not None and not data.stream:
            raise OpenAIError(400, "stream_options needs stream: true", param="stream_options")
        items = []
        for p in prompts:
            ids = srv.tokenizer.encode(p) if isinstance(p, str) else p
            _check_ids(srv, ids, "prompt")
            max_tokens = _max_tokens(srv, data.max_tokens, 16, len(ids), "max_tokens", "prompt")
            items += [(ids, sp) for sp in _sampling(data, max_tokens, data.logprobs)]
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
            for index, out in batch:
                totals[index].count(out)
            events = []
            for index, c in _merge(batch).items():
                text = "".join(c.text)
                if not text and c.finish_reason is None and not (want_lp and c.token_ids):
                    continue  # nothing to show yet: held back text
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
        """OpenAI's chat completions, rendered with the model's chat template."""
        _check_accepting(srv)
        _check_model(srv, data.model)
        if not data.messages:
            raise OpenAIError(400, "messages must not be empty", param="messages")
        if data.stream_options is not None and not data.stream:
            raise OpenAIError(400, "stream_options needs stream: true", param="stream_options")
        if data.top_logprobs is not None and not data.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        requested, param = data.max_completion_tokens, "max_completion_tokens"
        if requested is None:
            requested, param = data.max_tokens, "max_tokens"
        elif data.max_tokens is not None and data.max_tokens != requested:
            raise OpenAIError(
                400, "max_tokens and max_completion_tokens differ; give one", param="max_tokens"
            )
        ids = _chat_ids(srv, data.messages, add_generation_prompt=True)
        _check_ids(srv, ids, "messages")
        max_tokens = _max_tokens(srv, requested, None, len(ids), param, "messages")
        top_n = data.top_logprobs or 0
        logprobs = top_n if data.logprobs else None
        items = [(ids, sp) for sp in _sampling(data, max_tokens, logprobs)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = await _start(srv, items, rid)
        created = int(time.time())
        if not data.stream:
            choices = await _collect(srv, sub, request)
            return Response(
                ChatCompletionResponse(
                    rid,
                    created,
                    srv.model_name,
                    [
                        ChatChoice(
                            i,
                            AssistantMessage("".join(c.text)),
                            _chat_logprobs(srv, c, top_n) if data.logprobs else None,
                            c.finish_reason,
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
            for index, out in batch:
                totals[index].count(out)
            events = []
            for index, c in _merge(batch).items():
                text = "".join(c.text)
                if not text and c.finish_reason is None and not (data.logprobs and c.token_ids):
                    continue
                lp = _chat_logprobs(srv, c, top_n) if data.logprobs else None
                delta = Delta(content=text) if text else Delta()
                events.append(
                    chunk([ChatChunkChoice(index, delta, lp, c.finish_reason)], usage_field)
                )
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
        if (data.prompt is None) == (data.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        if data.messages is not None:
            ids = _chat_ids(srv, data.messages, data.add_generation_prompt)
        else:
            ids = srv.tokenizer.encode(data.prompt, add_special_tokens=data.add_special_tokens)
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

    async def check_key(request: Request) -> None:
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

    return Litestar(
        [completions, chat_completions, models, model, tokenize, detokenize, health, metrics],
        before_request=check_key,
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


def _openai_error(request: Request, exc: OpenAIError) -> Response:
    return Response(exc.body(), status_code=exc.status, headers=exc.headers)


_TYPES = {
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
}


def _http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = exc.detail
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        message = "; ".join(str(e.get("message", e)) for e in exc.extra if isinstance(e, dict))
    if status >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, message)
        return _openai_error(request, OpenAIError(status, message, type="server_error"))
    kind = _TYPES.get(status, "invalid_request_error")
    return _openai_error(request, OpenAIError(status, message, type=kind, headers=exc.headers))


def _server_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return _openai_error(request, OpenAIError(500, f"internal error: {exc!r}", type="server_error"))
