"""Text in and out: encoding, chat templates, streaming detokenization and stop strings."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names transformers exposes to chat templates as variables (its special_tokens_map).
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Llama 3's end of turn and Llama 3.1's end of message (written after a tool call in its ipython
# environment): a reply ends at either, whatever eos the checkpoint's config lists.
_TURN_ENDS = ("<|eot_id|>", "<|eom_id|>")


def _token_str(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _ids(value: Any) -> set[int]:
    """eos_token_id from a config file: absent, one id, or a list of ids."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


class Tokenizer:
    """A Hugging Face fast tokenizer plus what tokenizer_config.json adds to it.

    Encoding and decoding give what transformers gives for the same files (version 5: the
    tokenizer.json post-processor decides about BOS, add_bos_token in the config does not).
    `config` is a tokenizer_config.json dict; the keys read are the special tokens (bos_token,
    eos_token, pad_token, unk_token, additional_special_tokens), chat_template and
    split_special_tokens. `eos_token_ids` adds stop ids to the config's eos_token, and so do
    Llama 3's `<|eot_id|>` and `<|eom_id|>` where the vocabulary has them as special tokens.
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        config: dict[str, Any] | None = None,
        eos_token_ids: Iterable[int] = (),
        name_or_path: str = "",
    ) -> None:
        self._tok = tok
        self.config = dict(config or {})
        self.name_or_path = name_or_path
        self._add_named_special_tokens()
        tok.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        self.bos_token = _token_str(self.config.get("bos_token"))
        self.eos_token = _token_str(self.config.get("eos_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        self.pad_token_id = self._id_of(_token_str(self.config.get("pad_token")))
        eos = set(eos_token_ids)
        if (eos_id := self._id_of(self.eos_token)) is not None:
            eos.add(eos_id)
        special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        eos.update(special[t] for t in _TURN_ENDS if t in special)
        self.eos_token_ids: set[int] = eos
        self.chat_template: str | dict[str, str] | None = self._read_template(
            self.config.get("chat_template")
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and, when present, chat_template.jinja and
        the eos ids of generation_config.json and config.json."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}: a fast tokenizer is needed")
        config = _read_json(path / "tokenizer_config.json")
        # A separate template file wins over the config's entry, as in transformers.
        if (template_file := path / "chat_template.jinja").is_file():
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        eos: set[int] = set()
        for name in ("generation_config.json", "config.json"):
            eos |= _ids(_read_json(path / name).get("eos_token_id"))
        return cls(tokenizers.Tokenizer.from_file(str(tok_file)), config, eos, str(path))

    def _add_named_special_tokens(self) -> None:
        # transformers adds the special tokens the config names but tokenizer.json lacks as added
        # tokens, and that changes how text containing them is split: do the same.
        have = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        named = [_token_str(self.config.get(name)) for name in _NAMED_TOKENS]
        for key in ("additional_special_tokens", "extra_special_tokens"):
            extra = self.config.get(key) or []
            named += [_token_str(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
        missing = [t for t in dict.fromkeys(named) if t and t not in have]
        if missing:
            self._tok.add_special_tokens(
                [tokenizers.AddedToken(t, special=True, normalized=False) for t in missing]
            )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @staticmethod
    def _read_template(value: Any) -> str | dict[str, str] | None:
        # tokenizer_config.json may hold several named templates as [{"name", "template"}].
        if isinstance(value, list):
            return {t["name"]: t["template"] for t in value}
        return value

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included (transformers' len(tokenizer))."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """encode() of each text, in one call that runs outside the GIL and across cores
        (tokenizers' encode holds the GIL). The fast variant skips the character offsets,
        which nothing here reads, and is faster."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """A step function for decoding one token at a time: the text the token completes, or
        None while it is held back (tokenizers' DecodeStream: a short window of recent tokens,
        never half a UTF-8 character)."""
        from tokenizers.decoders import DecodeStream

        stream, tok = DecodeStream(skip_special_tokens=skip_special_tokens), self._tok
        return lambda token_id: stream.step(tok, token_id)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's template as transformers renders it.

        Encode the result with add_special_tokens=False: the template writes BOS itself when the
        model wants one (transformers' apply_chat_template(tokenize=True) does the same).
        """
        template = self._pick_template(tools)
        # As in transformers: None-valued keys are dropped (templates test for missing keys),
        # and reasoning given under an older name is also offered as reasoning_content.
        chat = []
        for message in messages:
            message = {k: v for k, v in message.items() if v is not None}
            names = ("reasoning_content", "thinking", "reasoning")
            reasoning = next((message[k] for k in names if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            chat.append(message)
        named = {name: _token_str(self.config.get(name)) for name in _NAMED_TOKENS}
        variables = {k: v for k, v in named.items() if v is not None}
        variables.update(kwargs)
        variables.setdefault("documents", None)
        return _compile(template).render(
            messages=chat, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )

    def _pick_template(self, tools: list[dict[str, Any]] | None) -> str:
        template = self.chat_template
        if isinstance(template, dict):
            name = "tool_use" if tools and "tool_use" in template else "default"
            template = template.get(name)
        if not template:
            raise ValueError(
                f"the tokenizer of {self.name_or_path or 'this model'} has no chat template: "
                "give a plain prompt, or a tokenizer whose tokenizer_config.json has chat_template"
            )
        return template


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks assistant text for training masks; it renders
    its body unchanged, so a template that uses it must still compile here."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def _compile(source: str) -> jinja2.Template:
    # Templates come from model repositories, so they are untrusted code: sandboxed.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of output ids into text deltas.

    The deltas, followed by flush(), add up to tokenizer.decode(output ids), less a trailing
    U+FFFD (an incomplete last character: see _whole). Each push
    is one step of the tokenizer's decode_stream() (tokenizers' DecodeStream, in Rust: a short
    window of the last tokens, so the cost per token does not grow with the output), which
    holds text back while the last tokens are the first bytes of a character. flush() decodes
    the whole output once and returns what the deltas have not covered yet.

    `prompt_ids` is accepted because callers have it at hand, but the text never depends on it:
    it is the decode of the output alone, as transformers would give it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted = 0  # characters of text returned so far
        self._step = tokenizer.decode_stream(skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (often "", never a broken character)."""
        self.ids.append(token_id)
        text = self._step(token_id)
        if not text:
            return ""
        self.emitted += len(text)
        return text

    def flush(self) -> str:
        """The text still held back once generation has ended, up to its last whole character
        (see _whole)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        tail = full[self.emitted :]
        self.emitted = len(full)
        return _whole(tail)


class FinalDetokenizer:
    """IncrementalDetokenizer's interface for a caller that wants only the whole text (offline
    generation without stop strings): push() keeps the id and returns "", flush() decodes the
    output once. The same text as IncrementalDetokenizer's deltas and flush (both are the decode
    of the output ids), for none of its per-token work: at batch 256 that work was half of the
    engine's host time per step (benchmarks/bench_engine_host.py)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        return ""

    def flush(self) -> str:
        return _whole(self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens))


def _whole(text: str) -> str:
    """The text without the U+FFFD that ends it. Output cut short (max_tokens, a stop token)
    can end in the first bytes of a character, which decode as U+FFFD: no use to anyone, and
    the stream, which never emits text ending in U+FFFD, never shows it either. The stream's
    deltas never end in it, so this trims only what flush adds."""
    return text.rstrip("\ufffd")


class StopChecker:
    """Cuts streamed text at the first stop string, even one split across deltas.

    feed() holds back the longest tail that could still grow into a stop string; flush() gives
    it back when generation ends without a stop. After a hit, feed() returns ("", True).
    """

    def __init__(self, stop: Sequence[str], include_stop_str: bool = False) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if not all(stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self.stop = list(stop)
        self.include_stop_str = include_stop_str
        self.held = ""
        self.hit = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was hit)."""
        if self.hit:
            return "", True
        text = self.held + delta
        found = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if found:
            # The stop completed first wins, whatever the deltas were; of two that end together,
            # the longer.
            start, stop = min(found, key=lambda f: (f[0] + len(f[1]), f[0]))
            self.hit = True
            self.held = ""
            end = start + len(stop) if self.include_stop_str else start
            return text[:end], True
        keep = self._partial_tail(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held tail, when generation ended without a stop string."""
        held, self.held = self.held, ""
        return "" if self.hit else held

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
