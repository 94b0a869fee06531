"""The `flashinfer` attention backend: FlashInfer's paged prefill and decode wrappers over
TorchAttention's cache (in the model's dtype or e4m3), planned once per step, with decode CUDA
graphs; MLA layers through flashinfer_mla."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from inferx_core.attention_torch import FP8, TorchAttention
from inferx_core.interfaces.attention import AttentionBatch, AttentionLayer, MLAWeights
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_kernels_cuda.triton_attention import checked_graph_buffers, fp8_kv_args, write_kv

if TYPE_CHECKING:
    from inferx_kernels_cuda.flashinfer_mla import FlashInferMLA

_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128, 256)
# GQA group sizes FlashInfer's CUDA-core decode kernel is compiled for (its dispatch in
# include/flashinfer/utils.cuh); any other group decodes on its tensor-core kernels.
_CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)
_INSTALL = "pip install 'inferx-kernels-cuda[flashinfer]' (flashinfer-python==0.6.14)"
_PREFILL_BACKENDS = ("fa2", "fa3", "auto")


@dataclass
class PagedLayout:
    """One step's layout the way FlashInfer's wrappers take it, as int32 host tensors.

    Request i owns queries qo_indptr[i]:qo_indptr[i + 1] and pages
    kv_indices[kv_indptr[i]:kv_indptr[i + 1]], of which the last holds kv_last_page_len[i]
    (1..page_size) tokens. Host tensors because plan() reads them on the host (a device tensor
    would cost a synchronisation) and copies them to the device itself.
    """

    qo_indptr: torch.Tensor  # [rows + 1]
    kv_indptr: torch.Tensor  # [rows + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [rows]


def paged_layout(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    padding_rows: int = 0,
) -> PagedLayout:
    """The layout of sequences whose last query_lens[i] of context_lens[i] tokens are new,
    followed by `padding_rows` one-query rows that read one token of block 0 (reserved, so
    always allocated)."""
    qo, kv, last = [0], [0], []
    indices: list[int] = []
    for q, c, table in zip(query_lens, context_lens, block_tables, strict=True):
        pages = -(-c // block_size)
        if not 1 <= q <= c or len(table) < pages:
            raise ValueError(
                f"a sequence with {q} new of {c} tokens and a block table of {len(table)} "
                f"blocks of {block_size} cannot be laid out"
            )
        indices += table[:pages]
        qo.append(qo[-1] + q)
        kv.append(kv[-1] + pages)
        last.append(c - (pages - 1) * block_size)
    for _ in range(padding_rows):
        indices.append(0)
        qo.append(qo[-1] + 1)
        kv.append(kv[-1] + 1)
        last.append(1)

    def host(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    return PagedLayout(host(qo), host(kv), host(indices), host(last))


@dataclass
class _Shape:
    """The layers of one attention shape: FlashInfer plans per (query heads, KV heads, head
    dim), so each shape has its own wrappers, all planned once per step."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype  # the cache's: the model's dtype or e4m3
    tensor_cores: bool  # decode through FlashInfer's tensor-core (prefill) kernels
    decode: Any  # eager wrappers: decode-only steps, and steps with any prefill chunk
    prefill: Any
    graphs: dict[int, Any] = field(default_factory=dict)  # a decode wrapper per captured size


@dataclass
class _Plan:
    """What forward() runs until the next begin_step / prepare_for_capture / _replay."""

    kind: str  # "decode", "prefill" or "graph" (decode over the static buffers)
    num_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device; -1 writes nothing
    wrappers: list[Any]  # by shape


@dataclass
class _GraphBuffers:
    """Static decode layout that captured kernels read. Every captured size's wrappers read
    prefixes of the same tensors (and every shape the same layout), which is safe because
    each replay re-plans its own size's wrappers just before it runs."""

    max_batch: int
    max_blocks: int
    kv_indptr: torch.Tensor  # [max_batch + 1] int32
    kv_indices: torch.Tensor  # [max_batch * max_blocks] int32
    kv_last_page_len: torch.Tensor  # [max_batch] int32
    slot_mapping: torch.Tensor  # [max_batch] int64


class FlashInferAttention(TorchAttention):
    """Paged attention with FlashInfer 0.6's wrappers; a drop-in for TorchAttention with the
    same cache tensors (FlashInfer's "NHD" paged layout takes K and V as two
    [pages, page_size, kv_heads, head_dim] tensors, which cache[0] and cache[1] are).

    begin_step plans once per step and shape: a decode-only step plans the decode wrapper,
    any other step the prefill wrapper, causal, over the paged cache (decode rows included:
    FlashInfer aligns the causal mask to the end of each context). forward() writes the
    layer's K/V with the Triton write kernel, then runs the planned wrapper. GQA groups of
    `tensor_core_min_group` and more (vLLM's threshold; its CUDA-core decode kernel is built
    for groups 1-4 and 8 only) decode through FlashInfer's tensor-core kernels.

    CUDA graphs: FlashInfer fixes a decode wrapper's batch size when it is built with
    use_cuda_graph, and its run() then reads the layout from the index buffers it was given,
    so each captured size gets its own wrapper over prefixes of one set of static buffers;
    prepare_for_capture / prepare_for_replay re-plan it (plan() copies the layout into those
    buffers and writes its work split to the wrapper's own device workspace; in CUDA-graph
    mode the split's shape depends on the batch size alone, so a replay matches its capture).

    MLA layers (DeepSeek-V2) go to flashinfer_mla.FlashInferMLA, planned and captured in the
    same calls: decodes through FlashInfer's MLA wrapper, prompt rows through the Triton MLA
    prefill.

    The softmax scale: FlashInfer 0.6 takes it in plan(), which runs before the model hands
    forward() its scale. plan() keeps FlashInfer's default of 1/sqrt(head_dim) and run() gets
    q_scale = scale * sqrt(head_dim) when a layer's scale differs (run() multiplies the scale
    by q_scale, the same as scaling q).

    An fp8_e4m3 layer: the write kernel stores k / k_scale and v / v_scale in e4m3 as the torch
    and triton backends do (the same bytes), the wrappers are planned with e4m3 KV and queries
    in the model's dtype (FlashInfer's FA2 and CUDA-core kernels cast each e4m3 tile up), and
    run() gets k_scale and v_scale as floats: FlashInfer folds k_scale into the softmax scale
    on the host (a double argument of its kernels) and multiplies the output by v_scale. The
    floats are read once per scale tensor, in the layer's first eager forward, so captured
    graphs hold the loaded values (_host_scales).
    """

    name = "flashinfer attention"
    # Not TorchAttention's: these kernels read one full-attention block table, no window, sinks
    # or softcap, so start-up refuses models that need them (check_layers). fp8_kv: an e4m3
    # cache on FA2 (prefill_backend fa2 or auto; fa3 is refused in __init__). MLA layers run
    # through FlashInfer's MLA wrapper (flashinfer_mla.FlashInferMLA).
    features: frozenset[str] = frozenset({"fp8_kv", "mla"})
    supports_kv_groups = False
    supports_cuda_graphs = True
    # Split-KV partial outputs (fp32), shared by every wrapper. FlashInfer suggests 128 MiB, but
    # a prompt chunk over a long cached context with Qwen2.5-3B's 16 query heads plans 132 MiB.
    workspace_bytes = 256 << 20
    tensor_core_min_group = 5

    def __init__(
        self,
        layers: list[KVLayerSpec],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        prefill_backend: str = "fa2",
        mla_backend: str = "fa2",
    ) -> None:
        # prefill_backend: FlashInfer's prefill module, fa2 by default (the module the
        # tensor-core decode shares); fa3, or auto (FlashInfer picks FA3 on Hopper), compiles
        # one more module. FA3 is faster alone but not yet in the engine (the decision register
        # in docs/ARCHITECTURE.md).
        if prefill_backend not in _PREFILL_BACKENDS:
            raise ValueError(
                f"prefill_backend must be one of {', '.join(_PREFILL_BACKENDS)}; "
                f"got {prefill_backend!r}"
            )
        if dtype not in _DTYPES:
            raise NotImplementedError(
                f"flashinfer attention runs float16 or bfloat16; got {dtype} (the triton and "
                "torch backends run float32)"
            )
        for i, spec in enumerate(layers):
            if spec.kind == "full" and spec.head_dim not in _HEAD_DIMS:  # others: refused below
                raise ValueError(
                    f"flashinfer attention needs head_dim in {_HEAD_DIMS}; layer {i} has "
                    f"{spec.head_dim}"
                )
        fp8 = [i for i, spec in enumerate(layers) if spec.dtype == "fp8_e4m3"]
        if fp8 and prefill_backend == "fa3":
            raise NotImplementedError(
                f"flashinfer attention: prefill_backend 'fa3' cannot read an fp8_e4m3 KV cache "
                f"(layer {fp8[0]}): FlashInfer 0.6's FA3 prefill takes e4m3 keys and values only "
                "with e4m3 queries; use prefill_backend 'fa2' or 'auto' (FA2 for an e4m3 cache), "
                "or kv_cache.dtype = auto"
            )
        super().__init__(layers, block_size, dtype, torch.device(device))  # + the shared checks
        fi = self._load_flashinfer()
        self._fi = fi
        # The write kernel's e4m3 rounding by hand under Triton's interpreter (CPU tests).
        self._interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        self._one = torch.ones(1, dtype=torch.float32, device=self.device)  # a missing scale
        # layer index -> (its scale tensors, their values as floats): _host_scales
        self._scales: dict[int, tuple[tuple[Any, Any], tuple[float, float]]] = {}
        self.prefill_backend = prefill_backend
        self._workspace = torch.zeros(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        self._shapes: list[_Shape] = []
        index: dict[tuple[int, int, int, torch.dtype], int] = {}
        keys = [(s.num_q_heads, s.num_kv_heads, s.head_dim, self.cache_dtype(s)) for s in layers]
        for spec, key in zip(layers, keys, strict=True):
            if key in index or spec.kind == "mla":
                continue
            group = spec.num_q_heads // spec.num_kv_heads
            tensor_cores = group >= self.tensor_core_min_group or group not in _CUDA_CORE_GROUPS
            index[key] = len(self._shapes)
            self._shapes.append(
                _Shape(
                    *key,
                    tensor_cores=tensor_cores,
                    decode=fi.BatchDecodeWithPagedKVCacheWrapper(
                        self._workspace, "NHD", use_tensor_cores=tensor_cores
                    ),
                    prefill=fi.BatchPrefillWithPagedKVCacheWrapper(
                        self._workspace, "NHD", backend=self.prefill_backend
                    ),
                )
            )
        self._shape_of = [
            -1 if s.kind == "mla" else index[key] for s, key in zip(layers, keys, strict=True)
        ]
        self._plan: _Plan | None = None
        self._graph: _GraphBuffers | None = None
        self._mla: FlashInferMLA | None = None
        mla = [s for s in layers if s.kind == "mla"]
        if mla:
            from inferx_kernels_cuda.flashinfer_mla import FlashInferMLA

            self._mla = FlashInferMLA(
                fi, self._workspace, mla[0], block_size, dtype, self.device, mla_backend
            )

    @classmethod
    def check_layers(cls, layers: list[KVLayerSpec], model: str = "the model") -> None:
        super().check_layers(layers, model)
        if any(s.kind == "mla" for s in layers):  # the widths FlashInfer's MLA kernels take
            from inferx_kernels_cuda.flashinfer_mla import check_mla_layers

            check_mla_layers(layers, f"{model} on the {cls.name} backend")

    def layer(
        self,
        index: int,
        scale: float,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        mla: MLAWeights | None = None,
    ) -> AttentionLayer:
        attn = super().layer(index, scale, sinks, k_scale, v_scale, mla)
        if mla is not None and self._mla is not None:
            self._mla.note_layer(attn)  # FlashInfer's MLA plan takes the softmax scale
        return attn

    def _load_flashinfer(self) -> ModuleType:
        """FlashInfer, imported only when the backend is built: listing plugins never needs it."""
        if self.device.type != "cuda":
            raise ValueError(f"flashinfer attention runs on a CUDA device; got {self.device}")
        try:
            import flashinfer
        except ImportError as exc:
            raise ImportError(f"flashinfer attention needs FlashInfer: {_INSTALL}") from exc
        return flashinfer

    # -- planning -------------------------------------------------------------------------

    def begin_step(self, batch: AttentionBatch) -> None:
        slot_mapping = batch.slot_mapping.to(self.device, torch.int64)
        num_tokens = sum(batch.query_lens)
        if not batch.query_lens:
            self._plan = _Plan("decode", 0, slot_mapping, [])
            if self._mla is not None:
                self._mla.begin_step(batch, None)
            return
        layout = paged_layout(
            batch.query_lens, batch.context_lens, batch.block_tables, self.block_size
        )
        if self._mla is not None:
            self._mla.begin_step(batch, layout)
        decode = batch.is_decode_only
        wrappers = []
        for shape in self._shapes:
            if decode:
                self._plan_decode(shape.decode, shape, layout)
                wrappers.append(shape.decode)
            else:
                shape.prefill.plan(
                    layout.qo_indptr,
                    layout.kv_indptr,
                    layout.kv_indices,
                    layout.kv_last_page_len,
                    shape.num_q_heads,
                    shape.num_kv_heads,
                    shape.head_dim,
                    self.block_size,
                    causal=True,
                    q_data_type=self.dtype,
                    kv_data_type=shape.kv_dtype,
                )
                wrappers.append(shape.prefill)
        self._plan = _Plan("decode" if decode else "prefill", num_tokens, slot_mapping, wrappers)

    def _plan_decode(self, wrapper: Any, shape: _Shape, layout: PagedLayout) -> None:
        wrapper.plan(
            layout.kv_indptr,
            layout.kv_indices,
            layout.kv_last_page_len,
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            self.block_size,
            q_data_type=self.dtype,
            kv_data_type=shape.kv_dtype,
        )

    # -- CUDA graphs: decode batches over static buffers ------------------------------------

    def init_graph_buffers(self, max_batch: int, max_blocks_per_seq: int) -> None:
        device = self.device
        self._graph = _GraphBuffers(
            max_batch=max_batch,
            max_blocks=max_blocks_per_seq,
            kv_indptr=torch.zeros(max_batch + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(
                max_batch * max_blocks_per_seq, dtype=torch.int32, device=device
            ),
            kv_last_page_len=torch.ones(max_batch, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
        )
        for shape in self._shapes:  # wrappers over older buffers
            shape.graphs.clear()
        if self._mla is not None:
            self._mla.init_graph_buffers(max_batch, max_blocks_per_seq)

    def prepare_for_capture(self, batch_size: int) -> None:
        g = self._graph_buffers(batch_size)
        wrappers = []
        padding = paged_layout([], [], [], self.block_size, padding_rows=batch_size)
        for shape in self._shapes:
            wrapper = shape.graphs.get(batch_size)
            if wrapper is None:
                wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace,
                    "NHD",
                    use_cuda_graph=True,
                    use_tensor_cores=shape.tensor_cores,
                    paged_kv_indptr_buffer=g.kv_indptr[: batch_size + 1],
                    paged_kv_indices_buffer=g.kv_indices,
                    paged_kv_last_page_len_buffer=g.kv_last_page_len[:batch_size],
                )
                shape.graphs[batch_size] = wrapper
            self._plan_decode(wrapper, shape, padding)
            wrappers.append(wrapper)
        if self._mla is not None:
            self._mla.prepare_for_capture(batch_size, padding)
        g.slot_mapping[:batch_size].fill_(-1)
        self._plan = _Plan("graph", batch_size, g.slot_mapping[:batch_size], wrappers)

    def prepare_for_replay(self, batch: AttentionBatch, padded_batch_size: int) -> None:
        g = self._graph_buffers(padded_batch_size)
        n = len(batch.query_lens)
        pages = max((-(-c // self.block_size) for c in batch.context_lens), default=0)
        if (
            not batch.is_decode_only
            or batch.slot_mapping.shape[0] != n
            or n > padded_batch_size
            or pages > g.max_blocks
        ):
            raise ValueError(
                f"flashinfer attention: a replay takes a decode-only batch of at most "
                f"{padded_batch_size} sequences and {g.max_blocks} blocks each; got "
                f"{batch.slot_mapping.shape[0]} tokens of {n} sequences, up to {pages} blocks"
            )
        wrappers = [shape.graphs.get(padded_batch_size) for shape in self._shapes]
        if any(w is None for w in wrappers):
            raise RuntimeError(
                f"flashinfer attention: prepare_for_capture({padded_batch_size}) must run "
                "before a replay of that size"
            )
        layout = paged_layout(
            batch.query_lens,
            batch.context_lens,
            batch.block_tables,
            self.block_size,
            padding_rows=padded_batch_size - n,
        )
        # plan() copies host indices into a CUDA-graph wrapper's buffer with a blocking copy (a
        # stream synchronisation); from the device it is an asynchronous device-to-device one.
        layout.kv_indices = layout.kv_indices.to(self.device, non_blocking=True)
        for shape, wrapper in zip(self._shapes, wrappers, strict=True):
            self._plan_decode(wrapper, shape, layout)
        if self._mla is not None:
            self._mla.prepare_for_replay(padded_batch_size, layout)
        # A fresh (pageable) host tensor: the copy has read it by the time copy_ returns.
        slots = torch.full((padded_batch_size,), -1, dtype=torch.int64)
        slots[:n] = batch.slot_mapping
        g.slot_mapping[:padded_batch_size].copy_(slots, non_blocking=True)
        self._plan = _Plan("graph", padded_batch_size, g.slot_mapping[:padded_batch_size], wrappers)

    def _graph_buffers(self, batch_size: int) -> _GraphBuffers:
        return checked_graph_buffers(self, batch_size)

    # -- the layer ----------------------------------------------------------------------------

    def forward(
        self, attn: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        layer, scale = attn.index, attn.scale
        plan = self._plan
        if plan is None:
            raise RuntimeError("flashinfer attention: begin_step() must run before forward()")
        spec = self.layers[layer]
        num_tokens = q.shape[0]
        if num_tokens != plan.num_tokens:
            raise ValueError(
                f"flashinfer attention: {num_tokens} tokens but the step was planned for "
                f"{plan.num_tokens}"
            )
        if attn.mla is not None and self._mla is not None:
            out = self._mla.forward(attn, q, k, self.caches[layer], plan.slot_mapping)
            return out if out.dtype == q.dtype else out.to(q.dtype)
        out_dtype = q.dtype
        if num_tokens == 0:
            return q.new_empty(0, spec.num_q_heads, spec.head_dim)
        cache = self.caches[layer]
        k_cache, v_cache = cache[0], cache[1]
        # Both kernels take any token and head strides (q, k, v are views of one fused
        # projection) but need each head's dim contiguous.
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        fp8 = k_cache.dtype == FP8
        fp8_args = fp8_kv_args(attn, self._one, self._interpret) if fp8 else None
        write_kv(k, v, k_cache, v_cache, plan.slot_mapping, spec, fp8_args)
        k_scale, v_scale = self._host_scales(attn) if fp8 else (None, None)
        q = q.to(self.dtype)
        if plan.kind == "prefill":
            # Prefill costs far more than a copy of q; only decode (graphs) is launch-bound,
            # and FlashInfer's decode kernels read q's strides.
            q = q.contiguous()
        out = torch.empty(
            num_tokens, spec.num_q_heads, spec.head_dim, dtype=self.dtype, device=q.device
        )
        ratio = scale * math.sqrt(spec.head_dim)
        q_scale = None if abs(ratio - 1.0) < 1e-6 else ratio
        plan.wrappers[self._shape_of[layer]].run(
            q, (k_cache, v_cache), q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out
        )
        return out if out_dtype == self.dtype else out.to(out_dtype)

    # -- an e4m3 cache --------------------------------------------------------------------------

    def _host_scales(self, attn: AttentionLayer) -> tuple[float, float]:
        """The layer's (k_scale, v_scale) as floats, as FlashInfer's run() takes them (1.0
        for a missing one). Read from the device once per scale tensor (one synchronisation, in
        the layer's first eager forward), not per step: the scales are fixed once the weights
        are loaded, and a captured graph keeps the floats it was captured with."""
        tensors = (attn.k_scale, attn.v_scale)
        held = self._scales.get(attn.index)
        if held is not None and held[0][0] is tensors[0] and held[0][1] is tensors[1]:
            return held[1]
        if self._capturing():
            raise RuntimeError(
                f"flashinfer attention: layer {attn.index}'s k_scale / v_scale were first "
                "seen while capturing a CUDA graph; FlashInfer takes them as floats, read "
                "on the host, so run an eager step with the layer before capturing"
            )
        read = [self._one if t is None else t.reshape(1) for t in tensors]
        k_scale, v_scale = torch.cat(read).float().tolist()
        self._scales[attn.index] = (tensors, (k_scale, v_scale))
        return k_scale, v_scale

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
