"""OpenAI's HTTP API as msgspec structs: requests (decoded strictly), responses, chunks, errors.

Requests forbid unknown fields, so a parameter we do not implement is refused by name instead of
being ignored. OpenAI parameters we know but do not implement get their own message
(UNSUPPORTED); anything else is reported as unknown. Ranges mirror OpenAI's documented ones.

SDKs and frameworks send parameters that change nothing: `null` for any optional one (it means
the default, as OpenAI reads it), and no-op values of features we lack (`store: false`). Those
are accepted;
the types below admit only the no-op values, so the OpenAPI schema says exactly what runs, and
any other value is refused by name (NOOP_ONLY).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

# OpenAI parameters this server refuses (they would change the output and we cannot honour them).
UNSUPPORTED = frozenset(
    {
        "audio",
        "best_of",
        "echo",
        "function_call",
        "functions",
        "modalities",
        "prediction",
        "prompt_cache_key",
        "safety_identifier",
        "service_tier",
        "suffix",
        "verbosity",
        "web_search_options",
    }
)

# Parameters accepted only at their no-op values, and what to say about any other value.
NOOP_ONLY = {
    "store": "this server stores nothing; only false is accepted",
}

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0, description="a token id")]
# OpenAI's logit_bias: token ids (as JSON object keys, so strings) to a bias added to the logit.
LogitBias = dict[
    Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")], Annotated[float, Meta(ge=-100, le=100)]
]


class OpenAIError(Exception):
    """A request failed; rendered as OpenAI's {"error": {...}} body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.code))


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


# -- requests --------------------------------------------------------------------------------


_NULLABLE: dict[type, list[tuple[str, Any]]] = {}


class _Body(Struct, forbid_unknown_fields=True, kw_only=True):
    """A request body whose optional fields read `null` as their default."""

    def __post_init__(self) -> None:
        cls = type(self)
        defaults = _NULLABLE.get(cls)
        if defaults is None:
            defaults = _NULLABLE[cls] = [
                (f.name, f.default)
                for f in msgspec.structs.fields(cls)
                if f.default is not None and f.default is not msgspec.NODEFAULT
            ]
        for name, default in defaults:
            if getattr(self, name) is None:
                setattr(self, name, default)


class StreamOptions(_Body):
    include_usage: bool | None = False


class ResponseFormatText(Struct, forbid_unknown_fields=True, tag="text", tag_field="type"):
    """Plain text: no constraint."""


class ResponseFormatJSONObject(
    Struct, forbid_unknown_fields=True, tag="json_object", tag_field="type"
):
    """Any JSON object."""


class JSONSchema(Struct, forbid_unknown_fields=True, kw_only=True):
    """`schema` is required here (OpenAI's own API lets it out). `strict` is accepted either
    way: the output is always held to the schema."""

    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    schema: dict[str, Any]
    strict: bool | None = None


class ResponseFormatJSONSchema(
    Struct, forbid_unknown_fields=True, tag="json_schema", tag_field="type"
):
    """A JSON value valid against `json_schema.schema`."""

    json_schema: JSONSchema


class FunctionDefinition(Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool's function: `parameters` is a JSON schema of its arguments (an object)."""

    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Struct, forbid_unknown_fields=True):
    name: str


class ToolChoiceFunction(Struct, forbid_unknown_fields=True, kw_only=True):
    """tool_choice naming the one function the reply must call."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction


class MessageFunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str


class MessageToolCall(Struct, forbid_unknown_fields=True, kw_only=True):
    """A call in an assistant message, as the API returned it (OpenAI's `tool_calls`)."""

    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


ResponseFormat = ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema


class _Sampling(_Body, kw_only=True):
    """Parameters both endpoints share. The vLLM group are its extensions to OpenAI's API; the
    last group are accepted only at no-op values (see NOOP_ONLY)."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=64)] | None = 1
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # int64, as vLLM's
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None  # an end-user id, as in OpenAI's API: recorded nowhere
    metadata: dict[str, Any] | None = None  # recorded nowhere, like `user`
    # vLLM's extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None  # means nothing without tools
    # no-ops only
    store: Literal[False] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None
    # no-ops only: a completion has no tool calls
    tools: Annotated[list[Any], Meta(max_length=0)] | None = None
    tool_choice: Literal["none", "auto"] | None = None

    __noop_only__: ClassVar[dict[str, str]] = {
        "tools": "tools are for /v1/chat/completions; only [] is accepted here",
        "tool_choice": 'tools are for /v1/chat/completions; only "none" or "auto" is accepted here',
    }


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    """`content: null` is an assistant message's empty reply; other roles must say something."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message's answer to that call


Messages = Annotated[list[ChatMessage], Meta(min_length=1)]


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions, rendered with the model's chat template (or in harmony, for
    gpt-oss). `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
    `reasoning_effort` goes into harmony's system message (default medium); a jinja template
    gets it as the variable `reasoning_effort`, which most ignore."""

    messages: Messages
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class TokenizeRequest(_Body, kw_only=True):
    """POST /tokenize: `prompt` as /v1/completions encodes it, or `messages` as chat does;
    exactly one of them (the schema's oneOf)."""

    # Exactly one of the two, so neither may be null: JSON Schema's `required` counts a null.
    __openapi_one_of__: ClassVar[tuple[str, ...]] = ("prompt", "messages")

    model: str | None = None
    prompt: str | UnsetType = UNSET
    messages: Messages | UnsetType = UNSET
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def decode_request(body: bytes, type_: type[Any]) -> Any:
    """Strictly decode a JSON body; any problem becomes a 400 that names the parameter."""
    if not body.strip():
        raise OpenAIError(400, "the request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        m = _AT.match(str(exc))
        assert m is not None  # the pattern matches any string
        # A dict's values are at `$.name[...]`: the parameter is the dict.
        msg, path = m.group("msg"), (m.group("path") or "").lstrip(".").replace("[...]", "")
        top = path.split("[", 1)[0].split(".", 1)[0]
        noop_only = NOOP_ONLY | getattr(type_, "__noop_only__", {})
        if top in noop_only:
            raise OpenAIError(
                400, f"'{path}': {noop_only[top]}", param=top, code="unsupported_parameter"
            ) from None
        if unknown := _UNKNOWN.search(msg):
            name = unknown.group("name")
            param = f"{path}.{name}" if path else name
            if name in UNSUPPORTED and not path:
                raise OpenAIError(
                    400,
                    f"'{name}' is not supported by this server",
                    param=param,
                    code="unsupported_parameter",
                ) from None
            raise OpenAIError(
                400, f"unknown parameter '{param}'", param=param, code="unknown_parameter"
            ) from None
        where = f"'{path}': " if path else ""
        raise OpenAIError(400, f"{where}{msg}", param=path or None) from None
    except msgspec.DecodeError as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from None


# -- responses -------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct):
    """The legacy completions format: parallel lists, one entry per generated token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | UnsetType = UNSET


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class AssistantMessage(Struct):
    """`reasoning_content` (vLLM's field): a reasoning model's thinking, beside its answer in
    `content`; absent for other models. `tool_calls`: present when the reply called tools
    (`content` is then the text outside the calls, or null)."""

    content: str | None
    role: str = "assistant"
    reasoning_content: str | None | UnsetType = UNSET
    tool_calls: list[MessageToolCall] | UnsetType = UNSET


class DeltaFunction(Struct, omit_defaults=True):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct):
    """A streamed call: its first delta has id, type, function.name and arguments ""; later
    ones only index and argument fragments (OpenAI's stream)."""

    index: int
    function: DeltaFunction
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(Struct):
    role: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(Struct):
    """One streamed event; `usage` is null in every chunk but the last when usage was asked."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "inferx"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(Struct):
    prompt: str


class Health(Struct):
    status: str
    detail: str | None = None
