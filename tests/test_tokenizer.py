"""Tokenizer, IncrementalDetokenizer and StopChecker, against transformers on real tokenizers."""

from __future__ import annotations

import functools
import os
import random

import pytest
from conftest import FIXTURES

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from inferx_core.tokenizer import (  # noqa: E402
    FinalDetokenizer,
    IncrementalDetokenizer,
    StopChecker,
    Tokenizer,
)

NAMES = ["qwen", "llama3", "gpt-oss", "gguf"]

CORPUS = [
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "   runs   of    spaces   ",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nCRLF\r",
    "digits 1 12 123 1234 12345 3.14159 1,000,000 0x1F 2024-01-01",
    "  42 and\n\n1. first\n2. second\n   10. tenth",
    "½ ² ٣ Ⅻ ①",
    "日本語のテキストと中文混合，标点！",
    "한국어 텍스트",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flag 🇺🇳 skin 👍🏽 keycap 1️⃣ rainbow 🏳️‍🌈",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0354a\u0362l\u0327g\u0310o",
    "caf\u00e9 vs cafe\u0301",
    "Ünïcödé Ελληνικά русский عربي עברית हिन्दी ไทย",
    "zero\u200bwidth\u200djoiner\ufeffbom\u00a0nbsp\u3000wide",
    "\x00 control \x07 chars \x1b[0m",
    "def f(x):\n    return x**2  # comment\n\tif x >= 10: print(f'{x!r}')\n",
    '{"key": [1, 2.5, null], "k2": {"nested": "v"}}',
    "it's they're I'M we'll you'd",
    "!!!???...---***",
    "a" * 200,
    "supercalifragilistic antidisestablishmentarianism Rahmenbedingungen ‍‍‍",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|start|>assistant<|channel|>final<|message|>hi<|return|>",
    "<think>\nhmm\n</think>\n\nanswer",
    "<|im_start|>",
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse. Ünïcödé 日本"},
        {"role": "user", "content": "Hi there, 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?\n\n1. show work"},
    ],
    [{"role": "user", "content": "Only a user turn 👋"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "tool_calls": None},
    ],
]


@functools.cache
def load(name: str) -> tuple[Tokenizer, object]:
    """(ours, transformers') for one of NAMES; shared, so tests must not change them."""
    if name == "gguf":
        import torch

        from inferx_models.gguf import GGUFFormat, find_demo_gguf

        path = find_demo_gguf()
        ours = GGUFFormat().open(path, torch.float32).tokenizer
        ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return ours, ref
    folder = FIXTURES / "tokenizers" / name
    if not folder.is_dir():
        pytest.skip(f"fixture {folder} is missing (set INFERX_FIXTURES to the fixtures folder)")
    return Tokenizer.from_dir(folder), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    if request.param == "gguf":
        pytest.importorskip("gguf")
    return request.param, *load(request.param)


def numbers_after_whitespace(text: str) -> bool:
    """Where transformers' GGUF tokenizer splits differently from the model's own (see test_gguf):
    whitespace directly before a number."""
    return any(a.isspace() and b.isnumeric() for a, b in zip(text, text[1:], strict=False))


def byte_token_ids(tok: Tokenizer) -> list[int | None]:
    """The ids of the 256 single-byte tokens of a byte-level BPE, by byte value."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [tok.backend.token_to_id(ch) for _, ch in sorted(bytes_to_unicode().items())]


# -- encode / decode ----------------------------------------------------------------------------


def test_properties_match_transformers(pair):
    _, ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert ours.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_token_ids
    assert ours.pad_token_id == ref.pad_token_id


def test_encode_matches_transformers(pair):
    name, ours, ref = pair
    for text in CORPUS:
        if name == "gguf" and numbers_after_whitespace(text):
            continue
        for special in (True, False):
            expected = ref(text, add_special_tokens=special)["input_ids"]
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)


def test_encode_batch_is_encode_of_each(pair):
    """encode_batch (the server's off-loop path for long prompts) gives encode()'s ids, in
    order, for the corpus and for long random texts."""
    _, ours, _ = pair
    rng = random.Random(5)
    long = ["".join(rng.choice(CORPUS) for _ in range(30)) for _ in range(3)]
    texts = [*CORPUS, *long]
    for special in (True, False):
        expected = [ours.encode(t, add_special_tokens=special) for t in texts]
        assert ours.encode_batch(texts, add_special_tokens=special) == expected, special


def test_decode_matches_transformers(pair):
    _, ours, ref = pair
    rng = random.Random(1)
    specials = sorted(ours.backend.get_added_tokens_decoder())
    samples = [ours.encode(text) for text in CORPUS]
    samples += [
        [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(ours.vocab_size)]
        + [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(20))]
        for _ in range(50)
    ]
    for ids in samples:
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids


def test_decode_of_encode_round_trips_plain_text(pair):
    _, ours, _ = pair
    normalizer = ours.backend.normalizer  # Qwen's NFC changes "e\u0301" into "\u00e9"
    for text in CORPUS:
        if "<" not in text:
            expected = normalizer.normalize_str(text) if normalizer else text
            assert ours.decode(ours.encode(text, add_special_tokens=False)) == expected


# -- streaming ----------------------------------------------------------------------------------


def stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


def whole(text: str) -> str:
    """A decode as the detokenizers end it: without the U+FFFD of an incomplete last character."""
    return text.rstrip("\ufffd")


def test_stream_equals_one_shot_decode(pair):
    _, ours, _ = pair
    for text in CORPUS:
        ids = ours.encode(text)
        for skip in (True, False):
            assert "".join(stream(ours, ids, skip)) == ours.decode(ids, skip), text


def test_stream_of_bytes_never_breaks_a_character(pair):
    # One token per UTF-8 byte: every multi-byte character arrives in pieces.
    _, ours, _ = pair
    byte_ids = byte_token_ids(ours)
    for text in CORPUS:
        if "<" in text:
            continue
        deltas = stream(ours, [byte_ids[b] for b in text.encode()])
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas), text


def test_stream_of_random_ids_equals_one_shot_decode(pair):
    # Random byte tokens make broken UTF-8 (lone continuation bytes, cut sequences) on purpose.
    _, ours, _ = pair
    rng = random.Random(0)
    byte_ids = byte_token_ids(ours)
    high = [i for i in byte_ids[0x80:] if i is not None]  # SmolLM lacks bytes UTF-8 never uses
    specials = sorted(ours.backend.get_added_tokens_decoder())
    for _ in range(200):
        ids = []
        for _ in range(rng.randrange(1, 40)):
            roll = rng.random()
            if roll < 0.5:
                ids.append(rng.choice(high))
            elif roll < 0.6:
                ids.append(rng.choice(specials))
            else:
                ids.append(rng.randrange(ours.vocab_size))
        for skip in (True, False):
            assert "".join(stream(ours, ids, skip)) == whole(ours.decode(ids, skip)), ids


def test_final_text_equals_the_stream(pair):
    """FinalDetokenizer (offline generation): nothing per token, then the stream's whole text,
    on text and on random ids (broken UTF-8 and special tokens among them)."""
    _, ours, _ = pair
    rng = random.Random(1)
    cases = [ours.encode(t) for t in CORPUS]
    cases += [
        [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))] for _ in range(50)
    ]
    for ids in cases:
        for skip in (True, False):
            final = FinalDetokenizer(ours, skip)
            assert [final.push(i) for i in ids] == [""] * len(ids)
            assert final.flush() == "".join(stream(ours, ids, skip)), ids


def test_stream_cost_does_not_grow_with_the_output():
    # Pushes run in the tokenizers library's DecodeStream (a short window per token) and never
    # call our decode; the one whole decode is flush's, once per request.
    ours = Tokenizer.from_dir(FIXTURES / "tokenizers" / "llama3")
    seen: list[int] = []
    real_decode = ours.decode

    def counting_decode(ids, skip_special_tokens=True):
        seen.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    ours.decode = counting_decode
    ids = ours.encode("The quick brown fox jumps over the lazy dog. " * 40)
    deltas = stream(ours, ids)
    assert "".join(deltas) == real_decode(ids)
    assert len(ids) > 300 and seen == [len(ids)]
    assert sum(1 for d in deltas[:-1] if d) >= len(ids) - 1  # text flows as it comes
    assert deltas[-1] == ""  # nothing was held back at the end of plain text


# -- chat templates -----------------------------------------------------------------------------


def rendered(ref, messages, **kwargs) -> tuple[str, list[int]]:
    text = ref.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ref.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    return text, list(ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", [n for n in NAMES if n != "gpt-oss"])  # gpt-oss: no template
def test_chat_template_matches_transformers(name, add_generation_prompt):
    ours, ref = load(name)
    for messages in CONVERSATIONS:
        text, ids = rendered(ref, messages, add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(messages, add_generation_prompt) == text
        if name != "gguf" or not numbers_after_whitespace(text):
            assert ours.encode(text, add_special_tokens=False) == ids


def test_qwen_template_with_tools_reasoning_and_kwargs():
    ours, ref = load("qwen")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "Météo — 天气 for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need the tool",
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "21 °C.", "thinking": "done"},
        {"role": "user", "content": "thanks"},
    ]
    for kwargs in ({}, {"enable_thinking": False}):
        text, _ = rendered(ref, messages, tools=tools, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(messages, True, tools=tools, **kwargs) == text
        assert "Zürich" in text and "Météo" in text  # tojson keeps non-ASCII


def test_llama3_template_writes_bos_once():
    ours, ref = load("llama3")
    messages = CONVERSATIONS[0]
    text, ids = rendered(ref, messages, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|>")
    assert ours.encode(ours.apply_chat_template(messages), add_special_tokens=False) == ids
    assert ids.count(ours.bos_token_id) == 1


def test_template_helpers():
    tok = Tokenizer.from_dir(FIXTURES / "tokenizers" / "gpt-oss")
    tok.chat_template = (
        "{% generation %}{{ messages[0].content | tojson }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}|{% endfor %}"
        "{{ strftime_now('%Y') | length }}{{ bos_token }}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "é<"}]) == '"é<"|4<|startoftext|>'
    tok.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(Exception, match="no system role"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_no_template_is_an_error():
    tok = Tokenizer.from_dir(FIXTURES / "tokenizers" / "gpt-oss")
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_from_dir_reads_eos_ids_of_generation_config(tmp_path):
    source = FIXTURES / "tokenizers" / "llama3"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [128001, 128009]}')
    (tmp_path / "config.json").write_text('{"eos_token_id": 128008}')
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == {128001, 128008, 128009}
    assert tok.name_or_path == str(tmp_path)


# -- stop strings -------------------------------------------------------------------------------


def feed_all(checker: StopChecker, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for delta in deltas:
        text, hit = checker.feed(delta)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + checker.flush(), False


def test_stop_split_over_deltas_is_held_then_cut():
    checker = StopChecker(["###"])
    assert checker.feed("abc#") == ("abc", False)
    assert checker.feed("#") == ("", False)
    assert checker.feed("#def") == ("", True)
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""


def test_stop_earliest_of_several_wins():
    assert feed_all(StopChecker(["END", "stop"]), ["a stop b E", "ND"]) == ("a ", True)
    assert feed_all(StopChecker(["b", "ab"]), ["xa", "b"]) == ("x", True)


def test_stop_include_stop_str():
    checker = StopChecker(["</answer>"], include_stop_str=True)
    assert feed_all(checker, ["42</ans", "wer> trailing"]) == ("42</answer>", True)


def test_no_stop_then_flush_releases_the_tail():
    checker = StopChecker(["STOP"])
    assert checker.feed("almost ST") == ("almost ", False)
    assert checker.feed("O") == ("", False)
    assert checker.flush() == "STO"


def test_false_start_is_released():
    checker = StopChecker(["aab"])
    assert feed_all(checker, list("aaab")) == ("a", True)
    assert feed_all(StopChecker(["xyz"]), ["ax", "y", "b"]) == ("axyb", False)


def test_empty_stop_string_is_an_error():
    with pytest.raises(ValueError, match="non-empty"):
        StopChecker(["ok", ""])


def test_stop_random_splits():
    rng = random.Random(7)
    for _ in range(500):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 4))) for _ in range(2)]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        # The stop that is complete first wins: the earliest end, then the earliest start.
        found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
        if found:
            _, start, stop = min(found)
            expected = (text[:start], True), (text[: start + len(stop)], True)
        else:
            expected = (text, False), (text, False)
        assert feed_all(StopChecker(stops), deltas) == expected[0], (text, stops, deltas)
        assert feed_all(StopChecker(stops, True), deltas) == expected[1], (text, stops, deltas)


def test_detokenizer_and_stop_checker_together():
    ours, _ = load("qwen")
    ids = ours.encode("Answer: 42 ✅ and then <|im_end|> more text")
    detok, checker = IncrementalDetokenizer(ours, []), StopChecker(["✅"])
    out = []
    for i in ids:
        text, hit = checker.feed(detok.push(i))
        out.append(text)
        if hit:
            break
    assert hit and "".join(out) == "Answer: 42 "


def test_output_cut_inside_a_character_ends_before_it(pair):
    # max_tokens cut "é€" (two and three bytes) after the first byte of "€".
    _, ours, _ = pair
    byte_ids = byte_token_ids(ours)
    cut = [byte_ids[b] for b in "é€".encode()][:3]
    assert "\ufffd" in ours.decode(cut)
    assert "".join(stream(ours, cut)) == "é"
    final = FinalDetokenizer(ours)
    for i in cut:
        final.push(i)
    assert final.flush() == "é"
