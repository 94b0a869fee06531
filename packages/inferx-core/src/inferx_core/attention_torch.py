"""Paged attention in plain torch: the reference every faster backend is tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferx_core.interfaces.attention import (
    AttentionBackend,
    AttentionBatch,
    AttentionLayer,
    MLAWeights,
)
from inferx_core.interfaces.kv import KVLayerSpec

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


@dataclass
class _Seq:
    """Where one sequence's queries and gathered context sit in the step's flat tensors."""

    q_start: int
    q_end: int
    ctx_start: int
    ctx_end: int
    mask: torch.Tensor | None  # [q, ctx] bool, True = may attend
    causal: bool  # the queries are the whole context: SDPA's own causal mask is the right one


@dataclass
class _GroupStep:
    """One KV group's part of the step: where new tokens go and which slots each layer reads."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    slots: torch.Tensor  # every sequence's visible context slots, in batch order
    seqs: list[_Seq]


class TorchAttention(AttentionBackend):
    """Gathers each sequence's context from the paged cache and runs SDPA on it, one sequence at
    a time.

    Cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], K at
    index 0 and V at index 1, so that each of K and V flattens to [slots, heads, dim] as a view and
    a slot (block_id * block_size + offset) indexes it directly. With several KV groups the i-th
    layers of the groups share one tensor where their shapes match: the groups draw blocks from
    one pool, so their layers never use a block id at the same time.

    An fp8_e4m3 layer stores k / k_scale and v / v_scale in e4m3 (clamped to +-448, rounded
    to nearest) and multiplies them back as it reads them (AttentionLayer.k_scale / v_scale;
    1.0 where the model gives none).

    Sliding layers gather only the context inside their window (a query at position p sees keys
    in (p - window, p], as transformers' sliding_window_overlay); layers with learned sinks or a
    softcap take a plain, slower path (_attend).

    MLA layers keep one row a token, [num_blocks, block_size, 1, kv_lora_rank + rope_dim]
    (latent then rope key; no V plane). A sequence's prompt chunk attends in the plain form
    (mla_plain: its context's latents expanded to per-head keys and values), a decode query in
    the absorbed form (mla_absorbed: over the latents themselves); `absorbed_decode` False
    runs decodes in the plain form too. An fp8_e4m3 MLA layer stores the whole row (latent
    and rope key) / k_scale, one scale (the latent is the value too; v_scale is unused).
    """

    name = "torch attention"  # in error messages
    features = frozenset({"sliding", "sinks", "softcap", "mla", "fp8_kv"})
    supports_kv_groups = True
    absorbed_decode = True

    def __init__(
        self,
        layers: list[KVLayerSpec],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__(layers, block_size, dtype, device)
        # Subclasses share the cache layout, so they share these limits (under their own name).
        name = self.name
        for i, spec in enumerate(layers):
            if spec.kind == "mla":
                if spec.num_kv_heads != 1 or not spec.v_head_dim or not spec.rope_dim:
                    raise ValueError(
                        f"layer {i}: an MLA layer has one KV head of kv_lora_rank + rope_dim "
                        f"(v_head_dim = kv_lora_rank, rope_dim set), not {spec}"
                    )
                if spec.v_head_dim + spec.rope_dim != spec.head_dim:
                    raise ValueError(
                        f"layer {i}: MLA head_dim {spec.head_dim} is not kv_lora_rank "
                        f"{spec.v_head_dim} + rope_dim {spec.rope_dim}"
                    )
                continue
            if spec.v_head_dim not in (None, spec.head_dim):
                raise NotImplementedError(
                    f"{name} needs v_head_dim == head_dim; layer {i} has "
                    f"{spec.v_head_dim} and {spec.head_dim}"
                )
            if spec.num_q_heads % spec.num_kv_heads:
                raise ValueError(
                    f"layer {i}: num_q_heads {spec.num_q_heads} is not a multiple of "
                    f"num_kv_heads {spec.num_kv_heads}"
                )
        self.caches: list[torch.Tensor] = []
        empty = torch.empty(0, dtype=torch.int64, device=device)
        self._steps: list[_GroupStep] = [_GroupStep(empty, empty, [])]
        # Each layer's cache tensor: (its rank in its group, its planes (K and V, or one MLA
        # latent), its shape, its dtype) names it.
        rank = {i: k for g in self.groups for k, i in enumerate(g.layers)}
        self._cache_keys = [
            (rank[i], 1 if s.kind == "mla" else 2, s.num_kv_heads, s.head_dim, self.cache_dtype(s))
            for i, s in enumerate(layers)
        ]

    def cache_dtype(self, spec: KVLayerSpec) -> torch.dtype:
        return FP8 if spec.dtype == "fp8_e4m3" else self.dtype

    def bytes_per_block(self) -> int:
        per_token = sum(p * h * d * dt.itemsize for _, p, h, d, dt in set(self._cache_keys))
        return per_token * self.block_size

    def allocate(self, num_blocks: int) -> None:
        self.caches = []
        made: dict[tuple, torch.Tensor] = {}
        for key in self._cache_keys:
            if key not in made:
                _, planes, heads, dim, dtype = key
                shape = (num_blocks, self.block_size, heads, dim)
                if planes == 2:
                    shape = (2, *shape)
                made[key] = torch.zeros(shape, dtype=dtype, device=self.device)
            self.caches.append(made[key])

    def begin_step(self, batch: AttentionBatch) -> None:
        tables = batch.group_block_tables or [batch.block_table]
        mappings = batch.group_slot_mappings or [batch.slot_mapping]
        steps = []
        for g in self.groups:
            i = g.index if len(tables) > 1 else 0
            window = g.window if g.kind == "sliding" else None
            steps.append(self._group_step(batch, tables[i], mappings[i], window))
        self._steps = steps

    def _group_step(
        self,
        batch: AttentionBatch,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        window: int | None,
    ) -> _GroupStep:
        # The slots of every sequence's visible context, concatenated in batch order: each layer
        # gathers them with one index_select instead of one per sequence.
        device = self.device
        bs = self.block_size
        num_seqs, width = block_table.shape
        offsets = torch.arange(bs, device=device)
        slots = (block_table.to(device, torch.int64)[:, :, None] * bs + offsets).reshape(
            num_seqs, width * bs
        )
        positions = torch.arange(width * bs, device=device)
        context_len = batch.context_len.to(device, torch.int64)
        visible = positions[None, :] < context_len[:, None]
        # A sliding layer's earliest visible key: the first query's position - window + 1.
        firsts = [0] * num_seqs
        if window is not None:
            firsts = [
                max(0, c - q - window + 1)
                for q, c in zip(batch.query_lens, batch.context_lens, strict=True)
            ]
            first = torch.tensor(firsts, dtype=torch.int64, device=device)
            visible &= positions[None, :] >= first[:, None]

        seqs = []
        q_start = ctx_start = 0
        for q, c, lo in zip(batch.query_lens, batch.context_lens, firsts, strict=True):
            # A decode query sees every gathered key; a fresh prompt within the window is plain
            # causal (and a mask of its size could be large); a chunk over a cached prefix or
            # past the window needs its mask spelled out: query i is at position c - q + i and
            # sees keys up to that (and, sliding, after that - window).
            mask = None
            causal = 1 < q == c and (window is None or q <= window)
            if q > 1 and not causal:
                key_pos = torch.arange(lo, c, device=device)
                query_pos = torch.arange(c - q, c, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
                if window is not None:
                    mask &= key_pos[None, :] > query_pos[:, None] - window
            seqs.append(_Seq(q_start, q_start + q, ctx_start, ctx_start + c - lo, mask, causal))
            q_start += q
            ctx_start += c - lo
        return _GroupStep(slot_mapping.to(device, torch.int64), slots[visible], seqs)

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if layer.mla is not None:
            return self._forward_mla(layer, q, k)
        scale = layer.scale
        step = self._steps[layer.group]
        cache = self.caches[layer.index]
        heads, dim = cache.shape[-2:]
        k_flat = cache[0].view(-1, heads, dim)
        v_flat = cache[1].view(-1, heads, dim)
        # Write first: the step's own tokens are part of the context the queries attend to.
        if cache.dtype == FP8:  # moved as bytes: torch's index ops take no float8 on the CPU
            kb, vb = k_flat.view(torch.uint8), v_flat.view(torch.uint8)
            kb.index_copy_(0, step.slot_mapping, to_fp8(k, layer.k_scale).view(torch.uint8))
            vb.index_copy_(0, step.slot_mapping, to_fp8(v, layer.v_scale).view(torch.uint8))
            keys = from_fp8(kb.index_select(0, step.slots).view(FP8), layer.k_scale, q.dtype)
            values = from_fp8(vb.index_select(0, step.slots).view(FP8), layer.v_scale, q.dtype)
        else:
            k_flat.index_copy_(0, step.slot_mapping, k.to(cache.dtype))
            v_flat.index_copy_(0, step.slot_mapping, v.to(cache.dtype))
            keys = k_flat.index_select(0, step.slots).to(q.dtype)
            values = v_flat.index_select(0, step.slots).to(q.dtype)

        out = q.new_empty(q.shape[0], q.shape[1], dim)
        gqa = q.shape[1] != heads
        group = q.shape[1] // heads
        plain = layer.sinks is None and not layer.spec.softcap
        for s in step.seqs:
            if not plain:
                out[s.q_start : s.q_end] = _attend(
                    q[s.q_start : s.q_end],
                    keys[s.ctx_start : s.ctx_end],
                    values[s.ctx_start : s.ctx_end],
                    s,
                    layer,
                )
                continue
            if s.q_end - s.q_start == 1:
                # Decode: two small batched matmuls over [kv head, group, ...] cost half of what
                # SDPA's set-up does at one query (measured on the CPU), same result to 1e-7.
                ks = keys[s.ctx_start : s.ctx_end].permute(1, 2, 0)  # [H, D, C]
                vs = values[s.ctx_start : s.ctx_end].transpose(0, 1)  # [H, C, D]
                scores = torch.bmm(q[s.q_start].view(heads, group, dim), ks) * scale
                probs = scores.softmax(-1, dtype=torch.float32).to(vs.dtype)
                out[s.q_start] = torch.bmm(probs, vs).view(-1, dim)
                continue
            # SDPA wants [heads, len, dim].
            o = F.scaled_dot_product_attention(
                q[s.q_start : s.q_end].transpose(0, 1),
                keys[s.ctx_start : s.ctx_end].transpose(0, 1),
                values[s.ctx_start : s.ctx_end].transpose(0, 1),
                attn_mask=s.mask,
                is_causal=s.causal,
                scale=scale,
                enable_gqa=gqa,
            )
            out[s.q_start : s.q_end] = o.transpose(0, 1)
        return out

    def _forward_mla(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        mla = layer.mla
        assert mla is not None
        step = self._steps[layer.group]
        cache = self.caches[layer.index]
        flat = cache.view(-1, cache.shape[-1])
        if cache.dtype == FP8:  # moved as bytes, as forward() does
            fb = flat.view(torch.uint8)
            fb.index_copy_(0, step.slot_mapping, to_fp8(k[:, 0], layer.k_scale).view(torch.uint8))
            context = from_fp8(fb.index_select(0, step.slots).view(FP8), layer.k_scale, q.dtype)
        else:
            flat.index_copy_(0, step.slot_mapping, k[:, 0].to(cache.dtype))
            context = flat.index_select(0, step.slots).to(q.dtype)
        out = q.new_empty(q.shape[0], q.shape[1], mla.v_head_dim)
        for s in step.seqs:
            rows = slice(s.q_start, s.q_end)
            ctx = context[s.ctx_start : s.ctx_end]
            if s.q_end - s.q_start == 1 and self.absorbed_decode:
                out[rows] = mla_absorbed(q[rows], ctx, mla, layer.scale)
            else:
                out[rows] = mla_plain(q[rows], ctx, mla, layer.scale, s.mask, s.causal)
        return out


def mla_plain(
    q: torch.Tensor,
    context: torch.Tensor,
    mla: MLAWeights,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """One sequence's MLA in the plain form: q [Q, H, nope + rope] against its context's
    cache rows [C, rank + rope], the latents expanded through kv_b_proj (mla.expand) to
    per-head keys (nope key, then the shared rope key) and values -> [Q, H, v_head_dim].
    mask [Q, C] (True: may attend) or causal (Q == C) as SDPA takes them."""
    heads, nope = q.shape[1], mla.qk_nope_head_dim
    rank = context.shape[-1] - (q.shape[-1] - nope)  # the cache row less the rope key
    kv = mla.expand(context[:, :rank])  # [C, H, nope + v]
    k_pe = context[:, None, rank:].expand(-1, heads, -1)
    keys = torch.cat([kv[..., :nope], k_pe], dim=-1)
    values = kv[..., nope:]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
    )
    return o.transpose(0, 1)


def mla_absorbed(
    q: torch.Tensor, context: torch.Tensor, mla: MLAWeights, scale: float
) -> torch.Tensor:
    """MLA queries that see a sequence's whole context (decode) in the absorbed form: W_UK
    folded into the query, attention over the cache rows [C, rank + rope] as one KV head
    (scores over all rank + rope columns, values the rank latent columns), W_UV applied to
    the latent-space output. q [Q, H, nope + rope] -> [Q, H, v_head_dim]."""
    assert mla.w_uk is not None and mla.w_uv is not None, "MLA weights not loaded"
    nope = mla.qk_nope_head_dim
    rank = context.shape[-1] - (q.shape[-1] - nope)
    q_lat = torch.einsum("qhn,hnr->qhr", q[..., :nope], mla.w_uk.to(q.dtype))
    q_full = torch.cat([q_lat, q[..., nope:]], dim=-1)  # [Q, H, rank + rope]
    scores = torch.einsum("qhd,cd->qhc", q_full, context) * scale
    probs = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    o_lat = torch.einsum("qhc,cr->qhr", probs.to(context.dtype), context[:, :rank])
    return torch.einsum("qhr,hvr->qhv", o_lat, mla.w_uv.to(q.dtype))


def to_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale in float32, clamped to e4m3's range, rounded to nearest e4m3."""
    x = x.float() if scale is None else x.float() / scale.float()
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_fp8(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    x = x.float() if scale is None else x.float() * scale.float()
    return x.to(dtype)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: _Seq, layer: AttentionLayer
) -> torch.Tensor:
    """One sequence's attention with a softcap and/or learned sinks, in at least float32:
    q [Q, Hq, D], keys / values [C, Hkv, D] -> [Q, Hq, D]."""
    acc = torch.promote_types(q.dtype, torch.float32)
    group = q.shape[1] // keys.shape[1]
    k = keys.to(acc).repeat_interleave(group, dim=1)
    v = values.to(acc).repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k) * layer.scale
    cap = layer.spec.softcap
    if cap:
        scores = cap * torch.tanh(scores / cap)
    mask = s.mask
    if s.causal:
        n = q.shape[0]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if layer.sinks is not None:
        # The sink is one more logit per head in the softmax, with no value: drop its column.
        sink = layer.sinks.to(acc)[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
