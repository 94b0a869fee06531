"""Published model configs by name, and random-weight checkpoints with their exact shapes.

Presets let tests and benchmarks run real model shapes with no download: DummyFormat serves them
from memory, write_checkpoint() writes them out as a Hugging Face directory.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from inferx_core.interfaces.model import ModelArch
from inferx_models.derived_tokenizers import derivation_for
from inferx_models.preset_configs import PRESETS

# Files of a Hugging Face tokenizer that write_checkpoint copies when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
# Quantized payloads (ModelArch.checkpoint_dtypes) besides the float ones.
_PAYLOAD_DTYPES = {torch.uint8: "U8"}
# MXFP4 scales drawn in 2^-8 .. 2^-6: times e2m1 values (mean magnitude about 2) that keeps
# weights around +-0.02 like the float tensors.
_E8M0_SCALES = (119, 122)


def preset(name: str) -> dict[str, Any]:
    """A copy of the named preset's config."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def arch_class(hf_config: dict[str, Any]) -> type[ModelArch]:
    """The ModelArch registered for the config's architecture (through the plugin registry, so
    other packages' architectures get dummy weights too)."""
    from inferx_core.plugins import plugins

    archs = hf_config.get("architectures") or []
    if not archs:
        raise ValueError("config has no 'architectures' entry naming the model class")
    return cast(type[ModelArch], plugins().get("model_arch", archs[0]))


def random_weights(
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor of the config, one at a time, uniform in +-0.02 (norm weights
    around 1) so activations and logits stay finite; quantized payloads (uint8) random bytes,
    MXFP4 scales ("*_scales") near 2^-7 so their weights are that size too. Same seed, dtype
    and device type, same tensors (a GPU draws other numbers than the CPU: making 6 GB on the
    host takes ~20 s)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    arch = arch_class(hf_config)
    payloads = arch.checkpoint_dtypes(hf_config)
    for name, shape in arch.checkpoint_shapes(hf_config).items():
        if name in payloads:
            if payloads[name] != torch.uint8:
                raise ValueError(f"{name}: no random {payloads[name]} payloads (only uint8)")
            low, high = _E8M0_SCALES if name.endswith("_scales") else (0, 256)
            yield (
                name,
                torch.randint(
                    low, high, shape, generator=generator, dtype=torch.uint8, device=device
                ),
            )
            continue
        # Drawn in the target dtype: a float32 draw of a 7B embedding would double peak memory.
        tensor = torch.empty(shape, dtype=dtype, device=device)
        tensor.uniform_(-0.02, 0.02, generator=generator)
        if name.endswith("norm.weight"):
            tensor += 1.0
        yield name, tensor


def write_checkpoint(
    hf_config_or_preset: dict[str, Any] | str,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    max_shard_bytes: int = 2**31,
) -> Path:
    """Write a Hugging Face checkpoint directory with random weights (those DummyFormat serves
    for the same config, dtype and seed): config.json, model.safetensors or shards with an index,
    and the tokenizer files of tokenizer_dir. One tensor is in memory at a time.

    For a model type with a derived tokenizer (DeepSeek-V2: inferx_models.derived_tokenizers),
    a tokenizer_dir that is not that model's kind (Llama 3's) is cut down to the model's
    vocabulary, with its special tokens and chat template, instead of copied."""
    if isinstance(hf_config_or_preset, str):
        config = preset(hf_config_or_preset)
    else:
        config = copy.deepcopy(hf_config_or_preset)
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype} is not one of {list(_SAFETENSORS_DTYPES)}")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    arch = arch_class(config)
    shapes = arch.checkpoint_shapes(config)
    dtypes = {name: dtype for name in shapes} | arch.checkpoint_dtypes(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtypes[name].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)
        ]
        weight_map = {
            name: file for file, names in zip(files, shards, strict=True) for name in names
        }
        total = sum(math.prod(s) * dtypes[n].itemsize for n, s in shapes.items())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    weights = random_weights(config, dtype, seed)
    for file, names in zip(files, shards, strict=True):
        _write_safetensors(out / file, {n: shapes[n] for n in names}, dtypes, weights)

    if tokenizer_dir is not None:
        derived = derivation_for(config, tokenizer_dir)
        if derived is not None:  # another model's tokenizer, cut down to this one's vocabulary
            derived.write(tokenizer_dir, out, int(config["vocab_size"]))
            return out
        found = [Path(tokenizer_dir) / f for f in TOKENIZER_FILES]
        found = [f for f in found if f.is_file()]
        if not found:
            raise FileNotFoundError(f"{tokenizer_dir} holds none of {', '.join(TOKENIZER_FILES)}")
        for f in found:
            shutil.copyfile(f, out / f.name)
    return out


def _write_safetensors(
    path: Path,
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    tensors: Iterator[tuple[str, torch.Tensor]],
) -> None:
    """Write the safetensors layout (u64 header length, JSON header, raw little-endian data)
    by hand: the header is known from the shapes up front, so each tensor can be written as it
    is drawn and dropped, where safetensors.torch.save_file needs the whole shard in memory."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        dtype = dtypes[name]
        nbytes = math.prod(shape) * dtype.itemsize
        code = _SAFETENSORS_DTYPES.get(dtype) or _PAYLOAD_DTYPES[dtype]
        entry = {"dtype": code, "shape": list(shape)}
        header[name] = entry | {"data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for expected in shapes:
            name, tensor = next(tensors)
            assert name == expected, f"weights out of order: {name} where {expected} belongs"
            assert tensor.dtype == dtypes[name], f"{name} is {tensor.dtype}, not {dtypes[name]}"
            f.write(tensor.contiguous().view(torch.uint8).numpy())
