"""The DeepSeek-V2 tokenizer derived from Llama 3's (inferx_models.derived_tokenizers): ids in
DeepSeek's range, exact round trips, Llama 3's own tokens where they fit, the special tokens at
DeepSeek's ids, DeepSeek-V2's chat format; `inferx checkpoint` writes it for DeepSeek presets
and the model serves prompts made with it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import FIXTURES

from inferx_core.cli import main
from inferx_core.tokenizer import Tokenizer
from inferx_models.derived_tokenizers import (
    DEEPSEEK_BOS,
    DEEPSEEK_EOS,
    DEEPSEEK_V2,
    truncate_bpe,
)
from inferx_models.presets import preset, write_checkpoint

LLAMA3 = FIXTURES / "tokenizers" / "llama3"
VOCAB = 102_400  # DeepSeek-V2's vocab_size
BOS, EOS = 100_000, 100_001

# Published DeepSeek-V2(-Lite)-Chat tokenizer_config.json's chat format, written out by hand:
# "{bos}{system}\n\nUser: {user}\n\nAssistant: {reply}{eos}User: ...\n\nAssistant:".
CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]
RENDERED = (
    f"{DEEPSEEK_BOS}Answer briefly.\n\nUser: What is 2 + 2?\n\nAssistant: 4.{DEEPSEEK_EOS}"
    "User: And 3 + 3?\n\nAssistant:"
)


@pytest.fixture(scope="module")
def derived(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return DEEPSEEK_V2.write(LLAMA3, tmp_path_factory.mktemp("dsv2"), VOCAB)


def random_text(rng: random.Random, n: int) -> str:
    """Words, digits, punctuation, whitespace runs, accents, CJK, emoji and other code points."""
    pools = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789",
        " \t\n\r  ",
        ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
        "éèàüößçñøåæœ",
        "你好世界中文字符测试",
        "🤖🚀✨🎉",
    ]
    out = []
    for _ in range(n):
        pool = rng.choice(pools)
        out.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        if rng.random() < 0.05:
            code = rng.randint(0x80, 0x2FFFF)
            if not 0xD800 <= code < 0xE000:  # surrogates are no text
                out.append(chr(code))
    return "".join(out)


def test_round_trip_and_ids_in_range(derived: Path) -> None:
    tok = Tokenizer.from_dir(derived)
    assert tok.vocab_size == BOS + 2 <= VOCAB
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for _ in range(50):
        text = random_text(rng, 40)
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < BOS for i in ids), f"seed {seed}"  # BPE ids only, below the specials
        assert tok.decode(ids) == text, f"seed {seed}: {text!r}"
        assert tok.encode(text) == [BOS, *ids]  # add_bos_token, as DeepSeek's config says


def test_llama3_tokens_where_they_fit(derived: Path) -> None:
    """A cut at a merge rank leaves every merge below it: text whose Llama 3 tokens all lie
    below the bound encodes to exactly those tokens."""
    ours, llama = Tokenizer.from_dir(derived), Tokenizer.from_dir(LLAMA3)
    text = (
        "The quick brown fox jumps over the lazy dog. Prefill chunks of 8192 tokens run as one "
        "step; decode replays CUDA graphs.\n\n    def f(x):\n        return x ** 2\n"
    )
    reference = llama.encode(text, add_special_tokens=False)
    assert max(reference) < BOS
    assert ours.encode(text, add_special_tokens=False) == reference
    # A text with Llama 3 tokens past the bound takes shorter ones, all below it.
    rare = " ".join(llama.decode([i]) for i in range(120_000, 120_040))
    assert max(llama.encode(rare, add_special_tokens=False)) >= BOS
    ids = ours.encode(rare, add_special_tokens=False)
    assert max(ids) < BOS and ours.decode(ids) == rare


def test_special_tokens_at_deepseek_ids(derived: Path) -> None:
    tok = Tokenizer.from_dir(derived)
    assert (tok.bos_token, tok.eos_token) == (DEEPSEEK_BOS, DEEPSEEK_EOS)
    assert tok.bos_token_id == BOS and tok.eos_token_ids == {EOS}
    assert tok.backend.token_to_id(DEEPSEEK_BOS) == BOS
    assert tok.backend.token_to_id(DEEPSEEK_EOS) == EOS
    ids = tok.encode(f"hi{DEEPSEEK_EOS}there", add_special_tokens=False)
    assert EOS in ids and ids.count(EOS) == 1  # one token, not its characters
    assert tok.decode(ids) == "hithere"  # skipped as special
    assert tok.decode(ids, skip_special_tokens=False) == f"hi{DEEPSEEK_EOS}there"
    assert tok.config["pad_token"]["content"] == DEEPSEEK_EOS and tok.config["add_bos_token"]


def test_chat_template_renders_deepseek_v2_format(derived: Path) -> None:
    tok = Tokenizer.from_dir(derived)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True) == RENDERED
    no_prompt = tok.apply_chat_template(CHAT[:3], add_generation_prompt=False)
    assert no_prompt == RENDERED.split("User: And")[0]
    ids = tok.encode(RENDERED, add_special_tokens=False)
    assert ids[0] == BOS and ids.count(BOS) == 1 and ids.count(EOS) == 1


def test_transformers_reads_it_the_same(derived: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(derived))
    tok = Tokenizer.from_dir(derived)
    rng = random.Random()
    for _ in range(10):
        text = random_text(rng, 30)
        assert ref(text)["input_ids"] == tok.encode(text)
    rendered = ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert rendered == RENDERED
    assert (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id) == (BOS, EOS, EOS)


def test_truncate_refuses_what_it_cannot_cut() -> None:
    doc = json.loads((LLAMA3 / "tokenizer.json").read_text(encoding="utf-8"))
    cut = truncate_bpe(doc, 1000)
    assert len(cut["model"]["vocab"]) == 1000 and cut["added_tokens"] == []
    assert len(doc["model"]["vocab"]) == 128_000  # the source is left as it was
    with pytest.raises(ValueError, match="byte-level"):
        truncate_bpe(doc | {"decoder": {"type": "Metaspace"}}, 1000)
    with pytest.raises(ValueError, match="a BPE tokenizer is needed"):
        truncate_bpe(doc | {"model": {"type": "Unigram"}}, 1000)
    merges = list(reversed(doc["model"]["merges"][:500]))
    with pytest.raises(ValueError, match="not in the order"):
        truncate_bpe(doc | {"model": doc["model"] | {"merges": merges}}, 1000)


def test_checkpoint_derives_it_for_deepseek_presets(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ckpt"
    argv = ["checkpoint", "--preset", "tiny-deepseek-v2-lite-vocab", "--tokenizer", str(LLAMA3),
            "--dtype", "float32", str(out)]  # fmt: skip
    assert main(argv) == 0
    tok = Tokenizer.from_dir(out)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB
    assert tok.bos_token_id == BOS and tok.vocab_size <= VOCAB
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True) == RENDERED
    # A DeepSeek tokenizer (the model's own, or this one) is copied as it is.
    again = write_checkpoint(
        "tiny-deepseek-v2-lite-vocab", tmp_path / "again", tokenizer_dir=out, seed=1
    )
    assert (again / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()
    # Other models' checkpoints still get the tokenizer copied.
    other = write_checkpoint("tiny-llama", tmp_path / "llama", tokenizer_dir=LLAMA3)
    assert (other / "tokenizer.json").read_bytes() == (LLAMA3 / "tokenizer.json").read_bytes()
    capsys.readouterr()
    # The tiny test preset's 320 ids cannot hold DeepSeek's special ids: refused, by name.
    small = ["checkpoint", "--preset", "tiny-deepseek-v2-lite", "--tokenizer", str(LLAMA3),
             str(tmp_path / "small")]  # fmt: skip
    assert main(small) == 2
    assert "past this model's vocab_size 320" in capsys.readouterr().err


def test_the_model_serves_its_prompts(derived: Path) -> None:
    """The tiny V2-Lite with DeepSeek's vocabulary, on the CPU, takes a chat prompt made with
    the derived tokenizer and streams text back."""
    from inferx_core.config import load_config
    from inferx_core.engine import LLM
    from inferx_core.sequence import SamplingParams

    assert preset("tiny-deepseek-v2-lite-vocab")["vocab_size"] == VOCAB
    overrides = {
        "model.preset": "tiny-deepseek-v2-lite-vocab",
        "model.tokenizer": str(derived),
        "model.dtype": "float32",
        "engine.device": "cpu",
        "kv_cache.memory": "64MiB",
    }
    llm = LLM(load_config(None, overrides))
    prompt = llm.chat_prompt(CHAT)
    assert prompt == Tokenizer.from_dir(derived).encode(RENDERED, add_special_tokens=False)
    done = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert len(done.token_ids) == 8 and all(0 <= t < VOCAB for t in done.token_ids)
    assert isinstance(done.text, str)
