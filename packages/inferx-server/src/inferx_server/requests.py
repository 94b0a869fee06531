"""From an OpenAI request body to engine requests.

Strict decoding of the body, the checks that turn a client's mistake into a 4xx, the token ids of
chat messages, one SamplingParams per choice, and submission to the EngineLoop.
"""

from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import pydantic
from litestar.dto import MsgspecDTO
from litestar.typing import FieldDefinition

from inferx_core.interfaces import GrammarError, QueueFullError
from inferx_core.sequence import SamplingParams
from inferx_server.engine_loop import EngineDead, Submission
from inferx_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIError,
    ResponseFormatJSONObject,
    ResponseFormatJSONSchema,
    ToolChoiceFunction,
    decode_request,
)
from inferx_server.tool_grammars import harmony_final_json, schema_problem, tool_grammar
from inferx_server.tool_parsers import FALLBACK_SYSTEM, family_of, hermes_call_text

if TYPE_CHECKING:
    from litestar._openapi.schema_generation import SchemaCreator

    from inferx_server.app import ServerState

RETRY_AFTER = "1"  # seconds, for 429 and 503


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


def _check_stream_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options needs stream: true", param="stream_options")


def _check_fits(srv: ServerState, prompts: int, n: int) -> None:
    """A request is queued whole (all its sequences or none), so one with more sequences than
    the queue holds could never start: a 400 that says so, not a 429 that invites a retry. (Its
    sequences need not run at once: beyond scheduler.max_running, or beyond what the KV cache
    holds, they run in turn. One sequence that the cache cannot hold is refused on submission.)
    """
    if srv.max_waiting is not None and prompts * n > srv.max_waiting:
        raise OpenAIError(
            400,
            f"the request makes {prompts * n} sequences ({prompts} prompts x n={n}), more than "
            f"this server queues at once (scheduler.max_waiting = {srv.max_waiting}); send fewer "
            "prompts or a smaller n",
            param="n" if prompts == 1 else "prompt",
            code="request_too_large",
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


def _token_params(srv: ServerState, req: CompletionRequest | ChatCompletionRequest) -> None:
    """stop_token_ids and logit_bias name token ids of the vocabulary."""
    vocab = srv.tokenizer.vocab_size
    for t in req.stop_token_ids or ():
        if t >= vocab:
            raise OpenAIError(
                400, f"token id {t} is outside the vocabulary [0, {vocab})", param="stop_token_ids"
            )
    for key in req.logit_bias or {}:
        if int(key) >= vocab:
            raise OpenAIError(
                400,
                f"token id {key} is outside the vocabulary [0, {vocab})",
                param=f"logit_bias.{key}",
            )


def _json_schema(srv: ServerState, req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The JSON schema that `response_format` holds the output to (JSON text), or None."""
    fmt = req.response_format
    if not isinstance(fmt, ResponseFormatJSONObject | ResponseFormatJSONSchema):
        return None
    if isinstance(fmt, ResponseFormatJSONObject):
        return '{"type":"object"}'
    return json.dumps(fmt.json_schema.schema, separators=(",", ":"))


def _sampling(
    srv: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    stop_token_ids: tuple[int, ...] = (),
    plan: ToolPlan | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice; a seeded request gives choice i the seed seed + i, so the
    choices differ from each other and each is reproducible. `stop_token_ids` are the chat
    format's own, beside the request's."""
    _token_params(srv, req)
    stop = req.stop if isinstance(req.stop, list) else [req.stop]
    kw: dict[str, Any] = dict(
        max_tokens=max_tokens,
        stop=tuple(s for s in stop if s),  # an empty stop string stops nothing, as in OpenAI
        stop_token_ids=tuple(req.stop_token_ids or ()) + stop_token_ids,
        logit_bias=tuple((int(k), v) for k, v in (req.logit_bias or {}).items()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        json_schema=_json_schema(srv, req),
    )
    chat = isinstance(req, ChatCompletionRequest)
    if kw["json_schema"] is not None and chat and srv.chat_format is not None:
        # A harmony reply opens with its analysis channel: the grammar holds the final
        # channel's message to the schema and leaves the messages before it free.
        schema = json.loads(kw.pop("json_schema"))
        kw["lark_grammar"] = harmony_final_json(srv.tokenizer, schema)
    if plan is not None and plan.grammar is not None:
        kind, grammar = plan.grammar
        kw["json_schema" if kind == "json_schema" else "lark_grammar"] = grammar
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


# Texts shorter than this are encoded on the event loop: a thread hop costs more than they do.
_OFF_LOOP_CHARS = 1024


async def _encode(
    srv: ServerState, texts: list[str], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of texts. Long ones are encoded in one encode_batch call on a worker thread,
    which tokenizers runs outside the GIL: the event loop keeps streaming meanwhile, and the
    prompts of a burst of requests are encoded on several cores at once instead of one after
    another on the loop (a burst's prompts would otherwise hold the loop for long)."""
    tok = srv.tokenizer
    if sum(map(len, texts)) < _OFF_LOOP_CHARS or not hasattr(tok, "encode_batch"):
        return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    srv.loop.encoding += 1  # an idle engine handed another request waits for this one
    try:
        return await asyncio.to_thread(tok.encode_batch, texts, add_special_tokens)
    finally:
        srv.loop.encoding -= 1


@dataclass
class ToolPlan:
    """What a chat request's `tools` and `tool_choice` mean for this model: the tools as the
    template takes them (None: none rendered), the reply's parser family (None: calls are not
    parsed), the functions a "required" or named choice holds the reply to (None: free), and
    the grammar doing so (for "auto": holding the calls the model opens; None: none)."""

    tools: list[dict[str, Any]] | None
    family: str | None
    required: list[dict[str, Any]] | None = None  # the functions one of which must be called
    grammar: tuple[str, str] | None = None  # (kind, text)


def _tool_plan(srv: ServerState, req: ChatCompletionRequest) -> ToolPlan:
    """Checks `tools` and `tool_choice` (400s naming the field) and plans the request."""
    tools = req.tools or []
    choice = req.tool_choice
    names = [t.function.name for t in tools]
    if not tools:
        if choice == "required" or isinstance(choice, ToolChoiceFunction):
            raise OpenAIError(
                400, "tool_choice needs tools: the request gives none", param="tool_choice"
            )
        return ToolPlan(None, None)
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise OpenAIError(400, f"tools: the function name '{dup}' is repeated", param="tools")
    funcs = []
    for i, t in enumerate(tools):
        params = t.function.parameters
        if params is None:
            params = {"type": "object", "properties": {}}
        where = f"tools[{i}].function.parameters"
        if params.get("type", "object") != "object" or not isinstance(
            params.get("properties", {}), dict
        ):
            raise OpenAIError(
                400,
                f"{where} must be a JSON schema of an object "
                '({"type": "object", "properties": {...}})',
                param=where,
                code="invalid_schema",
            )
        if (problem := schema_problem(params, where)) is not None:
            raise OpenAIError(400, problem, param=where, code="invalid_schema")
        f: dict[str, Any] = {"name": t.function.name}
        if t.function.description is not None:
            f["description"] = t.function.description
        f["parameters"] = params
        funcs.append(f)
    if isinstance(choice, ToolChoiceFunction):
        if choice.function.name not in names:
            raise OpenAIError(
                400,
                f"tool_choice names the function '{choice.function.name}', which is not in "
                f"tools ({', '.join(names)})",
                param="tool_choice",
            )
        required = [f for f in funcs if f["name"] == choice.function.name]
    elif choice == "required":
        required = funcs
    elif choice == "none":
        # The model must not call: the tools are not shown and replies are not parsed.
        return ToolPlan(None, None)
    else:
        required = None
    if srv.chat_format is not None:
        family = "harmony"
    else:
        family, _ = family_of(srv.tokenizer.chat_template)
    plan = ToolPlan([{"type": "function", "function": f} for f in funcs], family, required)
    constrained = req.response_format is not None and _json_schema(srv, req) is not None
    parallel = req.parallel_tool_calls is not False
    if required is not None:
        if constrained:
            raise OpenAIError(
                400,
                'response_format and tool_choice "required" (or a named function) both '
                "constrain the reply; give one",
                param="tool_choice",
            )
        grammar = tool_grammar(srv.tokenizer, family, required, required=True, parallel=parallel)
        plan.grammar = ("lark", grammar)
    elif srv.tool_call_grammar == "lazy" and not constrained:
        # "auto": free text, and a call the model starts held to the tools' schemas.
        grammar = tool_grammar(srv.tokenizer, family, funcs, required=False, parallel=parallel)
        plan.grammar = ("lark", grammar)
    return plan


def _arguments(text: str) -> Any:
    """A call's arguments (JSON text) as templates take them: the object, or the text as is."""
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _chat_ids(
    srv: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    reasoning_effort: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    renders_tools = srv.chat_format is not None or family_of(srv.tokenizer.chat_template)[1]
    chat = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        elif content is None:
            # An assistant turn may be empty (SDKs send null for a reply that was all tool
            # calls); templates would fail on None with a message about their own internals.
            if m.role != "assistant":
                raise OpenAIError(
                    400,
                    f"messages[{i}].content is null; only an assistant message may be empty",
                    param=f"messages[{i}].content",
                )
            content = ""
        # Templates know "system"; OpenAI's newer "developer" role means the same to them.
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role}
        message["content"] = content
        if m.name is not None:
            message["name"] = m.name
        if not renders_tools:  # the hermes fallback, written as text (tool_parsers)
            if m.tool_calls:
                calls = [
                    hermes_call_text(c.function.name, c.function.arguments) for c in m.tool_calls
                ]
                message["content"] = "\n".join(filter(None, [content, *calls]))
            elif m.role == "tool":
                message = {
                    "role": "user",
                    "content": f"<tool_response>\n{content}\n</tool_response>",
                }
        else:
            if m.tool_calls:
                message["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {
                            "name": c.function.name,
                            "arguments": _arguments(c.function.arguments),
                        },
                    }
                    for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
        chat.append(message)
    if tools and not renders_tools:
        listing = "\n".join(json.dumps(t) for t in tools)
        prompt = FALLBACK_SYSTEM.format(tools=listing)
        if chat and chat[0]["role"] == "system":
            chat[0] = {**chat[0], "content": chat[0]["content"] + "\n\n" + prompt}
        else:
            chat.insert(0, {"role": "system", "content": prompt})
        tools = None
    if srv.chat_format is not None:  # harmony (gpt-oss), rendered straight to token ids
        render = functools.partial(
            srv.chat_format.render, chat, add_generation_prompt, reasoning_effort, tools=tools
        )
        try:
            if sum(len(m["content"]) for m in chat) < _OFF_LOOP_CHARS:
                return render()
            return await asyncio.to_thread(render)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from None
    kwargs = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
    try:
        text = srv.tokenizer.apply_chat_template(
            chat, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )
    except (jinja2.TemplateError, ValueError) as exc:
        raise OpenAIError(
            400, f"the chat template refused the messages: {exc}", param="messages"
        ) from None
    # The template writes the special tokens itself.
    return (await _encode(srv, [text], add_special_tokens=False))[0]


async def _start(
    srv: ServerState,
    items: list[tuple[list[int], SamplingParams]],
    request_id: str,
    grammar_param: str = "response_format",
) -> Submission:
    """Submits the request's sequences; `grammar_param` names the field whose grammar a
    GrammarError (a 400) is about."""
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
    except GrammarError as exc:
        raise OpenAIError(400, str(exc), param=grammar_param, code="invalid_schema") from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc)) from None
