"""The attention backend contract: owns the paged KV cache tensors and the attention kernels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from inferx_core.interfaces.kv import KVGroup, KVLayerSpec, kv_groups

# What a backend may support beyond plain full attention in the model's dtype
# (KVLayerSpec.needs() names what a layer requires).
FEATURES = ("sliding", "mla", "sinks", "softcap", "fp8_kv")


@dataclass(eq=False)
class MLAWeights:
    """An MLA layer's up-projection of its cached latent (kv_b_proj), in the two forms a
    backend attends with. expand(latent [N, kv_lora_rank]) -> [N, heads, qk_nope_head_dim +
    v_head_dim], each head's nope key then its value: the model's own linear layer (however
    quantized), for the plain form. w_uk [heads, qk_nope_head_dim, kv_lora_rank] and w_uv
    [heads, v_head_dim, kv_lora_rank]: the same weight as dense tensors in the model's dtype,
    for the absorbed form (q_nope @ w_uk scores against the latent, the latent-space output @
    w_uv.T gives the values' output); the model sets them once its weights are loaded."""

    qk_nope_head_dim: int
    v_head_dim: int
    expand: Callable[[torch.Tensor], torch.Tensor]
    w_uk: torch.Tensor | None = None
    w_uv: torch.Tensor | None = None


@dataclass(eq=False)
class AttentionLayer:
    """One attention layer as the backend sees it: its spec and what it attends with.

    Built by the model (one per layer, kept for the model's life) and passed to every forward().
    index: the layer's position in ModelArch.kv_layout (its cache); group: its KV group
    (kv_groups); scale: the softmax scale; sinks: [num_q_heads] float32 learned sink logits when
    spec.learned_sinks; k_scale / v_scale: [1] float32 dequantization scales of an fp8 cache;
    mla: the up-projection of an MLA layer's latent (spec.kind "mla"; None otherwise).
    """

    index: int
    spec: KVLayerSpec
    scale: float
    group: int = 0
    sinks: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    mla: MLAWeights | None = None


@dataclass
class AttentionBatch:
    """One step's layout, built by the executor. Sequences are packed in the order of the chunks.

    Host lists describe each sequence; the tensors are on the device, ready for kernels (or in
    pinned host memory for prepare_for_replay, which copies them to its static buffers).
    query_lens[i]: new tokens of sequence i this step; context_lens[i]: its tokens in the cache
    once this step has written them (start + query_len). slot_mapping[t]: the cache slot
    (block_id * block_size + offset) that new token t is written to.

    KV groups: block_tables, block_table and slot_mapping are group 0's. A model of several
    groups gets every group's in group_block_tables / group_slot_mappings (index 0: the same
    tensors as block_table / slot_mapping); a layer reads those of its AttentionLayer.group. They
    are empty for a single group, and also in the executor's profiling and warm-up steps, whose
    groups all read group 0's fields (dry runs over fresh blocks).
    """

    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start: torch.Tensor  # [num_seqs + 1] int32, cumulative query_lens
    # [num_seqs, max_blocks] int32; entries past a sequence's own blocks are padding, never read
    # (make_attention_batch writes 0; the CUDA-graph runner leaves older ids there)
    block_table: torch.Tensor
    context_len: torch.Tensor  # [num_seqs] int32
    group_block_tables: list[torch.Tensor] = field(default_factory=list)
    group_slot_mappings: list[torch.Tensor] = field(default_factory=list)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


@dataclass(frozen=True)
class SplitAttention:
    """A decode step's attention output not yet combined across its context splits, for an
    output projection that combines them itself (KernelOps.linear_parts takes it).
    part_o [rows * heads * splits, head_dim] and part_lse [rows * heads * splits] (float32,
    index (row * heads + head) * splits + split; lse in log2 units): each split's normalised
    output and log-sum-exp. context_len [rows] int32. A row's context is split_len tokens a
    split or, with seq_split, spread over the splits (at least split_len, whole tiles of `tile`
    tokens); splits past its context are unused. reduce() combines them into [rows, heads,
    head_dim] in the model's dtype, as the backend would have."""

    part_o: torch.Tensor
    part_lse: torch.Tensor
    context_len: torch.Tensor
    rows: int
    heads: int
    head_dim: int
    splits: int
    split_len: int
    seq_split: bool
    tile: int
    reduce: Callable[[], torch.Tensor]


class AttentionBackend(ABC):
    """Paged attention for every layer of one model.

    Built once with the model's per-layer specs; allocates the cache; is told each step's layout
    with begin_step() (plan kernels there, once per step); then forward() runs once per layer
    with that layer's AttentionLayer. The model never sees metadata or cache tensors.

    `features` says what the backend supports beyond plain full attention in the model's dtype
    (FEATURES; KVLayerSpec.needs() says what a layer requires): start-up refuses a model whose
    layers need what the chosen backend lacks, naming both (check_layers). A model whose layers
    form several KV groups (kv_groups) needs `supports_kv_groups`: forward() then reads the
    layer's group's block tables and slot mapping (AttentionBatch.group_block_tables).

    CUDA graphs (decode only) are optional: a backend that sets `supports_cuda_graphs` keeps the
    metadata of decode batches in static buffers, so that kernels captured once read each later
    step's layout. The executor calls init_graph_buffers() once, then prepare_for_capture(n)
    before capturing the forward passes of an n-sequence decode batch, and prepare_for_replay()
    before each replay. The defaults refuse, so a backend without graphs runs eagerly.

    Steps with prompt tokens (any query lengths) can be graphs too, over a padded token count:
    a backend that sets `supports_mixed_graphs` gets init_mixed_graph_buffers() once, then
    prepare_mixed_capture(t) before capturing a step of t tokens and prepare_mixed_replay()
    before each replay, with the same rules as the decode hooks; takes_mixed_step() may decline
    a step's layout (it then runs eagerly).

    Optional capabilities beside the contract (a model asks before it uses them):
    `fuses_rotary`: forward_with_rotary() takes q and k before the rotary embedding and rotates
    them as it writes the cache (one kernel instead of two per layer). Where takes_qkv_parts()
    says so for the current step, q, k and v may come as partial results of the QKV GEMM split
    along K, with its bias apart (QuantLinear.forward_split), and the backend sums them.
    `keeps_splits`: forward_with_rotary(..., keep_splits=True) from a layer whose output
    projection runs as K-slice parts may return a SplitAttention where its decode kernel split
    the context: the layer hands it to KernelOps.linear_parts, which may combine the splits
    inside the projection (one launch and its gap fewer a layer).

    A backend that sets `replays_on_current_stream` enqueues everything prepare_for_replay()
    does on the current stream and reads its static buffers only inside forward(): the decode
    runner may then make those copies on a stream of its own while the previous step's logits
    are still being computed (cuda_graphs.DecodeGraphRunner).
    """

    name: str = "attention backend"  # in error messages
    features: frozenset[str] = frozenset()
    supports_kv_groups: bool = False
    supports_cuda_graphs: bool = False
    replays_on_current_stream: bool = False
    supports_mixed_graphs: bool = False
    fuses_rotary: bool = False
    keeps_splits: bool = False
    # Fresh prompt lengths from which steps launch kernel variants of their own: start-up
    # warms one step of each that fits (compiling them then, not while serving).
    warm_up_prompt_lens: tuple[int, ...] = ()

    def __init__(
        self,
        layers: list[KVLayerSpec],
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.check_layers(layers)
        self.layers = layers
        self.groups: list[KVGroup] = kv_groups(layers)
        self._group_of = {i: g.index for g in self.groups for i in g.layers}
        self.block_size = block_size
        self.dtype = dtype
        self.device = device

    def layer(
        self,
        index: int,
        scale: float,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        mla: MLAWeights | None = None,
    ) -> AttentionLayer:
        """The AttentionLayer of layer `index` (its spec and KV group from this backend), for
        the model to keep and pass to forward(). An MLA layer (spec.kind "mla") must bring
        its `mla` weights, and no other layer may."""
        spec = self.layers[index]
        if (spec.kind == "mla") != (mla is not None):
            raise ValueError(
                f"layer {index} is a {spec.kind!r} layer: MLA weights are for, and required by, "
                "'mla' layers only"
            )
        return AttentionLayer(
            index, spec, scale, self._group_of[index], sinks, k_scale, v_scale, mla
        )

    @classmethod
    def check_layers(cls, layers: list[KVLayerSpec], model: str = "the model") -> None:
        """Raise NotImplementedError naming the layer, the feature and this backend when a
        layer needs a feature the backend lacks, or the layers form several KV groups and the
        backend reads one."""
        for i, spec in enumerate(layers):
            missing = spec.needs() - cls.features
            if missing:
                raise NotImplementedError(
                    f"{model} needs {', '.join(sorted(missing))} attention (layer {i}), which "
                    f"the {cls.name} backend does not support (it supports: "
                    f"{', '.join(sorted(cls.features)) or 'plain full attention'})"
                )
        groups = kv_groups(layers)
        if len(groups) > 1 and not cls.supports_kv_groups:
            kinds = ", ".join(g.kind + (f" {g.window}" if g.window else "") for g in groups)
            raise NotImplementedError(
                f"{model} has {len(groups)} KV cache groups ({kinds}), which the {cls.name} "
                "backend does not support (it reads one block table a sequence)"
            )

    @abstractmethod
    def bytes_per_block(self) -> int:
        """Device bytes one block takes across all layers (sizes the cache)."""

    @abstractmethod
    def allocate(self, num_blocks: int) -> None:
        """Create the cache tensors for `num_blocks` blocks, replacing any made before (start-up
        calls it more than once: a temporary cache for the profiling pass, then the real one)."""

    @abstractmethod
    def begin_step(self, batch: AttentionBatch) -> None:
        """Take this step's layout; prepare whatever the kernels need."""

    @abstractmethod
    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Write k, v ([T, Hkv, D]) to the layer's cache, attend q ([T, Hq, D]); return
        [T, Hq, Dv].

        Each sequence's queries attend causally to its cached context (a sliding layer: the
        last `window` tokens up to and including the query's own; learned sinks join the
        softmax as one more column per head).

        An MLA layer (spec.kind "mla", layer.mla set): q [T, Hq, qk_nope_head_dim + rope_dim]
        (each head's nope part, then its rotated rope part); k [T, 1, kv_lora_rank + rope_dim],
        what the cache stores: the normed latent, then the rotated rope key all heads share;
        v = k[..., :kv_lora_rank], the latent (no cache of its own). Keys are the latent
        expanded by layer.mla plus the shared rope key, values the expanded latent: the
        output is [T, Hq, v_head_dim], already through W_UV. The backend picks the form
        (plain or absorbed) per step; both give the same result up to rounding.
        """

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
        """forward() of q and k not yet rotated: rotate them by `positions` ("rotate half"
        layout, cos_sin as KernelOps.rotary takes it) first. q may be rotated in place.

        Only when takes_qkv_parts() is true: q, k, v may be [S, T, heads, dim], S partial
        results that add up to the projection's output, and `bias` the (q, k, v) bias vectors
        still to add. keep_splits (only where `keeps_splits` is set): a SplitAttention may come
        back instead of the combined output."""
        raise NotImplementedError(f"{type(self).__name__} does not fuse the rotary embedding")

    def takes_qkv_parts(self) -> bool:
        """Whether forward_with_rotary() in the current step takes q, k, v as partial sums of
        the QKV GEMM (and its bias apart). Asked by the model before each layer's QKV GEMM."""
        return False

    def init_graph_buffers(self, max_batch: int, max_blocks_per_seq: int) -> None:
        """Allocate static metadata for decode batches of up to `max_batch` sequences whose
        block tables have up to `max_blocks_per_seq` blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch_size: int) -> None:
        """Make the following forward() calls a decode batch of `batch_size` sequences whose
        layout is read from the static buffers (reset to padding here). Until begin_step() is
        called again, forward() must launch the same kernels with the same arguments every
        time, with no host-to-device copy and no synchronisation, so that it can be captured."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: AttentionBatch, padded_batch_size: int) -> None:
        """Copy a decode-only batch's layout (its tensors preferably in pinned host memory) into
        the static buffers; rows from len(batch.query_lens) to `padded_batch_size` become padding
        that writes no cache slot a sequence owns and reads only allocated blocks."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_mixed_graph_buffers(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int
    ) -> None:
        """Allocate static metadata for steps of up to `max_tokens` tokens over up to `max_seqs`
        sequences of any query lengths (prompt chunks beside decodes)."""
        raise NotImplementedError(f"{type(self).__name__} does not support mixed CUDA graphs")

    def prepare_mixed_capture(self, num_tokens: int) -> None:
        """Make the following forward() calls a step of `num_tokens` tokens whose layout is read
        from the static buffers (reset to padding here); the capture rules of
        prepare_for_capture() apply."""
        raise NotImplementedError(f"{type(self).__name__} does not support mixed CUDA graphs")

    def prepare_mixed_replay(self, batch: AttentionBatch, num_tokens: int) -> None:
        """Copy a batch of at most `num_tokens` tokens (its tensors on the host) into the static
        buffers; tokens from sum(batch.query_lens) to `num_tokens` are padding that writes no
        cache slot and whose outputs are unspecified."""
        raise NotImplementedError(f"{type(self).__name__} does not support mixed CUDA graphs")

    def takes_mixed_step(self, query_lens: list[int], context_lens: list[int]) -> bool:
        """Whether a step of this layout (each sequence's new tokens and its context with them)
        can replay a mixed graph, once its size fits; a step it declines runs eagerly. Any step,
        unless a backend's graphs hold only some layouts."""
        return True
