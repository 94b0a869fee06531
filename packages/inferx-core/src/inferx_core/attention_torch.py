"""Paged attention in plain torch: the reference every faster backend is tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferx_core.interfaces.attention import AttentionBackend, AttentionBatch, AttentionLayer
from inferx_core.interfaces.kv import KVLayerSpec


@dataclass
class _Seq:
    """Where one sequence's queries and gathered context sit in the step's flat tensors."""

    q_start: int
    q_end: int
    ctx_start: int
    ctx_end: int
    mask: torch.Tensor | None  # [q, ctx] bool, True = may attend
    causal: bool  # the queries are the whole context: SDPA's own causal mask is the right one


class TorchAttention(AttentionBackend):
    """Gathers each sequence's context from the paged cache and runs SDPA on it, one sequence at
    a time.

    Cache layout, one tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim], K at
    index 0 and V at index 1, so that each of K and V flattens to [slots, heads, dim] as a view and
    a slot (block_id * block_size + offset) indexes it directly.
    """

    name = "torch attention"  # in error messages

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
        self._seqs: list[_Seq] = []
        self._slots = torch.empty(0, dtype=torch.int64, device=device)
        self._slot_mapping = torch.empty(0, dtype=torch.int64, device=device)

    def bytes_per_block(self) -> int:
        per_token = sum(2 * s.num_kv_heads * s.head_dim for s in self.layers)
        return per_token * self.block_size * self.dtype.itemsize

    def allocate(self, num_blocks: int) -> None:
        self.caches = []
        for s in self.layers:
            shape = (2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim)
            self.caches.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def begin_step(self, batch: AttentionBatch) -> None:
        # The slots of every sequence's whole context, concatenated in batch order: each layer
        # gathers them with one index_select instead of one per sequence.
        self._slot_mapping = batch.slot_mapping.to(self.device, torch.int64)
        bs = self.block_size
        num_seqs, width = batch.block_table.shape
        offsets = torch.arange(bs, device=self.device)
        slots = (batch.block_table.to(self.device, torch.int64)[:, :, None] * bs + offsets).reshape(
            num_seqs, width * bs
        )
        positions = torch.arange(width * bs, device=self.device)
        context_len = batch.context_len.to(self.device, torch.int64)
        self._slots = slots[positions[None, :] < context_len[:, None]]

        self._seqs = []
        q_start = ctx_start = 0
        for q, c in zip(batch.query_lens, batch.context_lens, strict=True):
            # A decode query sees every key; a fresh prompt is plain causal (and a mask of its
            # size could be large); a chunk over a cached prefix needs its offset spelled out:
            # query i is at position c - q + i and sees keys at positions up to that.
            mask = None
            if 1 < q < c:
                key_pos = torch.arange(c, device=self.device)
                query_pos = torch.arange(c - q, c, device=self.device)
                mask = key_pos[None, :] <= query_pos[:, None]
            causal = 1 < q == c
            self._seqs.append(_Seq(q_start, q_start + q, ctx_start, ctx_start + c, mask, causal))
            q_start += q
            ctx_start += c

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        scale = layer.scale
        cache = self.caches[layer.index]
        heads, dim = cache.shape[-2:]
        k_flat = cache[0].view(-1, heads, dim)
        v_flat = cache[1].view(-1, heads, dim)
        # Write first: the step's own tokens are part of the context the queries attend to.
        k_flat.index_copy_(0, self._slot_mapping, k.to(cache.dtype))
        v_flat.index_copy_(0, self._slot_mapping, v.to(cache.dtype))
        keys = k_flat.index_select(0, self._slots).to(q.dtype)
        values = v_flat.index_select(0, self._slots).to(q.dtype)

        out = q.new_empty(q.shape[0], q.shape[1], dim)
        gqa = q.shape[1] != heads
        group = q.shape[1] // heads
        for s in self._seqs:
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
