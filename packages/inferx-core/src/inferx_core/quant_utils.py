"""Helpers every quant scheme shares: which layers a checkpoint's ignore list leaves
unquantized, and the reference e4m3 quantization of activations."""

from __future__ import annotations

import re

import torch

from inferx_core.interfaces.quant import LinearSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# The smallest dynamic activation scale: a row of zeros (or of denormal-sized values) still
# gets a finite 1/scale. vLLM's per-token kernels use the same floor.
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, clamped to e4m3's range and rounded to nearest (ties to even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dynamic_scale(absmax: torch.Tensor) -> torch.Tensor:
    """An activation scale from an absmax (float32): absmax / 448, at least MIN_SCALE."""
    return (absmax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def quantize_e4m3(
    x: torch.Tensor, granularity: str, group: int = 0, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales): per token [M, 1] ("token"), per token per
    `group` columns [M, ceil(K / group)] ("group"; the last group may be narrower), or the
    static [1, 1] ("static"). The reference of every activation-quantizing kernel."""
    xf = x.float()
    if granularity == "static":
        assert static_scale is not None
        scale = static_scale.float().reshape(1, 1)
    elif granularity == "token":
        scale = dynamic_scale(xf.abs().amax(dim=1, keepdim=True))
    elif granularity == "group":
        groups = [g.abs().amax(dim=1, keepdim=True) for g in xf.split(group, dim=1)]
        scale = dynamic_scale(torch.cat(groups, dim=1))
        wide = scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]
        return quantize_fp8(xf, wide), scale
    else:
        raise ValueError(f"activation quantization {granularity!r}: token, group or static")
    return quantize_fp8(xf, scale), scale


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
