"""Mixture-of-experts in plain torch: the routing function, the unquantized experts method and
the FusedMoE layer a model names (router + experts + optional shared experts). The reference
every faster MoE kernel is tested against; it runs on the CPU."""

from __future__ import annotations

import torch

from inferx_core.interfaces.moe import RouterSpec


def route(
    logits: torch.Tensor, spec: RouterSpec, selection_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""
    logits = logits.float()
    k = spec.top_k
    if spec.softmax_after_topk:
        values, ids = logits.topk(k, dim=-1)
        weights = values.softmax(dim=-1)
    else:
        scores = logits.softmax(dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
        pick = scores if selection_bias is None else scores + selection_bias.float()
        if spec.num_groups > 1:
            t = pick.shape[0]
            grouped = pick.view(t, spec.num_groups, -1)
            if spec.group_score == "max":
                group_scores = grouped.max(dim=-1).values
            else:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = group_scores.topk(spec.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            pick = pick.masked_fill(~mask.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf)
        ids = pick.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.scaling != 1.0:
        weights = weights * spec.scaling
    return weights, ids
