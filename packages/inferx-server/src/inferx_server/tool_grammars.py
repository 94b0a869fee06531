"""Grammars that hold a model's tool calls to the request's tools, per model family, in
llguidance's Lark dialect (`GrammarBackend.compile(text, "lark")`), and the check of a tool's
`parameters` schema.

Two kinds of grammar per family (see docs/ARCHITECTURE.md, "Tool calling"):
- required (tool_choice "required" or a named function): the reply is one call (or several
  where the family and parallel_tool_calls allow), in the family's own format.
- lazy (tool_choice "auto"): the reply is free until the model starts a call (hermes'
  `<tool_call>`, a Llama 3.1 reply opening with `{` or `<|python_tag|>`, a harmony header
  addressed `to=functions.`); from there the call is held to a tool's name and parameters.

A marker that is one added token of the vocabulary is written as that token (`<[id]>`):
llguidance treats every added token as a special token, never as the text it spells. For the
same reason free text is text and the vocabulary's other added tokens (Qwen3's `<think>`), so
the grammar leaves them where the model puts them; only the end-of-sequence tokens are left out,
as the grammar's end is where they are allowed.
"""

from __future__ import annotations

import json
import re
import weakref
from typing import Any

# Arguments as the families' templates write them. `lenient`: keywords and formats llguidance
# does not implement are not enforced rather than refused (agent frameworks send schemas with
# anything in them; a malformed schema is refused before, by schema_problem).
_TEMPLATE_JSON = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}
# gpt-oss writes both `{"a":1,"b":2}` and `{"a": 1, "b": 2}` (harmony's own examples have both).
_HARMONY_JSON = {**_TEMPLATE_JSON, "item_separator": ", ?", "key_separator": ": ?"}

_TEXT = r"TEXT: /(.|\n)*/"


class _Vocab:
    """How the grammar spells a marker for one tokenizer, and which added tokens free text
    may hold."""

    def __init__(self, tokenizer: Any) -> None:
        backend = tokenizer.backend
        self.added = {tid: tok.content for tid, tok in backend.get_added_tokens_decoder().items()}
        self.ids = {content: tid for tid, content in self.added.items()}
        self.eos = set(tokenizer.eos_token_ids)

    def token(self, text: str) -> int | None:
        """The id of the added token `text`, or None when it is plain text to llguidance."""
        return self.ids.get(text)

    def lit(self, text: str) -> str:
        tid = self.token(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    def others(self, *markers: str) -> str | None:
        """A token set of the added tokens free text may hold: all but the end-of-sequence
        tokens and `markers`; None when there are none."""
        skip = self.eos | {self.ids[m] for m in markers if m in self.ids}
        ids = sorted(tid for tid in self.added if tid not in skip)
        if not ids:
            return None
        spans: list[list[int]] = []
        for tid in ids:
            if spans and spans[-1][1] == tid - 1:
                spans[-1][1] = tid
            else:
                spans.append([tid, tid])
        return "<[" + ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans) + "]>"


# Per tokenizer (a server has one), without keeping it alive.
_vocabs: weakref.WeakKeyDictionary[Any, _Vocab] = weakref.WeakKeyDictionary()


def _vocab(tokenizer: Any) -> _Vocab:
    vocab = _vocabs.get(tokenizer)
    if vocab is None:
        vocab = _vocabs[tokenizer] = _Vocab(tokenizer)
    return vocab


def _args(params: dict[str, Any], style: dict[str, Any]) -> str:
    return "%json " + json.dumps({**params, "x-guidance": style})


def tool_grammar(
    tokenizer: Any,
    family: str,
    funcs: list[dict[str, Any]],
    *,
    required: bool,
    parallel: bool = True,
) -> str:
    """The Lark grammar holding a reply of `family` ("hermes", "llama3", "harmony") to calls
    of `funcs` ({"name", "parameters"} dicts): a call is required, or free text with lazily
    constrained calls."""
    vocab = _vocab(tokenizer)
    if family == "hermes":
        return _hermes(vocab, funcs, required, parallel)
    if family == "llama3":
        return _llama3(vocab, funcs, required, parallel)
    if family == "harmony":
        return _harmony(vocab, funcs, required)
    raise ValueError(f"no tool grammar for the family {family!r}")


def _calls(funcs: list[dict[str, Any]], key: str, style: dict[str, Any]) -> list[str]:
    """Rules `call: fn_0 | fn_1 ...`, each `{"name": "NAME", "<key>": <its arguments>}` in the
    templates' spacing; the arguments are the function's own schema at the root of their
    %json, so its local $refs resolve."""
    rules = ["call: " + " | ".join(f"fn_{i}" for i in range(len(funcs)))]
    for i, f in enumerate(funcs):
        head = json.dumps('{"name": ' + json.dumps(f["name"]) + f', "{key}": ')
        rules.append(f'fn_{i}: {head} args_{i} "}}"')
        rules.append(f"args_{i}: {_args(f['parameters'], style)}")
    return rules


def _hermes(vocab: _Vocab, funcs: list[dict[str, Any]], required: bool, parallel: bool) -> str:
    """Qwen's `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks."""
    open_, close = "<tool_call>", "</tool_call>"
    block = f'"\\n" call "\\n" {vocab.lit(close)}'
    rules = _calls(funcs, "arguments", _TEMPLATE_JSON)
    if required:
        one = f"{vocab.lit(open_)} {block}"
        start = f'start: ({one} "\\n")* {one}' if parallel else f"start: {one}"
        return "\n".join([start, *rules]) + "\n"
    other = vocab.others(open_, close)
    lines = ["%llguidance {}"]
    # With parallel calls off, the one call ends the reply.
    lines.append("start: seg* tail" if parallel else "start: seg | tail")
    # Text up to the call's opening: text and other added tokens, then the marker, which is
    # a token of its own or (as plain text) the end of a lazy lexeme.
    pre = "(TEXT other)* " if other else ""
    if vocab.token(open_) is not None:
        lines.append(f"seg: {pre}TEXT {vocab.lit(open_)} {block}")
    else:
        lines.append(f"seg: {pre}opening {block}")
        # Lazy: the lexeme ends at the marker's first appearance, so written marker text
        # always opens a call.
        lines.append(f"opening[lazy]: TEXT {json.dumps(open_)}")
    lines.append("tail: TEXT (other TEXT)*" if other else "tail: TEXT")
    lines += rules
    lines.append(_TEXT)
    if other:
        lines.append(f"other: {other}")
    return "\n".join(lines) + "\n"


def _llama3(vocab: _Vocab, funcs: list[dict[str, Any]], required: bool, parallel: bool) -> str:
    """Llama 3.1's JSON calls: the reply is `{"name": ..., "parameters": ...}` (after
    `<|python_tag|>` or not; several joined by "; "), or text that does not open with `{`."""
    tag = "<|python_tag|>"
    calls = 'call (";" " "? call)*' if parallel else "call"
    lines = ["%llguidance {}"]
    if required:
        lines.append(f"start: {vocab.lit(tag)}? {calls}")
    else:
        other = vocab.others(tag)
        lines.append("start: SPACE? calls | reply")
        lines.append(f"calls: {vocab.lit(tag)}? {calls}")
        lines.append("reply: LEAD (other TEXT)*" if other else "reply: LEAD")
        lines.append(r"SPACE: /\s+/")
        lines.append(r"LEAD: /\s*([^{\s](.|\n)*)?/")
        lines.append(_TEXT)
        if other:
            lines.append(f"other: {other}")
    lines += _calls(funcs, "parameters", _TEMPLATE_JSON)
    return "\n".join(lines) + "\n"


def _harmony(vocab: _Vocab, funcs: list[dict[str, Any]], required: bool) -> str:
    """gpt-oss: messages in harmony (the prompt ends with `<|start|>assistant`); a call is a
    commentary message to `functions.NAME` (the recipient in the channel or the role part of
    the header), `<|constrain|>json`, its JSON arguments and `<|call|>`. Required: analysis
    and commentary (preamble) messages may come first, then the call. Lazy: any messages of
    the three channels, one of which may be a call, the last.

    Headers hold what the prompt declares (the three channels; recipients in `functions`):
    text there is format, and free header text would cost a walk of the whole vocabulary at
    each of its tokens. Message text is free."""
    names = ("start", "channel", "message", "end", "constrain", "call")
    t = {name: vocab.lit(f"<|{name}|>") for name in names}
    lines = ["%llguidance {}"]
    if required:
        lines.append(f'start: (message {t["end"]} {t["start"]} "assistant")* call')
        lines.append(f'message: {t["channel"]} ("analysis" | "commentary") {t["message"]} BODY')
    else:
        lines.append(f'start: (message {t["end"]} {t["start"]} "assistant")* (message | call)')
        channels = '("analysis" | "commentary" | "final")'
        lines.append(f"message: {t['channel']} {channels} {t['message']} BODY")
    lines.append("call: " + " | ".join(f"fn_{i}" for i in range(len(funcs))))
    for i, f in enumerate(funcs):
        role = json.dumps(" to=functions." + f["name"])
        channel = json.dumps("commentary to=functions." + f["name"])
        head = f'{t["channel"]} {channel} | {role} {t["channel"]} "commentary"'
        body = f'" "? {t["constrain"]} "json" {t["message"]} args_{i} {t["call"]}'
        lines.append(f"fn_{i}: ({head}) {body}")
        lines.append(f"args_{i}: {_args(f['parameters'], _HARMONY_JSON)}")
    lines.append(r"BODY: /(.|\n)*/")
    return "\n".join(lines) + "\n"


def harmony_final_json(tokenizer: Any, schema: dict[str, Any]) -> str:
    """response_format for gpt-oss: analysis and commentary (preamble) messages as the model
    likes, then the final channel's message, held to `schema` (compact JSON, as structured
    output writes it; the schema's own x-guidance wins). The grammar is complete at the JSON's
    end, where the engine finishes the reply."""
    vocab = _vocab(tokenizer)
    names = ("start", "channel", "message", "end")
    t = {name: vocab.lit(f"<|{name}|>") for name in names}
    style = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    lines = [
        "%llguidance {}",
        f'start: (message {t["end"]} {t["start"]} "assistant")* '
        f'{t["channel"]} "final" {t["message"]} answer',
        f'message: {t["channel"]} ("analysis" | "commentary") {t["message"]} BODY',
        "answer: %json " + json.dumps({"x-guidance": style, **schema}),
        r"BODY: /(.|\n)*/",
    ]
    return "\n".join(lines) + "\n"


_JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_SUBSCHEMA = (
    "items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not",
    "if", "then", "else", "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = (
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
    "minContains", "maxContains",
)  # fmt: skip


def schema_problem(schema: Any, where: str) -> str | None:
    """What makes `schema` no JSON schema (the keywords' shapes as the JSON Schema meta-schema
    gives them, local `$ref`s that point nowhere), named by its path under `where`; None for
    a valid one. Keywords it does not know are left alone, as JSON Schema does."""
    return _problem(schema, where, schema)


def _problem(s: Any, at: str, root: Any) -> str | None:
    if isinstance(s, bool):
        return None
    if not isinstance(s, dict):
        return f"{at} must be a JSON schema (an object or a boolean), not {json.dumps(s)}"
    kind = s.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        for k in kinds:
            if k not in _JSON_TYPES:
                return f"{at}.type: {json.dumps(k)} is not a JSON type ({', '.join(_JSON_TYPES)})"
    if "required" in s and not (
        isinstance(s["required"], list) and all(isinstance(r, str) for r in s["required"])
    ):
        return f"{at}.required must be a list of property names"
    if "enum" in s and not isinstance(s["enum"], list):
        return f"{at}.enum must be a list of values"
    for key in _NUMBERS:
        if key in s and (isinstance(s[key], bool) or not isinstance(s[key], int | float)):
            return f"{at}.{key} must be a number"
    if isinstance(s.get("multipleOf"), int | float) and s["multipleOf"] <= 0:
        return f"{at}.multipleOf must be greater than 0"
    for key in _COUNTS:
        if key in s and (isinstance(s[key], bool) or not isinstance(s[key], int) or s[key] < 0):
            return f"{at}.{key} must be a non-negative integer"
    if "pattern" in s:
        if not isinstance(s["pattern"], str):
            return f"{at}.pattern must be a string"
        try:
            re.compile(s["pattern"])
        except re.error as exc:
            return f"{at}.pattern is no regular expression: {exc}"
    if "$ref" in s:
        ref = s["$ref"]
        if not isinstance(ref, str):
            return f"{at}.$ref must be a string"
        if ref.startswith("#") and _resolve(root, ref) is None:
            return f"{at}.$ref: {ref} points to nothing in the schema"
    for key in _SUBSCHEMA:
        if key in s:
            sub = s[key]
            if key == "items" and isinstance(sub, list):  # draft 4-7 tuples
                for i, item in enumerate(sub):
                    if problem := _problem(item, f"{at}.items[{i}]", root):
                        return problem
            elif problem := _problem(sub, f"{at}.{key}", root):
                return problem
    for key in _SUBSCHEMA_LISTS:
        if key in s:
            if not isinstance(s[key], list) or not s[key]:
                return f"{at}.{key} must be a non-empty list of schemas"
            for i, sub in enumerate(s[key]):
                if problem := _problem(sub, f"{at}.{key}[{i}]", root):
                    return problem
    for key in _SUBSCHEMA_MAPS:
        if key in s:
            if not isinstance(s[key], dict):
                return f"{at}.{key} must be an object of schemas"
            for name, sub in s[key].items():
                if problem := _problem(sub, f"{at}.{key}.{name}", root):
                    return problem
    return None


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#", "#/$defs/x", JSON pointer escapes) names, or None."""
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
