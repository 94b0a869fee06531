"""Chat formats other than the tokenizer's jinja template: OpenAI's harmony (gpt-oss).

`harmony_format(tokenizer)` is the one place that decides: a tokenizer with harmony's special
tokens is o200k_harmony, and its models are prompted in harmony and their replies split by
channel, whether or not a chat template came with it (gpt-oss's own jinja template renders
harmony too, but the reply still has to be parsed). Any other tokenizer gets None: use its
template (Tokenizer.apply_chat_template).

Rendering and parsing are the `openai-harmony` library's (the `gptoss` extra of inferx-models).
It wants OpenAI's o200k_base.tiktoken, which it would download; the file is the tokenizer's own
BPE vocabulary in another spelling, so it is written from tokenizer.json instead and the library
checks it against the official file's sha256. Nothing is downloaded.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import threading
import uuid
from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import Any

# The header and stop tokens of harmony; a tokenizer with all of them speaks it.
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
REASONING_EFFORTS = ("low", "medium", "high")
_DEVELOPER = ("system", "developer")
_VOCAB_FILE = "o200k_base.tiktoken"  # the name openai-harmony looks for in its base directory


def harmony_format(tokenizer: Any) -> HarmonyFormat | None:
    """The harmony format for a tokenizer that has harmony's special tokens, else None."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or any(backend.token_to_id(t) is None for t in HARMONY_TOKENS):
        return None
    return HarmonyFormat(tokenizer)


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table, which byte-level BPE vocabularies (as
    tokenizer.json stores them) use to spell bytes as printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: b for b in printable}
    extra = 256
    for b in range(256):
        if b not in chars:
            chars[b] = extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


def write_tiktoken_vocab(tokenizer: Any, path: str | Path) -> None:
    """Write the tokenizer's BPE vocabulary (without its added tokens) as a .tiktoken file:
    one "base64(token bytes) rank" line per token, by rank. For o200k_harmony's tokenizer.json
    the file is byte for byte OpenAI's o200k_base.tiktoken."""
    decoder = _byte_decoder()
    vocab = tokenizer.backend.get_vocab(with_added_tokens=False)
    lines = [
        base64.b64encode(bytes(decoder[ch] for ch in token)) + b" %d\n" % rank
        for token, rank in sorted(vocab.items(), key=lambda item: item[1])
    ]
    Path(path).write_bytes(b"".join(lines))


_lock = threading.Lock()
_encoding: Any = None


def _load_encoding(tokenizer: Any) -> Any:
    """openai-harmony's gpt-oss encoding, loaded once per process from a vocabulary file
    written from `tokenizer` (or from TIKTOKEN_ENCODINGS_BASE when that is set)."""
    global _encoding
    try:
        import openai_harmony as oh
    except ImportError:
        raise RuntimeError(
            "this model's tokenizer is o200k_harmony (gpt-oss), whose chat format needs the "
            "openai-harmony package: pip install 'inferx-models[gptoss]' (or openai-harmony)"
        ) from None
    with _lock:
        if _encoding is not None:
            return _encoding
        name = oh.HarmonyEncodingName.HARMONY_GPT_OSS
        if os.environ.get("TIKTOKEN_ENCODINGS_BASE"):
            _encoding = oh.load_harmony_encoding(name)
            return _encoding
        # The library reads the directory from the environment; set it only while loading.
        with tempfile.TemporaryDirectory() as tmp:
            write_tiktoken_vocab(tokenizer, Path(tmp) / _VOCAB_FILE)
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = tmp
            try:
                _encoding = oh.load_harmony_encoding(name)
            except oh.HarmonyError as exc:
                raise ValueError(
                    f"the tokenizer has harmony's special tokens, but its vocabulary is not "
                    f"o200k's ({exc})"
                ) from None
            finally:
                del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        return _encoding


class HarmonyFormat:
    """Prompts in harmony, and a parser per reply.

    The prompt: harmony's system message (model identity, knowledge cutoff, today's date, the
    reasoning effort, the channels), then the chat. OpenAI's system and developer messages both
    become one developer message (harmony's "# Instructions", what other formats call the system
    prompt), with the tools; assistant turns are final-channel messages, their tool calls
    commentary messages. Message names are not rendered.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.encoding = _load_encoding(tokenizer)  # first: it explains a missing library
        import openai_harmony as oh

        self._oh = oh
        # Harmony's two ends of a reply: <|return|> (done) and <|call|> (a tool call).
        stops = self.encoding.stop_tokens_for_assistant_actions()
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        reasoning_effort: str | None = None,
        today: date | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of `messages` ({"role", "content"} dicts, content a string), ending with
        `<|start|>assistant` when add_generation_prompt. Raises ValueError for what harmony
        cannot say.

        `tools` (OpenAI's [{"type": "function", "function": {name, description, parameters}}])
        go into a developer message as harmony's `functions` namespace. An assistant message's
        `tool_calls` become commentary messages to `functions.NAME` (JSON arguments), and a
        tool message (its `tool_call_id` naming one of those calls) the function's answer."""
        oh = self._oh
        effort = reasoning_effort or "medium"
        if effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, not {effort!r}")
        system = (
            oh.SystemContent.new()
            .with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
            .with_conversation_start_date((today or date.today()).isoformat())
        )
        convo = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
        # With tools, the instructions join them in one developer message at the start.
        instructions = [m.get("content") or "" for m in messages if m["role"] in _DEVELOPER]
        if tools:
            dev = oh.DeveloperContent.new()
            if instructions:
                dev = dev.with_instructions("\n\n".join(instructions))
            if tools:
                dev = dev.with_function_tools(
                    [
                        oh.ToolDescription.new(
                            t["function"]["name"],
                            t["function"].get("description") or "",
                            parameters=t["function"].get("parameters"),
                        )
                        for t in tools
                    ]
                )
            convo.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
        names: dict[str, str] = {}  # tool_call_id -> function name
        for i, m in enumerate(messages):
            role, content = m["role"], m.get("content") or ""
            if role in _DEVELOPER:
                if not tools:
                    dev = oh.DeveloperContent.new().with_instructions(content)
                    convo.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev))
            elif role == "user":
                convo.append(oh.Message.from_role_and_content(oh.Role.USER, content))
            elif role == "assistant":
                if content:
                    msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, content)
                    convo.append(msg.with_channel("final"))
                for call in m.get("tool_calls") or ():
                    fn = call["function"]
                    names[call.get("id", "")] = fn["name"]
                    args = fn["arguments"]
                    args = args if isinstance(args, str) else json.dumps(args)
                    msg = oh.Message.from_role_and_content(oh.Role.ASSISTANT, args)
                    convo.append(
                        msg.with_channel("commentary")
                        .with_recipient(f"functions.{fn['name']}")
                        .with_content_type("<|constrain|>json")
                    )
            elif role == "tool":
                name = names.get(m.get("tool_call_id", ""))
                if name is None:
                    raise ValueError(
                        f"messages[{i}] answers tool call {m.get('tool_call_id')!r}, which no "
                        "earlier assistant message made"
                    )
                author = oh.Author.new(oh.Role.TOOL, f"functions.{name}")
                msg = oh.Message.from_author_and_content(author, content)
                convo.append(msg.with_channel("commentary").with_recipient("assistant"))
            else:
                raise ValueError(f"messages[{i}] has role {role!r}, which harmony cannot say")
        conversation = oh.Conversation.from_messages(convo)
        if add_generation_prompt:
            return self.encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
        return self.encoding.render_conversation(conversation)

    def parser(self, tools: bool = False) -> HarmonyParser:
        """A reply's parser; with `tools`, calls to `functions.NAME` are tool calls."""
        return HarmonyParser(self, tools)

    def parse(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """(reasoning_content, content) of a whole reply."""
        return self.parser().push(token_ids)


class HarmonyParser:
    """Splits a reply's tokens, as they come, into reasoning and content deltas.

    The final channel is the content; every other channel (analysis, and commentary: preambles
    and, for a parser made without `tools`, a tool call's raw arguments) is reasoning_content,
    vLLM's convention. Deltas never end inside a UTF-8 character (openai-harmony holds the
    bytes back), and the deltas of a reply add up to what the whole reply parses to. The parser
    is lenient (strict=False): text before the first header, which a model sometimes writes, is
    skipped rather than failing the messages after it. Text it cannot place shows nowhere, and a
    reply that breaks the format past recovery (text after <|end|> without a <|start|>) ends
    there.
    """

    def __init__(self, fmt: HarmonyFormat, tools: bool = False) -> None:
        oh = fmt._oh
        self._error = oh.HarmonyError
        self._parser = oh.StreamableParser(fmt.encoding, role=oh.Role.ASSISTANT, strict=False)
        self._broken = False
        self._tools = tools
        self._calls: list[tuple[str | None, str | None, str]] = []
        self._in_call = 0  # the message count at the open call's start, + 1 (0: none open)

    def push(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """Feed tokens; return the (reasoning, content) text they complete."""
        reasoning, content = [], []
        parser = self._parser
        for token in token_ids:
            if self._broken:
                break
            try:
                parser.process(token)
            except self._error:
                # A reply the parser cannot follow: keep what it gave, drop the rest.
                self._broken = True
                break
            delta = parser.last_content_delta
            if not delta:
                continue
            recipient = parser.current_recipient or ""
            if self._tools and recipient.startswith("functions."):
                opened = len(parser.messages) + 1
                if self._in_call != opened:  # a new call message
                    self._in_call = opened
                    call_id = f"call_{uuid.uuid4().hex[:24]}"
                    self._calls.append((call_id, recipient.removeprefix("functions."), ""))
                self._calls.append((None, None, delta))
            else:
                (content if parser.current_channel == "final" else reasoning).append(delta)
        return "".join(reasoning), "".join(content)

    def take_calls(self) -> list[tuple[str | None, str | None, str]]:
        """Tool-call events since the last take: (id, name, "") opens a call, (None, None,
        fragment) adds to its arguments. Only with `tools`."""
        calls, self._calls = self._calls, []
        return calls
