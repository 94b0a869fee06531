"""Tokenizers derived from another model's, for presets whose own tokenizer is not at hand.

A byte-level BPE tokenizer whose ids follow its merge order (Llama 3's, gpt-oss's: a token's id
is its merge rank) stays a valid tokenizer when cut at an id: keep the tokens below the bound
and the merges whose parts and result all lie below it. Every byte is still a token (the first
256 ids), so any text encodes and decodes back exactly. Add the model's special tokens at its
ids and its chat template, and a random-weight checkpoint or a benchmark gets prompts with the
model's id range, special ids and chat format. The token boundaries are the source's, not the
model's: the token count of a text differs from what the model's own tokenizer gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"

# DeepSeek-V2's chat format (the V2 and V2-Lite chat checkpoints' tokenizer_config.json): BOS,
# then system text + blank line, "User: " turns + blank line, "Assistant: " turns closed by EOS,
# and "Assistant:" (no space) as the generation prompt.
DEEPSEEK_V2_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@dataclass(frozen=True)
class DerivedTokenizer:
    """What to make of a source tokenizer: its BPE ids below `bpe_size`, the special tokens at
    their ids (BOS is prepended to every encoded text, as the model's add_bos_token says) and
    tokenizer_config.json's chat template."""

    name: str
    bpe_size: int
    special: dict[str, int]
    bos_token: str
    eos_token: str
    chat_template: str

    def needed(self, source_dir: str | Path) -> bool:
        """Whether the source must be cut down: it is not already this model's tokenizer (one
        that holds the BOS token at its id, the model's own or one derived before) and has a
        tokenizer.json to cut."""
        path = Path(source_dir) / "tokenizer.json"
        if not path.is_file():
            return False
        doc = json.loads(path.read_text(encoding="utf-8"))
        added = {t["content"]: t["id"] for t in doc.get("added_tokens", [])}
        return added.get(self.bos_token) != self.special[self.bos_token]

    def write(self, source_dir: str | Path, out_dir: str | Path, vocab_size: int) -> Path:
        """Write tokenizer.json and tokenizer_config.json derived from source_dir's
        tokenizer.json into out_dir, for a model of `vocab_size` ids."""
        high = max(self.special.values())
        if high >= vocab_size:
            raise ValueError(
                f"the {self.name} tokenizer's special ids reach {high}, past this model's "
                f"vocab_size {vocab_size}: derive it for a config with the model's own "
                "vocabulary (the tiny test presets have 320 ids)"
            )
        source = Path(source_dir) / "tokenizer.json"
        doc = truncate_bpe(json.loads(source.read_text(encoding="utf-8")), self.bpe_size)
        taken = doc["model"]["vocab"]
        clash = [t for t in self.special if t in taken]
        if clash:
            raise ValueError(f"{source}: its BPE vocabulary already holds {clash}")
        doc["added_tokens"] = [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t, i in sorted(self.special.items(), key=lambda item: item[1])
        ]
        bos_id = self.special[self.bos_token]

        def piece(kind: str, name: str, type_id: int) -> dict[str, Any]:
            return {kind: {"id": name, "type_id": type_id}}

        bos = self.bos_token
        prepend_bos = {
            "type": "TemplateProcessing",
            "single": [piece("SpecialToken", bos, 0), piece("Sequence", "A", 0)],
            "pair": [
                piece("SpecialToken", bos, 0),
                piece("Sequence", "A", 0),
                piece("SpecialToken", bos, 1),
                piece("Sequence", "B", 1),
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
        processors = [doc["post_processor"]] if doc.get("post_processor") else []
        doc["post_processor"] = {"type": "Sequence", "processors": [*processors, prepend_bos]}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
        (out / "tokenizer_config.json").write_text(
            json.dumps(self.tokenizer_config(), indent=2, ensure_ascii=False) + "\n",
            encoding="utf-8",
        )
        return out

    def tokenizer_config(self) -> dict[str, Any]:
        def token(text: str) -> dict[str, Any]:
            return {"__type": "AddedToken", "content": text, "lstrip": False,
                    "normalized": False, "rstrip": False, "single_word": False}  # fmt: skip

        decoder = {
            str(i): {k: v for k, v in token(t).items() if k != "__type"} | {"special": True}
            for t, i in self.special.items()
        }
        return {
            "add_bos_token": True,
            "add_eos_token": False,
            "added_tokens_decoder": decoder,
            "bos_token": token(self.bos_token),
            "eos_token": token(self.eos_token),
            "pad_token": token(self.eos_token),
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            # tokenizer.json as written: transformers 5 takes the model's own class,
            # LlamaTokenizerFast, for a SentencePiece-style pipeline.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": self.chat_template,
        }


DEEPSEEK_V2 = DerivedTokenizer(
    name="deepseek-v2",
    bpe_size=100_000,  # DeepSeek-V2's own BPE ids are 0..99,999, its special tokens from 100,000
    special={DEEPSEEK_BOS: 100_000, DEEPSEEK_EOS: 100_001},
    bos_token=DEEPSEEK_BOS,
    eos_token=DEEPSEEK_EOS,
    chat_template=DEEPSEEK_V2_CHAT_TEMPLATE,
)

# model_type of the config -> the tokenizer to derive for it.
BY_MODEL_TYPE: dict[str, DerivedTokenizer] = {"deepseek_v2": DEEPSEEK_V2}


def derivation_for(hf_config: dict[str, Any], source_dir: str | Path) -> DerivedTokenizer | None:
    """The tokenizer to derive from source_dir for a model of this config, or None when the
    source serves as it is (no derivation known for the model type, or the source is already
    the model's kind)."""
    spec = BY_MODEL_TYPE.get(str(hf_config.get("model_type")))
    return spec if spec is not None and spec.needed(source_dir) else None


def truncate_bpe(doc: dict[str, Any], bound: int) -> dict[str, Any]:
    """A copy of a tokenizer.json document whose BPE model keeps the ids below `bound` and the
    merges among them, without its added tokens. Refuses a source that is not byte-level BPE,
    whose kept ids are not 0..bound-1 starting with the 256 byte symbols, or whose merges do
    not make tokens in id order."""
    model = doc.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"a BPE tokenizer is needed, not {model.get('type')!r}")
    if (doc.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError("a byte-level BPE tokenizer is needed (its decoder is not ByteLevel)")
    vocab = {t: i for t, i in model["vocab"].items() if i < bound}
    if sorted(vocab.values()) != list(range(bound)):
        raise ValueError(f"the source's ids below {bound} are not all BPE tokens")
    if not all(len(t) == 1 for t, i in vocab.items() if i < 256):
        raise ValueError("the source's first 256 ids are not its byte symbols")
    merges, last = [], -1
    for merge in model["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        made = vocab.get(left + right)
        if made is not None and left in vocab and right in vocab:
            if made < last:  # then cutting at an id would not cut at a merge rank
                raise ValueError("the source's merges are not in the order of their tokens' ids")
            merges.append(merge)
            last = made
    out = dict(doc)
    out["model"] = dict(model) | {"vocab": vocab, "merges": merges}
    out["added_tokens"] = []
    return out
