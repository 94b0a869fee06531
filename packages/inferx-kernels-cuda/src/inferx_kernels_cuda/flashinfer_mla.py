"""MLA layers (DeepSeek-V2) in the `flashinfer` backend: decodes through FlashInfer's
BatchMLAPagedAttentionWrapper in the absorbed form, over the latent cache's own rows, in CUDA
graphs too; prompt rows in the plain form through the Triton MLA prefill."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from inferx_core.batch import to_device
from inferx_core.interfaces.attention import AttentionBatch, AttentionLayer, MLAWeights
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_kernels_cuda.flashinfer_attention import PagedLayout, paged_layout
from inferx_kernels_cuda.mla_decode import write_latent
from inferx_kernels_cuda.mla_prefill import PrefillPlan, can_tma, mla_prefill, plan_prefill
from inferx_kernels_cuda.ops import _has_tma
from inferx_kernels_cuda.triton_attention import MLA_PREFILL_CONFIG, DenseConfig

# The latent and rope widths FlashInfer's MLA kernels are built and tested for (DeepSeek-V2/V3's;
# its fp8 Hopper kernel asserts them statically).
MLA_WIDTHS = (512, 64)
MLA_BACKENDS = ("fa2", "fa3", "auto")


@dataclass
class MLALayout:
    """One step's decode rows as BatchMLAPagedAttentionWrapper.plan() takes them: request i is
    query qo_indptr[i] (one query each) over pages kv_indices[kv_indptr[i]:kv_indptr[i + 1]]
    holding kv_len[i] tokens. The offsets and lengths are int32 host tensors (plan() reads
    them on the host); kv_indices int32, on the host or the device (plan() only copies it)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len: torch.Tensor


def mla_layout(layout: PagedLayout, block_size: int) -> MLALayout:
    """The MLA layout of a paged layout's rows, one query each: each row's token count from its
    page count and its last page's length."""
    pages = layout.kv_indptr[1:] - layout.kv_indptr[:-1]
    kv_len = ((pages - 1) * block_size + layout.kv_last_page_len).to(torch.int32)
    qo_indptr = torch.arange(len(kv_len) + 1, dtype=torch.int32)
    return MLALayout(qo_indptr, layout.kv_indptr, layout.kv_indices, kv_len)


def check_mla_layers(layers: list[KVLayerSpec], name: str) -> None:
    """Refuse MLA layers FlashInfer's MLA kernels cannot run, naming the layer."""
    mla = [(i, s) for i, s in enumerate(layers) if s.kind == "mla"]
    if not mla:
        return
    first = mla[0][1]
    for i, spec in mla:
        widths = (spec.v_head_dim, spec.rope_dim)
        if widths != MLA_WIDTHS:
            raise NotImplementedError(
                f"{name}: FlashInfer's MLA kernels take kv_lora_rank {MLA_WIDTHS[0]} and "
                f"qk_rope_head_dim {MLA_WIDTHS[1]} (DeepSeek-V2's); layer {i} has "
                f"{widths[0]} and {widths[1]} (the triton and torch backends take other widths)"
            )
        if spec.dtype != "auto":
            raise NotImplementedError(
                f"{name} has no {spec.dtype} cache for MLA layers (layer {i}): FlashInfer "
                "has e4m3 latents only in its fa3 kernel, not wired; use kv_cache.dtype = "
                "auto, or the triton or torch backend"
            )
        if spec.num_q_heads != first.num_q_heads:
            raise NotImplementedError(
                f"{name}: MLA layers with different head counts ({first.num_q_heads} and "
                f"{spec.num_q_heads}, layer {i}); FlashInfer plans one head count a step"
            )


@dataclass
class _Step:
    """What forward() runs for MLA layers until the next plan.

    wrapper: planned over the step's decode rows (None: the step has none); decode_at: their
    query rows (int64, on the device) when the step also has prompt rows, None when every row
    is a decode row (row i is request i); prefill: the Triton prefill of the prompt rows;
    scale: the softmax scale the wrapper was planned with."""

    wrapper: Any | None
    scale: float
    decode_at: torch.Tensor | None = None
    prefill: PrefillPlan | None = None
    query_start: torch.Tensor | None = None
    context_len: torch.Tensor | None = None


@dataclass
class _Buffers:
    """Static layout that every captured size's wrapper copies its plan into (prefixes of the
    same tensors; each replay re-plans its own size's wrapper just before it runs). FlashInfer's
    MLA kernel reads kv_indices from here and the rest from the wrapper's own workspace."""

    qo_indptr: torch.Tensor  # [max_batch + 1] int32
    kv_indptr: torch.Tensor  # [max_batch + 1] int32
    kv_indices: torch.Tensor  # [max_batch * max_blocks] int32
    kv_len: torch.Tensor  # [max_batch] int32
    graphs: dict[int, Any] = field(default_factory=dict)  # a wrapper per captured size


class FlashInferMLA:
    """The MLA part of FlashInferAttention: one head count and width for every MLA layer.

    Decode rows attend in the absorbed form: q_nope @ W_UK (one batched GEMM over the heads)
    and the rotated q_pe go to BatchMLAPagedAttentionWrapper.run with the cache's latent and
    rope columns as two strided views of its [pages, page_size, 1, rank + rope] rows (the
    kernel takes page and row strides, so nothing is copied), and its latent-space output goes
    through W_UV. The wrapper is planned once per step over the decode rows (causal does not
    matter for one query). Prompt rows (sequences of more than one query) attend in the plain
    form through the Triton MLA prefill (mla_prefill: their contexts expanded through
    kv_b_proj, in passes of at most `context_rows` rows), as the triton backend runs them.

    The softmax scale is a plan() argument; the model hands it to layer() before any step, so
    plans use the last one given (`scale`); a layer whose scale differs folds the ratio into
    its query.
    """

    # Context rows expanded a pass in a step with a chunk over a cached prefix (the triton
    # backend's mla_context_rows).
    context_rows = 8192

    def __init__(
        self,
        fi: ModuleType,
        workspace: torch.Tensor,
        spec: KVLayerSpec,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: str = "fa2",
    ) -> None:
        if backend not in MLA_BACKENDS:
            raise ValueError(
                f"mla_backend must be one of {', '.join(MLA_BACKENDS)}; got {backend!r}"
            )
        self._fi = fi
        self._workspace = workspace
        self.backend = backend
        self.heads = spec.num_q_heads
        self.rank, self.rope = MLA_WIDTHS
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.scale: float | None = None
        self.eager = fi.BatchMLAPagedAttentionWrapper(workspace, backend=backend)
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        self.prefill_config = DenseConfig(16, 16, 4, 1) if interpret else MLA_PREFILL_CONFIG
        self.prefill_tma = device.type == "cuda" and _has_tma(device)
        self._buffers: _Buffers | None = None
        self._step: _Step | None = None

    # -- planning -------------------------------------------------------------------------

    def note_layer(self, layer: AttentionLayer) -> None:
        self.scale = layer.scale

    def _plan(self, wrapper: Any, layout: MLALayout) -> float:
        scale = self.scale if self.scale is not None else 1.0
        wrapper.plan(
            layout.qo_indptr,
            layout.kv_indptr,
            layout.kv_indices,
            layout.kv_len,
            self.heads,
            self.rank,
            self.rope,
            self.block_size,
            False,  # causal: each row is one query over its whole context
            scale,
            self.dtype,
            self.dtype,
        )
        return scale

    def begin_step(self, batch: AttentionBatch, layout: PagedLayout | None) -> None:
        """Plan an eager step; `layout` is the step's paged layout (None for an empty step)."""
        lens = batch.query_lens
        decode = [i for i, q in enumerate(lens) if q == 1]
        if layout is None or not lens:
            self._step = _Step(None, 1.0)
            return
        if len(decode) == len(lens):
            self._step = _Step(self.eager, self._plan(self.eager, self._of(layout)))
            return
        step = _Step(None, 1.0, query_start=batch.query_start, context_len=batch.context_len)
        if decode:
            sub = paged_layout(
                [1] * len(decode),
                [batch.context_lens[i] for i in decode],
                [batch.block_tables[i] for i in decode],
                self.block_size,
            )
            step.wrapper, step.scale = self.eager, self._plan(self.eager, self._of(sub))
            starts = [0]
            for q in lens:
                starts.append(starts[-1] + q)
            at = torch.tensor([starts[i] for i in decode], dtype=torch.int64)
            step.decode_at = to_device(at, self.device)
        step.prefill = plan_prefill(
            lens,
            batch.context_lens,
            batch.block_tables,
            self.block_size,
            self.prefill_config.block_m,
            max(self.context_rows, sum(lens)),
            self.device,
        )
        self._step = step

    def _of(self, layout: PagedLayout) -> MLALayout:
        return mla_layout(layout, self.block_size)

    # -- CUDA graphs ------------------------------------------------------------------------

    def init_graph_buffers(self, max_batch: int, max_blocks_per_seq: int) -> None:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=self.device)

        self._buffers = _Buffers(
            zeros(max_batch + 1), zeros(max_batch + 1), zeros(max_batch * max_blocks_per_seq),
            zeros(max_batch),
        )  # fmt: skip

    def _graph_wrapper(self, batch_size: int, create: bool) -> Any:
        b = self._buffers
        if b is None:
            raise RuntimeError("flashinfer MLA: init_graph_buffers() must run first")
        wrapper = b.graphs.get(batch_size)
        if wrapper is None and create:
            wrapper = self._fi.BatchMLAPagedAttentionWrapper(
                self._workspace,
                use_cuda_graph=True,
                qo_indptr=b.qo_indptr[: batch_size + 1],
                kv_indptr=b.kv_indptr[: batch_size + 1],
                kv_indices=b.kv_indices,
                kv_len_arr=b.kv_len[:batch_size],
                backend=self.backend,
            )
            b.graphs[batch_size] = wrapper
        if wrapper is None:
            raise RuntimeError(
                f"flashinfer MLA: prepare_for_capture({batch_size}) must run before a replay "
                "of that size"
            )
        return wrapper

    def prepare_for_capture(self, batch_size: int, layout: PagedLayout) -> None:
        """Plan the size's graph wrapper over `layout` (padding rows alone)."""
        wrapper = self._graph_wrapper(batch_size, create=True)
        self._step = _Step(wrapper, self._plan(wrapper, self._of(layout)))

    def prepare_for_replay(self, batch_size: int, layout: PagedLayout) -> None:
        """Re-plan the size's graph wrapper over a decode batch's layout (padded)."""
        wrapper = self._graph_wrapper(batch_size, create=False)
        self._step = _Step(wrapper, self._plan(wrapper, self._of(layout)))

    # -- the layer ----------------------------------------------------------------------------

    def forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, H, nope + rope] (rope part rotated), k [T, 1, rank + rope] (the cache row)
        -> [T, H, v_head_dim]; writes the rows to the cache at slot_mapping first."""
        step, mla = self._step, layer.mla
        if step is None:
            raise RuntimeError("flashinfer MLA: a step must be planned before forward()")
        assert mla is not None
        rows = k[:, 0].to(self.dtype)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        write_latent(rows, cache, slot_mapping)
        q = q.to(self.dtype)
        num_tokens = q.shape[0]
        if step.prefill is None and step.decode_at is None:  # decode rows only (or none)
            if num_tokens == 0 or step.wrapper is None:
                return q.new_empty(num_tokens, q.shape[1], mla.v_head_dim)
            return self.decode(step, q, cache, mla, layer.scale)
        out = q.new_empty(num_tokens, q.shape[1], mla.v_head_dim)
        if step.decode_at is not None:
            at = step.decode_at
            out[at] = self.decode(step, q.index_select(0, at), cache, mla, layer.scale)
        if step.prefill is not None:
            assert step.query_start is not None and step.context_len is not None
            tma = self.prefill_tma and can_tma(mla.qk_nope_head_dim, self.rope, mla.v_head_dim)
            c = self.prefill_config
            mla_prefill(
                q,
                rows,
                cache,
                mla,
                layer.scale,
                step.prefill,
                step.query_start,
                step.context_len,
                out,
                c.block_n,
                {"num_warps": c.num_warps, "num_stages": c.num_stages},
                tma,
            )
        return out

    def decode(
        self, step: _Step, q: torch.Tensor, cache: torch.Tensor, mla: MLAWeights, scale: float
    ) -> torch.Tensor:
        """The absorbed form of one query a row: q [B, H, nope + rope] -> [B, H, v_head_dim]."""
        assert mla.w_uk is not None and mla.w_uv is not None, "MLA weights not loaded"
        nope, rank = mla.qk_nope_head_dim, self.rank
        # [H, B, rank]: the wrapper reads it as [B, H, rank] through its strides.
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), mla.w_uk.to(q.dtype))
        q_pe = _aligned(q[..., nope:])
        ratio = scale / step.scale
        if abs(ratio - 1.0) > 1e-6:  # plan() fixed another scale: scale the query instead
            q_lat.mul_(ratio)
            q_pe = q_pe * ratio
        rows = cache[:, :, 0]  # [pages, page_size, rank + rope]
        o_lat = q_lat.new_empty(q_lat.shape)  # [H, B, rank], written through its strides
        step.wrapper.run(
            q_lat.transpose(0, 1),
            q_pe,
            rows[..., :rank],
            rows[..., rank:],
            out=o_lat.transpose(0, 1),
        )
        return torch.bmm(o_lat, mla.w_uv.to(q.dtype).transpose(1, 2)).transpose(0, 1)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where FlashInfer's 16-byte vector loads could not read it in
    place (its address or a row or head stride off 16 bytes)."""
    width = 16 // x.element_size()
    ok = x.stride(-1) == 1 and x.data_ptr() % 16 == 0
    ok = ok and all(s % width == 0 for s in x.stride()[:-1])
    return x if ok else x.contiguous()
