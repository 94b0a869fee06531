"""The `triton` attention backend: paged decode (split-K) and prefill on TorchAttention's cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from inferx_core.attention_torch import TorchAttention
from inferx_core.batch import pack_aligned, to_device
from inferx_core.interfaces.attention import AttentionBatch, AttentionLayer, SplitAttention
from inferx_core.interfaces.kv import KVLayerSpec
from inferx_kernels_cuda import triton_kernels as kernels
from inferx_kernels_cuda.mla_decode import mla_decode_absorbed, write_latent
from inferx_kernels_cuda.mla_prefill import (
    PrefillPass,
    PrefillPlan,
    can_tma,
    mla_prefill,
    plan_prefill,
    query_tiles,
)
from inferx_kernels_cuda.ops import _ROTARY_TILE, _has_tma
from inferx_kernels_cuda.pdl import attention_early, between_launch, in_ranges

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor in pinned memory (where CUDA is), so that copies from it do not block."""
    return t.pin_memory() if torch.cuda.is_available() else t


@dataclass
class _Tiles:
    """The prefill query tiles of one GQA group size: BLOCK_Q queries of one sequence each."""

    block_m: int
    block_q: int
    seq: torch.Tensor  # [count] int32, index of the tile's sequence in the batch
    start: torch.Tensor  # [count] int32, its first query within that sequence
    count: int


class DenseConfig(NamedTuple):
    """dense_prefill_kernel's tile and launch: query rows a tile (queries x the GQA group),
    keys a tile, warps, pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @classmethod
    def parse(cls, text: str) -> DenseConfig:
        """From "BMxBNxWARPSxSTAGES", e.g. "128x64x8x3"."""
        parts = text.split("x")
        if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"a dense prefill config is BMxBNxWARPSxSTAGES; got {text!r}")
        return cls(*(int(p) for p in parts))


# mla_prefill_kernel's tile and launch on a GPU: at V2's widths, two programs an SM and no
# register spills for sm_90 (docs/ARCHITECTURE.md, MLA; tests/sm90_mla.py checks it).
MLA_PREFILL_CONFIG = DenseConfig(64, 64, 4, 2)


@dataclass
class _Plan:
    """One step's metadata, built once by begin_step and read by every layer's launches."""

    slot_mapping: torch.Tensor
    query_start: torch.Tensor
    context_len: torch.Tensor
    block_table: torch.Tensor
    decode_seqs: torch.Tensor  # [num_decode] int32, batch indices of one-query sequences
    num_decode: int
    all_decode: bool  # no prefill: decode i is sequence i and query row i
    num_splits: int
    split_len: int  # context tokens per split, a multiple of the decode tile
    part_o: torch.Tensor | None  # split-K partial outputs, fp32, sized for the widest layer
    part_lse: torch.Tensor | None
    tiles: dict[int, list[_Tiles]]  # by GQA group size: one prefill launch per tile set
    seq_split: bool = False  # split_len is the shortest split; each sequence derives its own
    # by GQA group size: the fresh prompts' tiles for dense_prefill_kernel (dense_prefill)
    dense_tiles: dict[int, _Tiles] = field(default_factory=dict)
    dense_config: DenseConfig | None = None  # their tile and launch
    # with several KV groups, every group's tables and slots (index 0: the fields above);
    # empty for one group, and in dry runs, where every group reads group 0's
    group_block_tables: list[torch.Tensor] = field(default_factory=list)
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)


def _graph_decode_rows(plan: _Plan) -> int:
    """The rows the per-row PDL choices see: a CUDA-graph decode-only plan's (seq_split), else
    0, which no row range takes."""
    return plan.num_decode if plan.all_decode and plan.seq_split else 0


@dataclass
class _GraphBuffers:
    """Static decode metadata that captured kernels read; each replay's layout is copied in."""

    max_batch: int
    max_blocks: int
    block_table: torch.Tensor  # [max_batch, max_blocks] int32; only valid block ids ever
    context_len: torch.Tensor  # [max_batch] int32
    slot_mapping: torch.Tensor  # [max_batch] int64
    query_start: torch.Tensor  # [max_batch + 1] int32: row i is sequence i
    part_o: torch.Tensor  # split-K scratch for the largest batch size's grid
    part_lse: torch.Tensor
    staged_context_len: torch.Tensor  # host (pinned on a GPU) copies of the per-row vectors
    staged_slot_mapping: torch.Tensor
    copied: torch.cuda.Event | None  # the last replay's copies out of the staged tensors
    # with several KV groups, those of groups 1.. (group 0's are the fields above)
    more_block_tables: list[torch.Tensor] = field(default_factory=list)
    more_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    more_staged_slot_mappings: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _MixedBuffers:
    """Static metadata of mixed-step graphs, over grids fixed per token count: prompt chunks
    run the prefill kernel in BLOCK_M-row tiles, one-query sequences (decodes) the decode
    kernel, one decode slot each, their contexts split as in a decode graph (SEQ_SPLIT). Tiles
    and decode slots past the step's own, and padding tokens, belong to an empty sequence row
    (no queries, no context), whose decode programs store nothing."""

    max_tokens: int
    max_seqs: int
    max_blocks: int
    slot_mapping: torch.Tensor  # [max_tokens] int64, -1 for padding tokens
    query_start: torch.Tensor  # [max_seqs + 2] int32
    context_len: torch.Tensor  # [max_seqs + 1] int32
    block_table: torch.Tensor  # [max_seqs + 1, max_blocks] int32
    tile_seq: dict[int, torch.Tensor]  # by GQA group size: [tiles for max_tokens] int32
    tile_start: dict[int, torch.Tensor]
    decode_seqs: torch.Tensor  # [max_seqs] int32: the one-query sequences, one slot each
    part_o: torch.Tensor  # split-K scratch for the largest token count's decode grid
    part_lse: torch.Tensor
    # with several KV groups, the slot mappings and block tables of groups 1..
    more_slot_mappings: list[torch.Tensor] = field(default_factory=list)
    more_block_tables: list[torch.Tensor] = field(default_factory=list)
    mla: _MLAMixed | None = None  # a model with MLA layers: theirs


@dataclass
class _MLADecodes:
    """The rows of a step with prompt rows that attend in the absorbed form, for its MLA
    layers, gathered once a step: each one's query row, the row its output goes to, its block
    table (one a KV group) and context. Eagerly these are the decodes. A mixed graph's rows
    also hold its chunks' rows over their cached prefix (context: the prefix), which read their
    sequence's block-table row (row_seq) and merge with the chunk's own rows' plain part
    (merge_row: the row's piece, -1 for a decode); its unused rows read query row 0, have no
    context and write the output's spare row past the step's."""

    q_rows: torch.Tensor  # [rows] int64
    out_rows: torch.Tensor  # [rows] int64
    tables: list[torch.Tensor]  # [rows, blocks] int32; with row_seq: [seqs, blocks]
    context_len: torch.Tensor  # [rows] int32
    row_seq: torch.Tensor | None = None  # [rows] int32: the row's block-table row
    merge_row: torch.Tensor | None = None  # [rows] int32


@dataclass
class _MLAMixed:
    """Static metadata of mixed graphs for MLA layers. mla_prefill_kernel's tiles over the
    step's own rows (tiles past the step's on the empty sequence row): a fresh prompt attends
    positions [0, context), a chunk over a cached prefix only its own, [prefix, context)
    (key_lo), its position p at row row0 + p. The absorbed rows: a graph of t tokens has
    min(t, slots + prefix_rows) of them (slots = min(t, max_seqs)), enough for every decode
    and for up to prefix_rows chunk rows over a cached prefix (takes_mixed_step)."""

    tile_seq: torch.Tensor  # [cdiv(max_tokens, BLOCK_M) + min(max_tokens, max_seqs)] int32
    tile_start: torch.Tensor
    key_lo: torch.Tensor  # [max_seqs + 1] int32: a chunk's cached prefix (0: fresh)
    row0: torch.Tensor  # [max_seqs + 1] int32: query_start - key_lo
    # [2 * max_rows] int64: a graph of r absorbed rows reads their query rows from [:r], their
    # output rows from [r : 2r] (one contiguous copy a replay)
    rows: torch.Tensor
    row_seq: torch.Tensor  # [max_rows] int32, each absorbed row's sequence
    context_len: torch.Tensor  # [max_rows] int32, each absorbed row's context (0: unused)
    merge_row: torch.Tensor  # [max_rows] int32, a chunk row's own row (-1: a decode, unused)
    prefix_rows: int  # chunk rows over a cached prefix the buffers hold (mla_prefix_rows)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    spec: KVLayerSpec,
    fp8: dict[str, Any] | None = None,
) -> None:
    """k, v [T, Hkv, D] (head dim contiguous) into the cache slots of slot_mapping (-1: skip).
    fp8: an e4m3 cache's kernel arguments (fp8_kv_args)."""
    kernels.kv_write_kernel[(k.shape[0],)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        spec.num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        HEADS_PAD=triton.next_power_of_2(spec.num_kv_heads),
        HEAD_DIM=spec.head_dim,
        **(fp8 or {}),
    )


def fp8_kv_args(layer: AttentionLayer, one: torch.Tensor, interpret: bool) -> dict[str, Any]:
    """The KV kernels' arguments for the layer's e4m3 cache: KV_FP8 and pointers to its scales
    (`one`, a float32 1 on the cache's device, for a missing one), read at run time so that
    CUDA graphs replay with the loaded values; HAND_ROUND under the interpreter."""
    k_scale, v_scale = (
        one if s is None else s.to(one.device, torch.float32)
        for s in (layer.k_scale, layer.v_scale)
    )
    return {"k_scale_ptr": k_scale, "v_scale_ptr": v_scale, "KV_FP8": True, "HAND_ROUND": interpret}


def _group_fields(
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    more_slot_mappings: list[torch.Tensor],
    more_block_tables: list[torch.Tensor],
) -> dict[str, list[torch.Tensor]]:
    """A graph plan's per-group fields: none for one KV group, else every group's."""
    if not more_block_tables:
        return {}
    return {
        "group_slot_mappings": [slot_mapping, *more_slot_mappings],
        "group_block_tables": [block_table, *more_block_tables],
    }


def checked_graph_buffers(backend: Any, batch_size: int) -> Any:
    """backend._graph (set by init_graph_buffers), if it holds `batch_size` rows."""
    g = backend._graph
    if g is None:
        raise RuntimeError(f"{backend.name}: init_graph_buffers() must run first")
    if not 1 <= batch_size <= g.max_batch:
        raise ValueError(
            f"{backend.name}: batch size {batch_size} is outside the graph buffers' "
            f"1..{g.max_batch}"
        )
    return g


class TritonAttention(TorchAttention):
    """Paged attention in Triton; a drop-in for TorchAttention with the same cache tensors.

    Sequences with one query this step (decodes) run the decode kernel: one program per
    (sequence, KV head, split) holding all query heads of the group, the context split into
    `num_splits` ranges when there are too few (sequence, KV head) pairs to fill the GPU; a
    second kernel combines the splits by their log-sum-exp. Every other sequence runs the
    prefill kernel over query tiles from its cached prefix plus its new chunk. Both read the
    cache after this step's K/V were written by the write kernel, so a mixed batch is two
    launches over disjoint output rows.

    min_split_len: fewest context tokens per split. target_programs: decode programs to aim
    for (default: twice the GPU's SM count); splitting stops there. The default of one 64-token
    tile per split is what measured fastest at batch 1-64: each tile iteration of the decode
    loop is mostly dependent-load latency, so short programs in parallel beat long ones even
    after the reduce launch. Tile sizes and launch options are attributes
    so that tests and tuning can change them.
    """

    name = "triton attention"
    # Sliding windows and learned sinks are constexpr flags of the kernels (a layer without
    # them compiles to the plain kernel); several KV groups read each layer's group's tables.
    # No softcap: start-up refuses models that need it (check_layers). fp8_kv: an e4m3 cache
    # (KV_FP8, another constexpr flag) on every path that writes or reads it. MLA layers:
    # _forward_mla.
    features: frozenset[str] = frozenset({"sliding", "sinks", "fp8_kv", "mla"})
    supports_kv_groups = True
    max_splits = 64
    supports_cuda_graphs = True
    replays_on_current_stream = True
    supports_mixed_graphs = True
    fuses_rotary = True

    @classmethod
    def check_layers(cls, layers: list[KVLayerSpec], model: str = "the model") -> None:
        """The shared checks, then the kernels' own limit: full and sliding layers need a
        power-of-two head_dim of 16 or more (tl.arange over it); a ValueError naming the layer.
        engine.attention_backend auto takes torch where this refuses."""
        super().check_layers(layers, model)
        for i, spec in enumerate(layers):
            d = spec.head_dim
            if spec.kind in ("full", "sliding") and (d < 16 or d & (d - 1)):  # others: refused
                raise ValueError(
                    f"triton attention needs a power-of-two head_dim >= 16; layer {i} has {d}"
                )

    def __init__(
        self,
        layers: list[KVLayerSpec],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        min_split_len: int = 64,
        target_programs: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise NotImplementedError(
                f"triton attention runs float16, bfloat16 or float32; got {dtype}"
            )
        super().__init__(layers, block_size, dtype, device)  # + the shared checks
        self.interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        self.min_split_len = min_split_len
        if target_programs is None:
            target_programs = 1
            if torch.device(device).type == "cuda":
                props = torch.cuda.get_device_properties(device)
                target_programs = 2 * props.multi_processor_count
        self.target_programs = target_programs
        # Under the interpreter, small tiles keep numpy's work down and still exercise loops
        # of several tiles on short test contexts.
        small = self.interpret
        self.decode_block_n = 16 if small else 64
        self.prefill_block_m = 16 if small else 64
        self.prefill_block_n = 16 if small else 64
        # Launch options (num_warps, num_stages) per kernel, for tuning.
        self.decode_launch: dict[str, int] = {"num_warps": 4, "num_stages": 1}
        self.reduce_launch: dict[str, int] = {"num_warps": 4}  # Triton's default
        # Query heads per decode_reduce_kernel program (a power of two): more, fewer programs
        # (batch 64 launches 1024 of them at one head for 1.5 MB). Capped by _reduce_heads. 2
        # is faster at batch 64 and no loss at batch 1 or 8 (tune_decode_attention).
        self.reduce_heads = 2
        self.prefill_launch: dict[str, int] = {"num_warps": 4, "num_stages": 1}
        # ... and for layers whose GQA group is at most 4: their K/V tiles pipelined 2 deep
        # (Triton's num_stages): faster for Llama-3.1-8B's heads (group 4) at long prompts,
        # slower at the 3B's group of 8 (tune_prefill_attention.py). Groups 1-2 were not
        # measured.
        self.prefill_launch_small_group: dict[str, int] = {"num_warps": 4, "num_stages": 2}
        # decode_rotary: decode-only steps rotate q and k and write the new k/v inside the
        # decode kernel (ROTARY) instead of a rotary_kv_write_kernel launch before it (a
        # launch fewer a layer, a faster step).
        self.decode_rotary = True
        # qkv_parts: in those steps the model hands q, k and v as the QKV GEMM's K-split partial
        # results (QuantLinear.forward_split: thinner GEMMs that read the weight faster) and the
        # decode kernel sums them with the bias.
        self.qkv_parts = True
        # keep_split_rows: decode-only steps of these many rows whose context is split leave
        # the combine of the splits to o_proj (forward_with_rotary(keep_splits=True) returns a
        # SplitAttention; TritonOps runs tma_reduce_linear, its weight slice loaded while the
        # decode kernel runs): faster at 1-4 rows, slower at 8. Row ranges ((lo, hi),
        # inclusive; () none).
        self.keep_split_rows: tuple[tuple[int, int], ...] = ((1, 4),)
        # preload_rows: at these rows, where the decode kernel launches early behind the QKV
        # GEMV (EARLY) and rotates itself, each program loads its split's first K/V tile before
        # its wait as well (PRELOAD). The tile's registers double the program's, so it pays
        # only while one program an SM is enough: faster at 1 row, level at 2-4, slower from 8.
        # Row ranges.
        self.preload_rows: tuple[tuple[int, int], ...] = ((1, 1),)
        # ... and over an e4m3 cache: none. Its preloaded tile is converted after the wait, and
        # the step was slower with it (docs/ARCHITECTURE.md, FP8 KV cache).
        self.preload_fp8_rows: tuple[tuple[int, int], ...] = ()
        # dense_prefill: in eager steps, fresh prompts (no cached prefix) attend through
        # dense_prefill_kernel, over the step's own q, k (rotated in place) and v read by TMA,
        # instead of prefill_kernel over the paged cache; chunks over a cached prefix stay on
        # the latter. It needs GQA groups that are powers of two and a TMA GPU (or the
        # interpreter). Faster prompt steps and TTFT (bench_prefill_peers and the engine; the
        # decision register in docs/ARCHITECTURE.md).
        groups = {s.num_q_heads // s.num_kv_heads for s in layers}
        tma = self.interpret or (torch.device(device).type == "cuda" and _has_tma(device))
        # Not over an e4m3 cache: attention there reads the keys and values the cache holds
        # (quantized), not the step's own.
        self._fp8 = any(self.cache_dtype(s) == torch.float8_e4m3fn for s in layers)
        self.dense_prefill = tma and not self._fp8 and all(g & (g - 1) == 0 for g in groups)
        # dense_configs: the kernel's config by the step's longest fresh prompt (at least
        # that many tokens; from a sweep of configs: three stages pay from 2048 tokens, and at
        # 16 x 512 for groups up to 4 only).
        wide = max(groups) >= 8
        ladder = (
            [
                (0, DenseConfig(64, 64, 4, 2)),
                (2048, DenseConfig(64, 32, 4, 3)),
                (8192, DenseConfig(128, 128, 8, 3)),
            ]
            if wide
            else [(0, DenseConfig(64, 64, 4, 3)), (8192, DenseConfig(128, 128, 8, 3))]
        )
        self.dense_configs: list[tuple[int, DenseConfig]] = (
            [(0, DenseConfig(16, 16, 4, 1))] if small else ladder
        )
        # bf16 tl.dot is wrong under the interpreter only; there operands go to fp32 first.
        self._upcast = self.interpret and dtype == torch.bfloat16
        self._dot_precision = "ieee" if dtype == torch.float32 else "tf32"
        self._groups = sorted(groups)
        self._one = torch.ones(1, dtype=torch.float32, device=device)  # a missing k/v scale
        self._plan: _Plan | None = None
        self._graph: _GraphBuffers | None = None
        self._mixed: _MixedBuffers | None = None
        self._mla_init()

    @property
    def warm_up_prompt_lens(self) -> tuple[int, ...]:  # type: ignore[override]
        """AttentionBackend.warm_up_prompt_lens: the dense ladder's steps past its first."""
        return tuple(at for at, _ in self.dense_configs[1:]) if self.dense_prefill else ()

    @property
    def keeps_splits(self) -> bool:  # type: ignore[override]
        """AttentionBackend.keeps_splits: at some rows (keep_split_rows)."""
        return bool(self.keep_split_rows)

    def prefill_options(self, group: int) -> dict[str, int]:
        """The prefill kernel's launch options (num_warps, num_stages) for a GQA group size."""
        return self.prefill_launch_small_group if group <= 4 else self.prefill_launch

    def _tile_shape(self, group: int) -> tuple[int, int]:
        """(BLOCK_M, BLOCK_Q) of the prefill kernel for a GQA group size."""
        block_m = max(self.prefill_block_m, triton.next_power_of_2(group))
        return block_m, block_m // group

    @staticmethod
    def _tiles_of(
        query_lens: list[int], seqs: list[int], block_q: int, longest_first: bool = False
    ) -> list[list[int]]:
        """[tile sequences, tile first queries] covering the queries of `seqs`; longest_first:
        ordered by first query, last first (causal tiles further in see more keys: the GPU
        starts the longest programs first and fills the tail with short ones)."""
        tiles = [(i, start) for i in seqs for start in range(0, query_lens[i], block_q)]
        if longest_first:
            tiles.sort(key=lambda t: -t[1])
        return [[i for i, _ in tiles], [start for _, start in tiles]]

    def begin_step(self, batch: AttentionBatch) -> None:
        device = self.device
        decode = [i for i, q in enumerate(batch.query_lens) if q == 1]
        prefill = [i for i, q in enumerate(batch.query_lens) if q != 1]

        num_splits, split_len = 1, self.decode_block_n
        if decode:
            max_ctx = max(batch.context_lens[i] for i in decode)
            num_splits, split_len = self._plan_splits(len(decode), max_ctx)

        context_len = batch.context_len.to(device, torch.int32)
        decode_seqs = context_len  # never read in a decode-only step: decode i is sequence i
        tiles: dict[int, list[_Tiles]] = {}
        dense_tiles: dict[int, _Tiles] = {}
        dense_config = None
        if prefill:
            lens = zip(batch.query_lens, batch.context_lens, strict=True)
            use_dense = self.dense_prefill and not self._fp8  # (even if switched on later)
            to_dense = [use_dense and q == c for q, c in lens]  # fresh prompts
            fresh = [i for i in prefill if to_dense[i]]
            paged = [i for i in prefill if not to_dense[i]]
            # Every index list travels in one host-to-device copy, each 16-byte aligned.
            parts = [list(decode)]
            tile_ranges = []  # (group, dense, block_m, block_q, first part, tile count)
            if fresh:
                longest = max(batch.query_lens[i] for i in fresh)
                dense_config = [c for at, c in self.dense_configs if longest >= at][-1]
            for group in self._groups:
                shapes = [(False, paged, *self._tile_shape(group))]
                if dense_config is not None:
                    block_m = max(dense_config.block_m, group)
                    shapes.append((True, fresh, block_m, block_m // group))
                for dense, seqs, block_m, block_q in shapes:
                    if seqs:
                        seqs_starts = self._tiles_of(batch.query_lens, seqs, block_q, dense)
                        count = len(seqs_starts[0])
                        tile_ranges.append((group, dense, block_m, block_q, len(parts), count))
                        parts += seqs_starts
            packed, at = pack_aligned(parts, torch.int32)
            packed = to_device(packed, device)
            decode_seqs = packed[: len(decode)]
            for group, dense, block_m, block_q, part, count in tile_ranges:
                seq = packed[at[part] : at[part] + count]
                start = packed[at[part + 1] : at[part + 1] + count]
                t = _Tiles(block_m, block_q, seq, start, count)
                if dense:
                    dense_tiles[group] = t
                else:
                    tiles[group] = [t]

        part_o = part_lse = None
        if num_splits > 1:
            heads = max(s.num_q_heads for s in self.layers)
            dim = max(s.head_dim for s in self.layers)
            rows = len(decode) * heads * num_splits
            part_o = torch.empty(rows * dim, dtype=torch.float32, device=device)
            part_lse = torch.empty(rows, dtype=torch.float32, device=device)

        slot_mapping = batch.slot_mapping.to(device, torch.int64)
        block_table = batch.block_table.to(device, torch.int32)
        group_tables = [block_table] if batch.group_block_tables else []
        group_slots = [slot_mapping] if batch.group_slot_mappings else []
        group_tables += [t.to(device, torch.int32) for t in batch.group_block_tables[1:]]
        group_slots += [t.to(device, torch.int64) for t in batch.group_slot_mappings[1:]]
        self._plan = _Plan(
            slot_mapping=slot_mapping,
            query_start=batch.query_start.to(device, torch.int32),
            context_len=context_len,
            block_table=block_table,
            decode_seqs=decode_seqs,
            num_decode=len(decode),
            all_decode=not prefill,
            num_splits=num_splits,
            split_len=split_len,
            part_o=part_o,
            part_lse=part_lse,
            tiles=tiles,
            dense_tiles=dense_tiles,
            dense_config=dense_config,
            group_block_tables=group_tables,
            group_slot_mappings=group_slots,
        )
        self._mla_begin_step(batch)

    def _plan_splits(self, num_decode: int, max_ctx: int) -> tuple[int, int]:
        """(splits, tokens per split) for the longest decode context of the step.

        Split only while (sequences x KV heads x splits) is short of target_programs, keep
        every split at least min_split_len long and a whole number of decode tiles.
        """
        kv_heads = min(s.num_kv_heads for s in self.layers)
        wanted = _cdiv(self.target_programs, num_decode * kv_heads)
        splits = max(1, min(wanted, max_ctx // self.min_split_len, self.max_splits))
        tile = self.decode_block_n
        split_len = _cdiv(_cdiv(max_ctx, splits), tile) * tile
        return _cdiv(max_ctx, split_len), split_len

    def _reduce_heads(self, num_q_heads: int, splits_pad: int) -> int:
        """reduce_heads, halved until it divides the layer's query heads and a program's tile
        (heads x splits x head_dim) is no larger than one head's of an eager step at the default
        max_splits (64 rows of head_dim)."""
        heads = self.reduce_heads
        if heads < 1 or heads & (heads - 1):
            raise ValueError(f"{self.name}: reduce_heads must be a power of two; got {heads}")
        while heads > 1 and (num_q_heads % heads or heads * splits_pad > 64):
            heads //= 2
        return heads

    # -- CUDA graphs: decode batches over static buffers -------------------------------------
    #
    # A captured grid is fixed, so the split count is fixed per batch size: the eager policy at
    # the longest context the buffers hold. Each sequence then splits its own context over that
    # many programs (SEQ_SPLIT), and splits past its context stay empty, so the one graph serves
    # every context length. Padding rows have context 1 over a valid block id and slot -1, which
    # the KV write skips.

    def _split_scratch(self, max_rows: int, max_ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """part_o and part_lse for graphs of up to max_rows decodes, each split as
        _plan_splits splits that many at max_ctx (fp32, sized for the widest layer)."""
        rows = max(b * self._plan_splits(b, max_ctx)[0] for b in range(1, max_rows + 1))
        rows *= max(s.num_q_heads for s in self.layers)
        dim = max(s.head_dim for s in self.layers)
        part_o = torch.empty(rows * dim, dtype=torch.float32, device=self.device)
        return part_o, torch.empty(rows, dtype=torch.float32, device=self.device)

    def _graph_split_len(self) -> int:
        """A captured plan's shortest split (SEQ_SPLIT): min_split_len in whole decode tiles."""
        tile = self.decode_block_n
        return _cdiv(max(self.min_split_len, 1), tile) * tile

    def init_graph_buffers(self, max_batch: int, max_blocks_per_seq: int) -> None:
        device = self.device
        part_o, part_lse = self._split_scratch(max_batch, max_blocks_per_seq * self.block_size)
        pin = device.type == "cuda"
        more = range(len(self.groups) - 1)  # groups past the first, each with its own metadata
        self._graph = _GraphBuffers(
            max_batch=max_batch,
            max_blocks=max_blocks_per_seq,
            block_table=torch.zeros(
                max_batch, max_blocks_per_seq, dtype=torch.int32, device=device
            ),
            context_len=torch.ones(max_batch, dtype=torch.int32, device=device),
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
            query_start=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            part_o=part_o,
            part_lse=part_lse,
            staged_context_len=torch.ones(max_batch, dtype=torch.int32, pin_memory=pin),
            staged_slot_mapping=torch.full((max_batch,), -1, dtype=torch.int64, pin_memory=pin),
            copied=None,
            more_block_tables=[
                torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
                for _ in more
            ],
            more_slot_mappings=[
                torch.full((max_batch,), -1, dtype=torch.int64, device=device) for _ in more
            ],
            more_staged_slot_mappings=[
                torch.full((max_batch,), -1, dtype=torch.int64, pin_memory=pin) for _ in more
            ],
        )

    def prepare_for_capture(self, batch_size: int) -> None:
        g = self._graph_buffers(batch_size)
        max_ctx = g.max_blocks * self.block_size
        num_splits = self._plan_splits(batch_size, max_ctx)[0]
        g.context_len[:batch_size].fill_(1)
        g.slot_mapping[:batch_size].fill_(-1)
        for slots in g.more_slot_mappings:
            slots[:batch_size].fill_(-1)
        self._plan = _Plan(
            slot_mapping=g.slot_mapping[:batch_size],
            query_start=g.query_start[: batch_size + 1],
            context_len=g.context_len[:batch_size],
            block_table=g.block_table[:batch_size],
            decode_seqs=g.context_len[:batch_size],  # never read: every row is a decode
            num_decode=batch_size,
            all_decode=True,
            num_splits=num_splits,
            split_len=self._graph_split_len(),
            part_o=g.part_o if num_splits > 1 else None,
            part_lse=g.part_lse if num_splits > 1 else None,
            tiles={},
            seq_split=True,
            **_group_fields(
                g.slot_mapping[:batch_size],
                g.block_table[:batch_size],
                [t[:batch_size] for t in g.more_slot_mappings],
                [t[:batch_size] for t in g.more_block_tables],
            ),
        )

    def prepare_for_replay(self, batch: AttentionBatch, padded_batch_size: int) -> None:
        g = self._graph_buffers(padded_batch_size)
        n, width = batch.block_table.shape
        if batch.slot_mapping.shape[0] != n or n > padded_batch_size or width > g.max_blocks:
            raise ValueError(
                f"triton attention: a replay takes a decode-only batch of at most "
                f"{padded_batch_size} sequences and {g.max_blocks} blocks each; got "
                f"{batch.slot_mapping.shape[0]} tokens of {n} sequences, {width} blocks wide"
            )
        if g.copied is not None:
            g.copied.synchronize()  # the previous replay's copies have left the staged tensors
        ctx, slots = g.staged_context_len, g.staged_slot_mapping
        ctx[:n].copy_(batch.context_len)
        ctx[n:padded_batch_size] = 1
        slots[:n].copy_(batch.slot_mapping)
        slots[n:padded_batch_size] = -1
        g.context_len[:padded_batch_size].copy_(ctx[:padded_batch_size], non_blocking=True)
        g.slot_mapping[:padded_batch_size].copy_(slots[:padded_batch_size], non_blocking=True)
        # Padding rows keep whatever ids their table rows hold: all valid, and read only at
        # position 0.
        g.block_table[:n, :width].copy_(batch.block_table, non_blocking=True)
        if g.more_block_tables:
            self._replay_groups(g, batch, n, padded_batch_size)
        if self.device.type == "cuda":
            if g.copied is None:
                g.copied = torch.cuda.Event()
            g.copied.record()

    def _replay_groups(
        self, g: _GraphBuffers, batch: AttentionBatch, n: int, padded_batch_size: int
    ) -> None:
        """prepare_for_replay's copies of the KV groups past the first."""
        if len(batch.group_block_tables) != len(self.groups):
            raise ValueError(
                f"{self.name}: a replay of a model of {len(self.groups)} KV groups takes every "
                f"group's tables; got {len(batch.group_block_tables)}"
            )
        more = zip(
            batch.group_block_tables[1:],
            batch.group_slot_mappings[1:],
            g.more_block_tables,
            g.more_slot_mappings,
            g.more_staged_slot_mappings,
            strict=True,
        )
        for table, slot_mapping, dest_table, dest_slots, staged in more:
            staged[:n].copy_(slot_mapping)
            staged[n:padded_batch_size] = -1
            dest_slots[:padded_batch_size].copy_(staged[:padded_batch_size], non_blocking=True)
            dest_table[:n, : table.shape[1]].copy_(table, non_blocking=True)

    # -- CUDA graphs of steps with prompt tokens ---------------------------------------------
    #
    # Query lengths vary, so the kernels run over grids fixed per token count t: at group size
    # g, cdiv(t, BLOCK_Q) + min(t, max_seqs) prefill tiles for the sequences of several queries
    # (the most any step of t tokens can need), and min(t, max_seqs) decode slots for the
    # one-query sequences (decodes), each split over _mixed_splits(t) programs as a decode
    # graph splits its rows (SEQ_SPLIT). Unused tiles, slots and padding tokens point at the
    # sequence row after the step's last, which has no queries and no context. The decode
    # kernel, not 16-row prefill tiles, runs the decodes: decodes in prefill tiles took much
    # longer than in a decode-only step (measured in docs/BENCHMARKS.md).

    def init_mixed_graph_buffers(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int
    ) -> None:
        self._mla_refuse_mixed()
        device = self.device
        tiles = {g: self._mixed_tile_count(max_tokens, max_seqs, g) for g in self._plain_groups}
        # a graph of t tokens has min(t, max_seqs) decode slots
        part_o = part_lse = torch.empty(0, dtype=torch.float32, device=device)
        if self._plain_groups:  # (MLA layers' decodes have scratch of their own)
            part_o, part_lse = self._split_scratch(
                min(max_tokens, max_seqs), max_blocks_per_seq * self.block_size
            )
        more = range(len(self.groups) - 1)  # groups past the first, each with its own metadata
        self._mixed = _MixedBuffers(
            max_tokens=max_tokens,
            max_seqs=max_seqs,
            max_blocks=max_blocks_per_seq,
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
            query_start=torch.zeros(max_seqs + 2, dtype=torch.int32, device=device),
            context_len=torch.zeros(max_seqs + 1, dtype=torch.int32, device=device),
            block_table=torch.zeros(
                max_seqs + 1, max_blocks_per_seq, dtype=torch.int32, device=device
            ),
            tile_seq={
                g: torch.zeros(n, dtype=torch.int32, device=device) for g, n in tiles.items()
            },
            tile_start={
                g: torch.zeros(n, dtype=torch.int32, device=device) for g, n in tiles.items()
            },
            decode_seqs=torch.zeros(max_seqs, dtype=torch.int32, device=device),
            part_o=part_o,
            part_lse=part_lse,
            more_slot_mappings=[
                torch.full((max_tokens,), -1, dtype=torch.int64, device=device) for _ in more
            ],
            more_block_tables=[
                torch.zeros(max_seqs + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
                for _ in more
            ],
            mla=self._mla_mixed_buffers(max_tokens, max_seqs),
        )

    def _mixed_tile_count(self, num_tokens: int, max_seqs: int, group: int) -> int:
        return _cdiv(num_tokens, self._tile_shape(group)[1]) + min(num_tokens, max_seqs)

    def _mixed_splits(self, num_tokens: int, max_seqs: int, max_ctx: int) -> int:
        """Context splits of a mixed graph's decode slots at num_tokens: the eager policy for
        as many decodes as it has slots, at the longest context the buffers hold."""
        return self._plan_splits(min(num_tokens, max_seqs), max_ctx)[0]

    def _mixed_buffers(self, num_tokens: int) -> _MixedBuffers:
        m = self._mixed
        if m is None:
            raise RuntimeError(f"{self.name}: init_mixed_graph_buffers() must run first")
        if not 1 <= num_tokens <= m.max_tokens:
            raise ValueError(
                f"{self.name}: {num_tokens} tokens is outside the mixed graph buffers' "
                f"1..{m.max_tokens}"
            )
        return m

    def _mixed_plan(self, m: _MixedBuffers, num_tokens: int) -> _Plan:
        tiles = {}
        slots = min(num_tokens, m.max_seqs)
        for group in self._plain_groups:
            block_m, block_q = self._tile_shape(group)
            count = self._mixed_tile_count(num_tokens, m.max_seqs, group)
            seq, start = m.tile_seq[group][:count], m.tile_start[group][:count]
            tiles[group] = [_Tiles(block_m, block_q, seq, start, count)]
        splits = self._mixed_splits(num_tokens, m.max_seqs, m.max_blocks * self.block_size)
        return _Plan(
            slot_mapping=m.slot_mapping[:num_tokens],
            query_start=m.query_start,
            context_len=m.context_len,
            block_table=m.block_table,
            decode_seqs=m.decode_seqs[:slots],
            num_decode=slots,
            all_decode=False,
            num_splits=splits,
            split_len=self._graph_split_len(),
            part_o=m.part_o if splits > 1 else None,
            part_lse=m.part_lse if splits > 1 else None,
            tiles=tiles,
            seq_split=True,
            **_group_fields(
                m.slot_mapping[:num_tokens],
                m.block_table,
                [t[:num_tokens] for t in m.more_slot_mappings],
                m.more_block_tables,
            ),
        )

    def prepare_mixed_capture(self, num_tokens: int) -> None:
        m = self._mixed_buffers(num_tokens)
        m.slot_mapping.fill_(-1)
        for slots in m.more_slot_mappings:
            slots.fill_(-1)
        tile_lists = (*m.tile_seq.values(), *m.tile_start.values(), m.decode_seqs)
        for t in (m.query_start, m.context_len, *tile_lists):
            t.zero_()  # every tile on row 0, which has no queries and no context
        self._plan = self._mixed_plan(m, num_tokens)
        if m.mla is not None:
            mm = m.mla
            for t in (mm.tile_seq, mm.tile_start, mm.key_lo, mm.row0, mm.rows, mm.row_seq):
                t.zero_()
            mm.context_len.zero_()
            mm.merge_row.fill_(-1)
            self._mla_mixed_plan(m, num_tokens)

    def prepare_mixed_replay(self, batch: AttentionBatch, num_tokens: int) -> None:
        m = self._mixed_buffers(num_tokens)
        n, width = batch.block_table.shape
        real = sum(batch.query_lens)
        if real > num_tokens or n > min(num_tokens, m.max_seqs) or width > m.max_blocks:
            raise ValueError(
                f"{self.name}: a mixed replay of {num_tokens} tokens takes at most that many "
                f"tokens, {min(num_tokens, m.max_seqs)} sequences and {m.max_blocks} blocks "
                f"each; got {real} tokens of {n} sequences, {width} blocks wide"
            )
        # Row n is the empty sequence: no queries (query_start repeats), no context.
        query_start = [0]
        for q in batch.query_lens:
            query_start.append(query_start[-1] + q)
        one_query = [i for i, q in enumerate(batch.query_lens) if q == 1]
        more = [i for i, q in enumerate(batch.query_lens) if q != 1]
        slots = min(num_tokens, m.max_seqs)
        parts = [
            query_start + [real],
            list(batch.context_lens) + [0],
            one_query + [n] * (slots - len(one_query)),
        ]
        dests = [m.query_start[: n + 2], m.context_len[: n + 1], m.decode_seqs[:slots]]
        if m.mla is not None:
            self._mla_replay(m.mla, batch, num_tokens, query_start, parts, dests)
        for group in self._plain_groups:
            count = self._mixed_tile_count(num_tokens, m.max_seqs, group)
            seqs, starts = self._tiles_of(batch.query_lens, more, self._tile_shape(group)[1])
            pad = count - len(seqs)
            parts += [seqs + [n] * pad, starts + [0] * pad]
            dests += [m.tile_seq[group][:count], m.tile_start[group][:count]]
        packed, at = pack_aligned(parts, torch.int32)
        packed = _pinned(packed)
        for dest, offset, part in zip(dests, at, parts, strict=True):
            dest.copy_(packed[offset : offset + len(part)], non_blocking=True)
        # Rows past n keep older ids: every one a valid block, and never read.
        tables = [(batch.slot_mapping, batch.block_table, m.slot_mapping, m.block_table)]
        if m.more_block_tables:
            if len(batch.group_block_tables) != len(self.groups):
                raise ValueError(
                    f"{self.name}: a mixed replay of a model of {len(self.groups)} KV groups "
                    f"takes every group's tables; got {len(batch.group_block_tables)}"
                )
            tables += zip(
                batch.group_slot_mappings[1:],
                batch.group_block_tables[1:],
                m.more_slot_mappings,
                m.more_block_tables,
                strict=True,
            )
        for slot_mapping, table, dest_slots, dest_table in tables:
            padded = torch.full((num_tokens,), -1, dtype=torch.int64)
            padded[:real] = slot_mapping
            dest_slots[:num_tokens].copy_(_pinned(padded), non_blocking=True)
            dest_table[:n, : table.shape[1]].copy_(_pinned(table), non_blocking=True)
        self._plan = self._mixed_plan(m, num_tokens)
        if m.mla is not None:
            self._mla_mixed_plan(m, num_tokens)

    @staticmethod
    def _no_new_tokens(plan: _Plan) -> dict[str, Any]:
        """The decode kernel's ROTARY arguments when it does not rotate: never read."""
        unused = plan.slot_mapping
        return {
            "k_new_ptr": unused,
            "v_new_ptr": unused,
            "slot_ptr": unused,
            "positions_ptr": unused,
            "cos_sin_ptr": unused,
            "stride_kt": 0,
            "stride_kh": 0,
            "stride_vt": 0,
            "stride_vh": 0,
            "stride_cos_sin": 0,
            "ROTARY": False,
        }

    def _graph_buffers(self, batch_size: int) -> _GraphBuffers:
        return checked_graph_buffers(self, batch_size)

    # -- MLA layers (DeepSeek-V2) --------------------------------------------------------------
    #
    # One cache row a token (latent + rope key), written by mla_write_kernel. One-query rows
    # (decodes) attend in the absorbed form through mla_decode's kernels, over the plan's block
    # tables and context lengths (a decode graph's static ones); rows of longer chunks attend in
    # the plain form through mla_prefill (their contexts expanded through kv_b_proj, in passes
    # of at most mla_context_rows gathered rows), planned per eager step. Mixed-step graphs
    # expand only the step's own rows, a shape fixed by the token count: a fresh prompt attends
    # them alone, a chunk over a cached prefix its own rows there (plain) and its prefix as
    # extra absorbed rows beside the decodes, the two parts merged by log-sum-exp in the W_UV
    # kernel; steps with more such rows than mla_prefix_rows run eagerly (takes_mixed_step).

    # MLA decode: fewest context tokens per split, most splits per sequence (64: the
    # fastest or within ~1 µs of it at 1 and 16 rows of 128-2048 tokens on an H100,
    # docs/ARCHITECTURE.md).
    mla_min_split_len = 64
    mla_max_splits = 16
    # MLA decode: W_UK and W_UV in Triton kernels, the latter fused into the split combine
    # (mla_decode_absorbed's fused form); off: cuBLAS einsums around mla_decode.
    mla_fused_absorb = True
    # MLA prefill: context rows expanded a pass where a chunk has a cached prefix (or the
    # step's tokens, if more), so expanded keys and values stay within what a step of fresh
    # prompts uses.
    mla_context_rows = 8192
    # Mixed graphs: the most rows of chunks over a cached prefix (prefix hits, continued
    # chunks) a step may hold in all to replay one (0: none; such steps run eagerly). In a
    # graph their prefix attends in the absorbed form, rows x prefix x (2 rank + rope)
    # multiply-adds a head, against the eager plain form's prefix x rank x (nope + v) for the
    # expansion plus rows x prefix x (nope + rope + v): both grow with the prefix, and the
    # absorbed form costs less while rows < rank (nope + v) / (2 rank - nope - v), 170 at V2's
    # widths (512, 128, 64, 128) whatever the prefix. 128 stays under that (the absorbed
    # kernel re-reads the prefix a row, 16 head rows a tile, where the expansion is one GEMM)
    # and bounds the graphs' absorbed rows. FLOPs only: not yet timed on a GPU.
    mla_prefix_rows = 128

    def _mla_init(self) -> None:
        self._mla = any(s.kind == "mla" for s in self.layers)
        self._mla_plan: _Plan | None = None  # the plan whose prompt rows _mla_prefill covers
        self._mla_prefill: PrefillPlan | None = None
        # mla_prefill_kernel's tile and launch, and whether it reads by TMA (a Hopper GPU;
        # layers whose widths TMA cannot take read by pointers).
        self.mla_prefill_config = (
            DenseConfig(16, 16, 4, 1) if self.interpret else MLA_PREFILL_CONFIG
        )
        device = torch.device(self.device)
        self.mla_prefill_tma = device.type == "cuda" and _has_tma(device)
        self._mla_decodes: _MLADecodes | None = None  # the decode rows of _mla_plan
        # GQA group sizes of the layers that are not MLA (the plain kernels' tiles)
        self._plain_groups = sorted(
            {s.num_q_heads // s.num_kv_heads for s in self.layers if s.kind != "mla"}
        )
        if self._mla and len(self.groups) > 1:
            self.supports_mixed_graphs = False  # see _mla_refuse_mixed
        if all(s.kind == "mla" for s in self.layers):
            self.dense_prefill = False  # no layer for it (nor its warm-up prompts)

    def _mla_refuse_mixed(self) -> None:
        if self._mla and len(self.groups) > 1:
            raise NotImplementedError(
                f"{self.name}: mixed-step CUDA graphs take MLA layers in a model of one KV "
                f"group; this one has {len(self.groups)}"
            )

    def takes_mixed_step(self, query_lens: list[int], context_lens: list[int]) -> bool:
        """AttentionBackend.takes_mixed_step: with MLA layers, steps whose chunks over a cached
        prefix (more than one query, context longer) have at most mla_prefix_rows rows in all
        (the mixed buffers' when they exist), fresh prompts and decodes beside them; any step
        otherwise."""
        if not self._mla:
            return True
        rows = sum(q for q, c in zip(query_lens, context_lens, strict=True) if 1 < q < c)
        return rows <= self._mla_prefix_rows()

    def _mla_prefix_rows(self) -> int:
        """Chunk rows over a cached prefix a mixed graph takes: mla_prefix_rows (as the mixed
        buffers were sized, once they are), none without the fused absorbed form (whose W_UV
        kernel merges the two parts)."""
        if not self.mla_fused_absorb:
            return 0
        m = self._mixed
        if m is not None and m.mla is not None:
            return min(m.mla.prefix_rows, self.mla_prefix_rows)
        return self.mla_prefix_rows

    def _mla_mixed_buffers(self, max_tokens: int, max_seqs: int) -> _MLAMixed | None:
        if not self._mla:
            return None
        device = self.device
        tiles = self._mla_tile_count(max_tokens, max_seqs)
        prefix_rows = self.mla_prefix_rows if self.mla_fused_absorb else 0
        rows = self._mla_rows(max_tokens, max_seqs, prefix_rows)
        return _MLAMixed(
            tile_seq=torch.zeros(tiles, dtype=torch.int32, device=device),
            tile_start=torch.zeros(tiles, dtype=torch.int32, device=device),
            key_lo=torch.zeros(max_seqs + 1, dtype=torch.int32, device=device),
            row0=torch.zeros(max_seqs + 1, dtype=torch.int32, device=device),
            rows=torch.zeros(2 * rows, dtype=torch.int64, device=device),
            row_seq=torch.zeros(rows, dtype=torch.int32, device=device),
            context_len=torch.zeros(rows, dtype=torch.int32, device=device),
            merge_row=torch.full((rows,), -1, dtype=torch.int32, device=device),
            prefix_rows=prefix_rows,
        )

    @staticmethod
    def _mla_rows(num_tokens: int, max_seqs: int, prefix_rows: int) -> int:
        """Absorbed rows of a mixed graph of num_tokens: a decode slot a sequence it can hold
        and prefix_rows chunk rows, never more than its tokens (every such row is a token)."""
        return min(num_tokens, min(num_tokens, max_seqs) + prefix_rows)

    def _mla_tile_count(self, num_tokens: int, max_seqs: int) -> int:
        """mla_prefill_kernel's tiles a head in a mixed graph of num_tokens: the most that
        many tokens' prompts can need."""
        block_m = self.mla_prefill_config.block_m
        return _cdiv(num_tokens, block_m) + min(num_tokens, max_seqs)

    def _mla_mixed_plan(self, m: _MixedBuffers, num_tokens: int) -> None:
        """The MLA prefill plan and absorbed rows of a mixed graph of num_tokens, over the
        static buffers: one pass over the step's own rows (position p of sequence i at row
        row0[i] + p, from key_lo[i]), chunks' pieces kept for the absorbed rows to merge."""
        mm = m.mla
        assert mm is not None and self._plan is not None
        count = self._mla_tile_count(num_tokens, m.max_seqs)
        rows = self._mla_rows(num_tokens, m.max_seqs, mm.prefix_rows)
        own_rows = PrefillPass(
            slots=None,
            num_rows=num_tokens,
            key_lo=mm.key_lo,
            key_hi=m.context_len,
            row0=mm.row0,
            tile_seq=mm.tile_seq[:count],
            tile_start=mm.tile_start[:count],
            tiles=count,
        )
        self._mla_prefill = PrefillPlan(
            [own_rows], self.mla_prefill_config.block_m, chunks=mm.prefix_rows > 0
        )
        self._mla_decodes = _MLADecodes(
            q_rows=mm.rows[:rows],
            out_rows=mm.rows[rows : 2 * rows],
            tables=[m.block_table],
            context_len=mm.context_len[:rows],
            row_seq=mm.row_seq[:rows],
            merge_row=mm.merge_row[:rows] if mm.prefix_rows else None,
        )
        self._mla_plan = self._plan

    def _mla_replay(
        self,
        mm: _MLAMixed,
        batch: AttentionBatch,
        num_tokens: int,
        query_start: list[int],
        parts: list[list[int]],
        dests: list[torch.Tensor],
    ) -> None:
        """prepare_mixed_replay's MLA part: the prompt tiles, each sequence's key_lo and row0,
        and the absorbed rows' sequences, contexts and merge rows join its packed copy (parts,
        dests); their query and output rows are copied here. Absorbed rows: the decodes, then
        the rows of chunks over a cached prefix (context: the prefix; merged with their own
        rows' plain part), then unused ones."""
        query_lens, context_lens = batch.query_lens, batch.context_lens
        if not self.takes_mixed_step(query_lens, context_lens):
            raise ValueError(
                f"{self.name}: a mixed graph of MLA layers takes chunks over a cached prefix of "
                f"at most {self._mla_prefix_rows()} rows in all (mla_prefix_rows) beside fresh "
                f"prompts and decodes; got chunks of {query_lens} tokens with contexts "
                f"{context_lens}"
            )
        n = len(query_lens)
        one_query = [i for i, q in enumerate(query_lens) if q == 1]
        more = [i for i, q in enumerate(query_lens) if q != 1]
        prefix = [c - q if q > 1 else 0 for q, c in zip(query_lens, context_lens, strict=True)]
        max_seqs = mm.key_lo.shape[0] - 1
        count = self._mla_tile_count(num_tokens, max_seqs)
        seqs, starts = query_tiles(query_lens, more, self.mla_prefill_config.block_m)
        pad = count - len(seqs)
        # absorbed rows: (query row, sequence, context, merge row)
        absorbed = [(query_start[i], i, context_lens[i], -1) for i in one_query]
        for i in more:
            if prefix[i]:
                at = query_start[i]
                absorbed += [(at + j, i, prefix[i], at + j) for j in range(query_lens[i])]
        rows = self._mla_rows(num_tokens, max_seqs, mm.prefix_rows)
        unused = rows - len(absorbed)
        assert unused >= 0, (rows, len(absorbed))
        q_rows = [a[0] for a in absorbed]
        row_seq, ctx, merge = ([a[k] for a in absorbed] for k in (1, 2, 3))
        parts += [
            seqs + [n] * pad,
            starts + [0] * pad,
            prefix + [0],
            [query_start[i] - prefix[i] for i in range(n)] + [query_start[n]],
            row_seq + [n] * unused,
            ctx + [0] * unused,
            merge + [-1] * unused,
        ]
        dests += [
            mm.tile_seq[:count],
            mm.tile_start[:count],
            mm.key_lo[: n + 1],
            mm.row0[: n + 1],
            mm.row_seq[:rows],
            mm.context_len[:rows],
            mm.merge_row[:rows],
        ]
        both = q_rows + [0] * unused + q_rows + [num_tokens] * unused
        mm.rows[: 2 * rows].copy_(_pinned(torch.tensor(both, dtype=torch.int64)), non_blocking=True)

    def _mla_begin_step(self, batch: AttentionBatch) -> None:
        """A step with prompt rows: their MLA prefill's passes and tiles, and the decode
        rows' query rows, tables and contexts."""
        plan = self._plan
        if self._mla and plan is not None and not plan.all_decode:
            self._mla_prefill = plan_prefill(
                batch.query_lens,
                batch.context_lens,
                batch.block_tables,
                self.block_size,
                self.mla_prefill_config.block_m,
                max(self.mla_context_rows, sum(batch.query_lens)),
                self.device,
            )
            self._mla_decodes = None
            if plan.num_decode:
                seqs = plan.decode_seqs.long()
                at = plan.query_start.index_select(0, seqs).long()
                tables = plan.group_block_tables or [plan.block_table]
                self._mla_decodes = _MLADecodes(
                    q_rows=at,
                    out_rows=at,
                    tables=[t.index_select(0, seqs) for t in tables],
                    context_len=plan.context_len.index_select(0, seqs),
                )
            self._mla_plan = plan

    def _mla_splits(self, num_decode: int) -> int:
        """Context splits per decode row: fixed by the row count (a graph's grid), each
        sequence splitting its own context in at least mla_min_split_len tokens."""
        wanted = _cdiv(self.target_programs, max(num_decode, 1))
        return max(1, min(wanted, self.mla_max_splits, self.max_splits))

    def _forward_mla(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        parts: dict[str, Any] | None,
    ) -> torch.Tensor:
        """An MLA layer's step: q [T, H, nope + rope], k [T, 1, rank + rope] (the cache row)
        -> [T, H, v_head_dim]."""
        if rotary is not None or parts:
            raise ValueError(
                f"{self.name}: an MLA layer rotates its rope part itself and calls forward(); "
                "the fused rotary and q, k, v partial sums are not for MLA layers"
            )
        plan = self._plan
        mla = layer.mla
        if plan is None:
            raise RuntimeError("triton attention: begin_step() must run before forward()")
        assert mla is not None
        cache = self.caches[layer.index]
        block_table, slot_mapping = plan.block_table, plan.slot_mapping
        if plan.group_block_tables:
            block_table = plan.group_block_tables[layer.group]
            slot_mapping = plan.group_slot_mappings[layer.group]
        num_tokens = q.shape[0]
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"triton attention: {num_tokens} tokens but the step's slot_mapping has "
                f"{slot_mapping.shape[0]}"
            )
        rows = k[:, 0]
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        # An e4m3 cache: one scale for the row (k_scale; 1.0 where the layer has none), read
        # by pointer, so decode graphs replay with the loaded value.
        k_scale = None
        if cache.dtype == torch.float8_e4m3fn:
            k_scale = self._one if layer.k_scale is None else layer.k_scale
        write_latent(rows, cache, slot_mapping, k_scale)
        decode: dict[str, Any] = {"num_splits": self._mla_splits(plan.num_decode)}
        decode["k_scale"] = k_scale
        decode["min_split_len"] = self.mla_min_split_len
        decode["fused"] = self.mla_fused_absorb
        if plan.all_decode:  # decode i is sequence i and query row i
            return mla_decode_absorbed(
                q, cache, block_table, plan.context_len, mla, layer.scale, **decode
            )
        if self._mla_plan is not plan:
            raise RuntimeError(f"{self.name}: MLA prompt rows need begin_step()'s prefill plan")
        # one spare row past the step's: a mixed graph's unused decode slots write there
        spare = q.new_empty(num_tokens + 1, q.shape[1], mla.v_head_dim)
        out = spare[:num_tokens]
        dec = self._mla_decodes
        prefill = self._mla_prefill
        pieces = None
        if prefill is not None:
            if layer.group and any(p.slots is not None for p in prefill.passes):
                raise NotImplementedError(
                    f"{self.name}: an MLA prefill over cached prefixes reads KV group 0's block "
                    f"tables; layer {layer.index} is in group {layer.group}"
                )
            rope = layer.spec.rope_dim or 0
            tma = self.mla_prefill_tma and can_tma(mla.qk_nope_head_dim, rope, mla.v_head_dim)
            config = self.mla_prefill_config
            pieces = mla_prefill(
                q,
                rows,
                cache,
                mla,
                layer.scale,
                prefill,
                plan.query_start,
                plan.context_len,
                out,
                config.block_n,
                {"num_warps": config.num_warps, "num_stages": config.num_stages},
                tma,
                k_scale,
            )
        # after the prefill: a mixed graph's chunk rows merge its pieces with their prefix
        if dec is not None:
            q_dec = q.index_select(0, dec.q_rows)
            table = dec.tables[layer.group]
            if dec.row_seq is not None:
                decode["row_seq"] = dec.row_seq
            if dec.merge_row is not None and self.mla_fused_absorb:  # (else no chunk rows)
                assert pieces is not None and prefill is not None and prefill.chunks
                decode["merge"] = (*pieces, dec.merge_row)
            o = mla_decode_absorbed(
                q_dec, cache, table, dec.context_len, mla, layer.scale, **decode
            )
            spare.index_copy_(0, dec.out_rows, o)
        return out

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        return self._forward(layer, q, k, v, None)

    def takes_qkv_parts(self) -> bool:
        """Decode-only steps with the rotary in the decode kernel, when qkv_parts is on."""
        plan = self._plan
        return (
            self.qkv_parts
            and self.decode_rotary
            and plan is not None
            and plan.all_decode
            and plan.num_decode > 0
        )

    def forward_with_rotary(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        keep_splits: bool = False,
    ) -> torch.Tensor | SplitAttention:
        dim = q.shape[-1]
        if dim % 2 or q.dtype != k.dtype:
            raise ValueError(
                f"triton attention: the fused rotary needs an even head dim and q, k of one "
                f"dtype; got {dim}, {q.dtype} and {k.dtype}"
            )
        if cos_sin.shape[-1] != dim or cos_sin.dtype != torch.float32:
            raise ValueError(
                f"triton attention: cos_sin must be [positions, {dim}] float32, got "
                f"{tuple(cos_sin.shape)} {cos_sin.dtype}"
            )
        rotary = (positions, cos_sin)
        if q.dim() == 4 or bias is not None:
            return self._forward_parts(layer, (q, k, v), rotary, bias, keep_splits)
        return self._forward(layer, q, k, v, rotary, keep_splits=keep_splits)

    def _forward_parts(
        self,
        layer: AttentionLayer,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        rotary: tuple[torch.Tensor, torch.Tensor],
        bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        keep_splits: bool = False,
    ) -> torch.Tensor | SplitAttention:
        """forward_with_rotary of q, k, v as [parts, T, heads, dim] partial sums (+ bias)."""
        q = qkv[0]
        if not self.takes_qkv_parts():
            raise ValueError(
                "triton attention: q, k, v as partial sums (or with a bias) are taken only in "
                "steps where takes_qkv_parts() is true"
            )
        parts = q.shape[0] if q.dim() == 4 else 1
        views = [x if x.dim() == 4 else x.unsqueeze(0) for x in qkv]
        if any(x.shape[0] != parts or x.stride(-1) != 1 for x in views):
            raise ValueError(
                f"triton attention: q, k, v must be [{parts}, tokens, heads, dim] with the head "
                f"dim contiguous; got {[tuple(x.shape) for x in views]}"
            )
        spec = layer.spec
        if bias is not None:
            sizes = (spec.num_q_heads * spec.head_dim, *(spec.num_kv_heads * spec.head_dim,) * 2)
            if any(b.shape != (n,) or b.stride(0) != 1 for b, n in zip(bias, sizes, strict=True)):
                raise ValueError(
                    f"triton attention: the q, k, v biases must be contiguous vectors of "
                    f"{sizes}; got {[tuple(b.shape) for b in bias]}"
                )
        extra = {
            "stride_qp": views[0].stride(0),
            "stride_kp": views[1].stride(0),
            "stride_vp": views[2].stride(0),
            "PARTS": parts,
            "HAS_BIAS": bias is not None,
        }
        if bias is not None:
            extra |= {"q_bias_ptr": bias[0], "k_bias_ptr": bias[1], "v_bias_ptr": bias[2]}
        q0, k0, v0 = (x[0] for x in views)
        return self._forward(layer, q0, k0, v0, rotary, extra, keep_splits)

    def _pdl(self, plan: _Plan, spec: KVLayerSpec) -> dict[str, Any]:
        """The decode kernel and the reduce let the kernel after them launch early (o_proj's
        GEMV, or the reduce at pdl.ALL_ROWS), when that one launches with PDL
        (inferx_kernels_cuda.pdl). Only the CUDA-graph plans of decode-only steps (seq_split)
        take the per-row choices, which were measured there. In a step with prompt tokens
        (eager past the mixed graphs' sizes) the prefill kernel comes next, and a variant by
        its decode count compiled mid-run (a large loss offline); eager decode-only steps (no
        graphs, or past their sizes) would compile variants of their own at start-up's
        warm-up."""
        width = spec.num_q_heads * spec.head_dim
        return between_launch(torch.device(self.device), _graph_decode_rows(plan), width)

    def _decode_pdl(self, plan: _Plan, spec: KVLayerSpec) -> dict[str, Any]:
        """The decode kernel's PDL arguments: _pdl's, or where pdl.ATTENTION_ROWS takes a
        CUDA-graph decode-only step's rows (the QKV GEMV then triggers) a PDL launch that loads
        the step's metadata before its wait (EARLY)."""
        if attention_early(torch.device(self.device), _graph_decode_rows(plan)):
            return {"PDL": True, "TRIGGER": True, "launch_pdl": True, "EARLY": True}
        return self._pdl(plan, spec)

    def _decode_launch_pdl(
        self, plan: _Plan, spec: KVLayerSpec, rotary: bool, fp8: bool = False
    ) -> dict[str, Any]:
        """_decode_pdl's arguments, with PRELOAD at preload_rows (preload_fp8_rows over an
        e4m3 cache: `fp8`) where the kernel launches early (EARLY) and rotates and writes the
        new token itself (`rotary`: only then can it take that token's row of a tile loaded
        before its wait)."""
        args = self._decode_pdl(plan, spec)
        rows = self.preload_fp8_rows if fp8 else self.preload_rows
        if args.get("EARLY") and rotary and in_ranges(plan.num_decode, rows):
            args = args | {"PRELOAD": True}
        return args

    def _reduce(
        self, plan: _Plan, spec: KVLayerSpec, out: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        """Combine the decode kernel's context splits into out [T, heads, dim] (with the
        layer's learned sinks, if any); returns out."""
        # Eager steps pad to the most splits there can be: one compiled variant.
        splits_pad = triton.next_power_of_2(plan.num_splits if plan.seq_split else self.max_splits)
        heads = self._reduce_heads(spec.num_q_heads, splits_pad)
        kernels.decode_reduce_kernel[(plan.num_decode, spec.num_q_heads // heads)](
            plan.part_o,
            plan.part_lse,
            out,
            plan.context_len,
            plan.query_start,
            plan.decode_seqs,
            plan.split_len,
            plan.num_splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=spec.head_dim,
            SPLITS_PAD=splits_pad,
            HEADS=heads,
            SEQ_SPLIT=plan.seq_split,
            BLOCK_N=self.decode_block_n,
            ALL_DECODE=plan.all_decode,
            **self.reduce_launch,
            **self._pdl(plan, spec),
            **({} if sinks is None else {"sinks_ptr": sinks, "SINKS": True}),
        )
        return out

    def _dense_prefill(
        self,
        tiles: _Tiles,
        plan: _Plan,
        spec: KVLayerSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        scale_log2: float,
        extra: dict[str, Any],
    ) -> None:
        """dense_prefill_kernel over the fresh prompts' tiles: q, k, v as [tokens, heads, dim]
        (k as the cache holds it), through TMA descriptors."""
        group = spec.num_q_heads // spec.num_kv_heads
        config = plan.dense_config
        assert config is not None
        dim, block_n = spec.head_dim, config.block_n
        q_desc = TensorDescriptor.from_tensor(q, block_shape=[tiles.block_q, group, dim])
        k_desc = TensorDescriptor.from_tensor(k, block_shape=[block_n, 1, dim])
        v_desc = TensorDescriptor.from_tensor(v, block_shape=[block_n, 1, dim])
        kernels.dense_prefill_kernel[(tiles.count, spec.num_kv_heads)](
            q_desc,
            k_desc,
            v_desc,
            out,
            plan.query_start,
            tiles.seq,
            tiles.start,
            scale_log2,
            out.stride(0),
            out.stride(1),
            GROUP=group,
            HEAD_DIM=dim,
            BLOCK_Q=tiles.block_q,
            BLOCK_N=block_n,
            UPCAST=self._upcast,
            DOT_PRECISION=self._dot_precision,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **extra,
        )

    def _fp8_args(self, layer: AttentionLayer, cache: torch.Tensor) -> dict[str, Any]:
        """The kernels' arguments for the layer's cache: none for one in the model's dtype,
        fp8_kv_args for an e4m3 one."""
        if cache.dtype != torch.float8_e4m3fn:
            return {}
        return fp8_kv_args(layer, self._one, self.interpret)

    def _forward(
        self,
        layer: AttentionLayer,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        parts: dict[str, Any] | None = None,
        keep_splits: bool = False,
    ) -> torch.Tensor | SplitAttention:
        """Attention of one layer. keep_splits: in a decode-only step whose context is split,
        return the splits (a SplitAttention whose reduce() launches the combine) instead of
        combining them here."""
        if layer.mla is not None:
            return self._forward_mla(layer, q, k, rotary, parts)
        plan = self._plan
        if plan is None:
            raise RuntimeError("triton attention: begin_step() must run before forward()")
        spec = layer.spec
        cache = self.caches[layer.index]
        k_cache, v_cache = cache[0], cache[1]
        block_table, slot_mapping = plan.block_table, plan.slot_mapping
        if plan.group_block_tables:
            block_table = plan.group_block_tables[layer.group]
            slot_mapping = plan.group_slot_mappings[layer.group]
        # Sliding windows and sinks: constexpr flags, absent (the plain kernels) without them.
        features: dict[str, Any] = {}
        if spec.kind == "sliding":
            features["WINDOW"] = spec.window
        if layer.sinks is not None:
            features |= {"sinks_ptr": layer.sinks, "SINKS": True}
        fp8 = self._fp8_args(layer, k_cache)
        features |= fp8
        # Kernels take any row and head strides (q, k, v are often views of one fused
        # projection) but need each head's dim contiguous.
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        num_tokens = q.shape[0]
        out = q.new_empty(num_tokens, spec.num_q_heads, spec.head_dim)
        if num_tokens == 0:
            return out
        if slot_mapping.shape[0] != num_tokens:
            raise ValueError(
                f"triton attention: {num_tokens} tokens but the step's slot_mapping has "
                f"{slot_mapping.shape[0]}"
            )

        # The decode kernel rotates and writes the new tokens itself (ROTARY) in decode-only
        # steps when decode_rotary is on (then q is not rotated in place).
        in_decode = (
            rotary is not None
            and self.decode_rotary
            and plan.all_decode
            and plan.num_decode == num_tokens
        )
        if rotary is None:
            write_kv(k, v, k_cache, v_cache, slot_mapping, spec, fp8)
        elif in_decode:
            positions, cos_sin = rotary[0], rotary[1].contiguous()
            new_tokens = {
                "k_new_ptr": k,
                "v_new_ptr": v,
                "slot_ptr": slot_mapping,
                "positions_ptr": positions.contiguous(),
                "cos_sin_ptr": cos_sin,
                "stride_kt": k.stride(0),
                "stride_kh": k.stride(1),
                "stride_vt": v.stride(0),
                "stride_vh": v.stride(1),
                "stride_cos_sin": cos_sin.stride(0),
                "ROTARY": True,
            }
        else:
            positions, cos_sin = rotary
            half = spec.head_dim // 2
            half_pad = triton.next_power_of_2(half)
            most_heads = triton.next_power_of_2(max(spec.num_q_heads, spec.num_kv_heads))
            cos_sin = cos_sin.contiguous()
            kernels.rotary_kv_write_kernel[(num_tokens,)](
                q,
                k,
                v,
                k_cache,
                v_cache,
                slot_mapping,
                positions.contiguous(),
                cos_sin,
                spec.num_q_heads,
                spec.num_kv_heads,
                q.stride(0),
                q.stride(1),
                k.stride(0),
                k.stride(1),
                v.stride(0),
                v.stride(1),
                k_cache.stride(1),
                k_cache.stride(2),
                cos_sin.stride(0),
                HALF=half,
                HALF_PAD=half_pad,
                HEADS_BLOCK=min(
                    triton.next_power_of_2(most_heads), max(1, _ROTARY_TILE // half_pad)
                ),
                HEADS_PAD=triton.next_power_of_2(spec.num_kv_heads),
                HEAD_DIM=spec.head_dim,
                K_IN_PLACE=bool(plan.dense_tiles),
                **fp8,
            )

        group = spec.num_q_heads // spec.num_kv_heads
        scale_log2 = layer.scale * _LOG2E
        dense = plan.dense_tiles.get(group)
        if dense is not None:
            self._dense_prefill(dense, plan, spec, q, k, v, out, scale_log2, features)
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        if plan.num_decode:
            split = plan.num_splits > 1
            kernels.decode_kernel[(plan.num_decode, spec.num_kv_heads, plan.num_splits)](
                q,
                k_cache,
                v_cache,
                out,
                plan.part_o if split else out,
                plan.part_lse if split else out,
                block_table,
                plan.context_len,
                plan.query_start,
                plan.decode_seqs,
                scale_log2,
                plan.split_len,
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
                block_table.stride(0),
                *cache_strides,
                GROUP=group,
                GROUP_PAD=max(16, triton.next_power_of_2(group)),
                HEAD_DIM=spec.head_dim,
                BLOCK_SIZE=self.block_size,
                BLOCK_N=self.decode_block_n,
                SPLIT=split,
                SEQ_SPLIT=plan.seq_split,
                ALL_DECODE=plan.all_decode,
                UPCAST=self._upcast,
                DOT_PRECISION=self._dot_precision,
                **(new_tokens if in_decode else self._no_new_tokens(plan)),
                **(parts or {}),
                **self.decode_launch,
                **self._decode_launch_pdl(plan, spec, in_decode, bool(fp8)),
                **features,
            )
            # The sinks join the splits' combine, which o_proj's own combine does not know.
            keep = keep_splits and in_ranges(plan.num_decode, self.keep_split_rows)
            keep = keep and layer.sinks is None
            if split and keep and plan.all_decode:
                return SplitAttention(
                    part_o=plan.part_o,
                    part_lse=plan.part_lse,
                    context_len=plan.context_len,
                    rows=num_tokens,
                    heads=spec.num_q_heads,
                    head_dim=spec.head_dim,
                    splits=plan.num_splits,
                    split_len=plan.split_len,
                    seq_split=plan.seq_split,
                    tile=self.decode_block_n,
                    reduce=lambda: self._reduce(plan, spec, out, None),
                )
            if split:
                self._reduce(plan, spec, out, layer.sinks)

        for tiles in plan.tiles.get(group, []):
            kernels.prefill_kernel[(tiles.count, spec.num_kv_heads)](
                q,
                k_cache,
                v_cache,
                out,
                block_table,
                plan.context_len,
                plan.query_start,
                tiles.seq,
                tiles.start,
                scale_log2,
                q.stride(0),
                q.stride(1),
                out.stride(0),
                out.stride(1),
                block_table.stride(0),
                *cache_strides,
                GROUP=group,
                HEAD_DIM=spec.head_dim,
                BLOCK_SIZE=self.block_size,
                BLOCK_M=tiles.block_m,
                BLOCK_Q=tiles.block_q,
                BLOCK_N=self.prefill_block_n,
                UPCAST=self._upcast,
                DOT_PRECISION=self._dot_precision,
                **self.prefill_options(group),
                **features,
            )
        return out
