"""Helpers every quant scheme shares: which layers a checkpoint's ignore list leaves unquantized."""

from __future__ import annotations

import re

from inferx_core.interfaces.quant import LinearSpec


def _matches(name: str, ignore: list[str]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], name):
                return True
        elif entry == name:
            return True
    return False


def is_ignored(spec: LinearSpec, ignore: list[str]) -> bool:
    """Whether the checkpoint left this layer unquantized, by the ignore-list convention of
    Hugging Face, compressed-tensors and vLLM: an entry is a layer's checkpoint name, or
    "re:<regex>" matching the whole name. A fused layer matches by its own prefix, or by the
    checkpoint names of its parts (prefix's parent + each of spec.part_names) when all of them
    match; only some of them is an error: one method cannot hold quantized and unquantized
    rows."""
    if _matches(spec.prefix, ignore):
        return True
    if not spec.part_names:
        return False
    parent = spec.prefix.rpartition(".")[0]
    names = [f"{parent}.{p}" if parent else p for p in spec.part_names]
    hits = [_matches(n, ignore) for n in names]
    if all(hits):
        return True
    if any(hits):
        left = [n for n, hit in zip(names, hits, strict=True) if hit]
        raise ValueError(
            f"{spec.prefix}: the checkpoint leaves {', '.join(left)} unquantized but not the "
            "other parts of the fused layer"
        )
    return False
