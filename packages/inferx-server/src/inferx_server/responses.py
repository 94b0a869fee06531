"""From engine outputs to OpenAI's responses.

A submission's outputs gathered per choice (`_Choice`) into usage and logprobs, collected for a
JSON response or rendered as server-sent events; either way a client that leaves aborts the
engine requests. Also the exception handlers, which answer every error with OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.response import Stream

from inferx_core.engine import RequestOutput
from inferx_server.engine_loop import EngineDead, Submission
from inferx_server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    DeltaFunction,
    DeltaToolCall,
    MessageFunctionCall,
    MessageToolCall,
    OpenAIError,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from inferx_server.tool_parsers import PARSERS, ToolCall

if TYPE_CHECKING:
    from inferx_server.app import ServerState

log = logging.getLogger("inferx.server")

_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


# -- outputs per choice --------------------------------------------------------------------------


class _Choice:
    """One choice's outputs so far: the full text for a response, the counts for usage.

    With a `parser` (a harmony chat's HarmonyParser, which keeps its state across the outputs of
    one choice) the text is the reply's final channel, parsed from the token ids, and
    `reasoning` the other channels; without one, the engine's text."""

    __slots__ = (
        "text", "reasoning", "parser", "token_ids", "logprobs", "finish_reason", "prompt",
        "cached", "output",
    )  # fmt: skip

    def __init__(self, parser: Any = None) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.parser = parser
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.finish_reason: str | None = None
        self.prompt = self.cached = self.output = 0

    def add(self, out: RequestOutput) -> None:
        if self.parser is None:
            self.text.append(out.text)
        else:
            reasoning, content = self.parser.push(out.token_ids)
            self.reasoning.append(reasoning)
            self.text.append(content)
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


def _merge(
    batch: list[tuple[int, RequestOutput]], parsers: list[Any] | None = None
) -> dict[int, _Choice]:
    """A batch's outputs joined per choice, in the order the choices first appear; `parsers`:
    each choice's reply parser, if any (see _Choice)."""
    merged: dict[int, _Choice] = {}
    for index, out in batch:
        choice = merged.get(index)
        if choice is None:
            choice = merged[index] = _Choice(parsers[index] if parsers else None)
        choice.add(out)
    return merged


def _deltas(
    batch: list[tuple[int, RequestOutput]],
    totals: list[_Choice],
    want_lp: bool,
    parsers: list[Any] | None = None,
) -> list[tuple[int, str, _Choice]]:
    """A streamed batch as (index, text, outputs) per choice that has something to show, after
    counting each output into `totals` for the closing usage."""
    for index, out in batch:
        totals[index].count(out)
    deltas = []
    for index, c in _merge(batch, parsers).items():
        text = "".join(c.text)
        shown = text or any(c.reasoning)
        if not shown and c.finish_reason is None and not (want_lp and c.token_ids):
            continue  # nothing to show yet: held back text
        deltas.append((index, text, c))
    return deltas


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


class _Tools:
    """One choice's tool calls out of its reply: content text in, (content, call deltas) out,
    as OpenAI streams them. A template family's parser reads the text; harmony's parser (the
    choice's HarmonyParser, built with tools) hands over its calls itself (`take_calls`)."""

    def __init__(self, family: str, harmony: Any = None) -> None:
        self.parser = None if harmony is not None else PARSERS[family]()
        self.harmony = harmony
        self.calls: list[MessageToolCall] = []

    def feed(self, text: str, done: bool) -> tuple[str, list[DeltaToolCall]]:
        deltas: list[DeltaToolCall] = []
        if self.harmony is not None:
            for call_id, name, fragment in self.harmony.take_calls():
                if name is not None:
                    deltas.append(self._start(ToolCall(name, "", call_id)))
                if fragment:
                    self.calls[-1].function.arguments += fragment
                    deltas.append(
                        DeltaToolCall(len(self.calls) - 1, DeltaFunction(arguments=fragment))
                    )
            return text, deltas
        assert self.parser is not None
        events = self.parser.push(text) + (self.parser.finish() if done else [])
        content = []
        for e in events:
            if isinstance(e, str):
                content.append(e)
                continue
            deltas.append(self._start(e))
            self.calls[-1].function.arguments = e.arguments
            deltas.append(DeltaToolCall(len(self.calls) - 1, DeltaFunction(arguments=e.arguments)))
        return "".join(content), deltas

    def _start(self, call: ToolCall) -> DeltaToolCall:
        self.calls.append(MessageToolCall(id=call.id, function=MessageFunctionCall(call.name, "")))
        return DeltaToolCall(
            len(self.calls) - 1, DeltaFunction(name=call.name, arguments=""), call.id, "function"
        )

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason


# -- a submission's outputs, whole or streamed ---------------------------------------------------


async def _abort_on_disconnect(request: Request, srv: ServerState, sub: Submission) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or the end).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            srv.loop.abort(sub)
            return


# OpenAI has no finish_reason for a request the server ended: a request cut by the drain timeout
# gets this error instead (the JSON response's status; a stream's last event before [DONE]).
_CUT = OpenAIError(
    503,
    "the server is shutting down and ended this request at its drain timeout "
    "(server.drain_timeout); the output is incomplete",
    type="service_unavailable",
    code="draining",
)


def _cut(batch: list[tuple[int, RequestOutput]]) -> tuple[list[tuple[int, RequestOutput]], bool]:
    """The batch without the drain's closing "abort" outputs, and whether it had any."""
    kept = [(i, out) for i, out in batch if out.finish_reason != "abort"]
    return kept, len(kept) < len(batch)


async def _collect(
    srv: ServerState, sub: Submission, request: Request, parsers: list[Any] | None = None
) -> list[_Choice]:
    choices = [_Choice(parsers[i] if parsers else None) for i in range(len(sub.rids))]
    watch = asyncio.ensure_future(_abort_on_disconnect(request, srv, sub))
    try:
        async for batch in srv.loop.outputs(sub):
            batch, cut = _cut(batch)
            if cut:
                raise _CUT
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
    """Server-sent events: `first`, then render(batch) per batch of outputs, then [DONE]. A
    stream the drain timeout cuts ends with an error event (_CUT) in place of the last chunks.

    Leaving early (client gone: litestar cancels the stream) aborts the engine requests.
    """
    try:
        if first:
            yield first
        cut = False
        async for batch in srv.loop.outputs(sub):
            batch, dropped = _cut(batch)
            cut |= dropped
            if batch and (data := render(batch)):
                yield data
        if cut:
            yield b"data: " + _encode(_CUT.body()) + b"\n\n"
        elif data := render(None):
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


# -- errors --------------------------------------------------------------------------------------


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
