"""Tool calls out of a model's reply text, per model family, incrementally.

A parser is fed the reply's text as it is generated (`push`) and closed at its end (`finish`);
each returns events: `str` (content the user sees) and `ToolCall` (a complete call). Text that
may still turn out to be a call's markup is held back until it is known; a call whose JSON does
not parse (or lacks a name) falls back to content, markup and all, so nothing is lost.

Families:
- "hermes": Qwen2.5 / Qwen3 (and the fallback for templates without tools):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, several allowed, text around them.
- "llama3": Llama 3.1's JSON tool calls: the whole reply is `{"name": ..., "parameters": {...}}`
  (or "arguments"), optionally after `<|python_tag|>`, several separated by `;`, ending at
  `<|eom_id|>` (or `<|eot_id|>`), both end-of-sequence tokens (inferx_core.tokenizer).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


Event = str | ToolCall


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded {"name", <args>} object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base: subclasses implement push and finish."""

    def push(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


class HermesParser(ToolParser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    def push(self, text: str) -> list[Event]:
        self._buf += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    # Keep back a tail that could be the start of the opening tag.
                    keep = _partial_suffix(self._buf, self.OPEN)
                    cut = len(self._buf) - keep
                    if cut:
                        events.append(self._buf[:cut])
                        self._buf = self._buf[cut:]
                    return _join(events)
                if at:
                    events.append(self._buf[:at])
                self._buf = self._buf[at:]
                self._in_call = True
            end = self._buf.find(self.CLOSE)
            if end < 0:
                return _join(events)
            raw = self._buf[: end + len(self.CLOSE)]
            self._buf = self._buf[end + len(self.CLOSE) :]
            self._in_call = False
            events.append(self._parse(raw))

    def _parse(self, raw: str) -> Event:
        body = raw[len(self.OPEN) : -len(self.CLOSE)]
        try:
            call = _call(json.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        return raw if call is None else call

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            # An unclosed call at the end (the stop string or EOS may eat the closing tag).
            body = rest[len(self.OPEN) :]
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except ValueError:
                call = None
            if call is not None:
                return [call]
        return [rest] if rest else []


class Llama3Parser(ToolParser):
    TAG = "<|python_tag|>"
    # The turn's end, in the text when special tokens are not skipped: <|eom_id|> after a call
    # in the ipython environment (tools given), <|eot_id|> otherwise.
    ENDS = ("<|eom_id|>", "<|eot_id|>")

    def __init__(self) -> None:
        self._buf = ""
        self._mode: str | None = None  # None: undecided, "text", "json"

    def push(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [text] if text else []
        self._buf += text
        if self._mode is None:
            head = self._buf.lstrip()
            if not head or (self.TAG.startswith(head) and head != self.TAG):
                return []
            self._mode = "json" if head.startswith(("{", self.TAG)) else "text"
            if self._mode == "text":
                out, self._buf = self._buf, ""
                return [out]
        return []

    def finish(self) -> list[Event]:
        rest, self._buf = self._buf, ""
        if self._mode != "json":
            return [rest] if rest else []
        body = rest.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG) :].strip()
        for end in self.ENDS:
            if body.endswith(end):
                body = body[: -len(end)].rstrip()
                break
        calls: list[Event] = []
        decoder = json.JSONDecoder()
        pos = 0
        try:
            while pos < len(body):
                obj, pos = decoder.raw_decode(body, pos)
                call = _call(obj, ("parameters", "arguments"))
                if call is None:
                    return [rest]
                calls.append(call)
                while pos < len(body) and body[pos] in " \t\r\n;":
                    pos += 1
        except ValueError:
            return [rest]
        return calls or ([rest] if rest else [])


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _join(events: list[Event]) -> list[Event]:
    """Adjacent strings merged, empty ones dropped."""
    out: list[Event] = []
    for e in events:
        if isinstance(e, str):
            if not e:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += e
                continue
        out.append(e)
    return out


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3": Llama3Parser}


def family_of(template: str | dict[str, Any] | None) -> tuple[str, bool]:
    """(parser family, whether the template renders tools itself) for a chat template.
    A template without tools gets the hermes format rendered by the server (see render)."""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    text = template or ""
    renders = "tools" in text
    if "<|python_tag|>" in text or "<|eom_id|>" in text:
        return "llama3", renders
    return "hermes", renders


def parse_all(family: str, text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply's content (text outside the calls) and its calls."""
    parser = PARSERS[family]()
    events = parser.push(text) + parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    return content, [e for e in events if isinstance(e, ToolCall)]


# The fallback for templates that do not render tools: the tools in a system message, in the
# hermes format that Qwen2.5's template writes, and calls / results as hermes markup.
FALLBACK_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_call_text(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = arguments
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"
