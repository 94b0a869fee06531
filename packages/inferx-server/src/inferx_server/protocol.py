"""OpenAI's HTTP API as msgspec structs: requests (decoded strictly), responses, chunks, errors.

Requests forbid unknown fields, so a parameter we do not implement is refused by name instead of
being ignored. OpenAI parameters we know but do not implement get their own message
(UNSUPPORTED); anything else is reported as unknown. Ranges mirror OpenAI's documented ones.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

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
        "logit_bias",
        "metadata",
        "modalities",
        "parallel_tool_calls",
        "prediction",
        "prompt_cache_key",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "service_tier",
        "store",
        "suffix",
        "tool_choice",
        "tools",
        "verbosity",
        "web_search_options",
    }
)

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
TopLogprobs = Annotated[int, Meta(ge=0, le=20)]
PositiveInt = Annotated[int, Meta(ge=1)]


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


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Sampling(Struct, forbid_unknown_fields=True, kw_only=True):
    """Parameters both endpoints share. The last group are vLLM's extensions to OpenAI's API."""

    model: str | None = None
    n: Annotated[int, Meta(ge=1, le=64)] = 1
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # int64, as vLLM's
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id, as in OpenAI's API: recorded nowhere
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


class CompletionRequest(_Sampling, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    prompt: str | list[str | int | list[int]]
    logprobs: TopLogprobs | None = None


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    """POST /v1/chat/completions, rendered with the model's chat template."""

    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None


class TokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /tokenize: `prompt` as /v1/completions encodes it, or `messages` as chat does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    tokens: list[int]


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_UNKNOWN = re.compile(r"unknown field `(?P<name>[^`]+)`")


def decode_request(body: bytes, type_: type[Any]) -> Any:
    """Strictly decode a JSON body; any problem becomes a 400 that names the parameter."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        m = _AT.match(str(exc))
        assert m is not None  # the pattern matches any string
        msg, path = m.group("msg"), (m.group("path") or "").lstrip(".")
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
    content: str
    role: str = "assistant"


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
    content: str | UnsetType = UNSET


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
