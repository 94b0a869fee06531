"""TorchAttention against dense float64 attention over each sequence's whole history."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import plan_steps, scattered_tables

from inferx_core.attention_torch import TorchAttention
from inferx_core.batch import make_attention_batch
from inferx_core.interfaces.kv import KVLayerSpec

# fp32 attention over a few dozen keys: differences are rounding in the softmax sums, ~1e-7.
RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] are the last n of the c positions in k, v [c, Hkv, D]; causal, float64."""
    n, c = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def run_step(backend, layers, qs, ks, vs, query_lens, context_lens, tables, scale):
    batch = make_attention_batch(query_lens, context_lens, tables, backend.block_size)
    backend.begin_step(batch)
    return [
        backend.forward(backend.layer(i, scale), qs[i], ks[i], vs[i]) for i in range(len(layers))
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_batch_matches_dense(block_size: int, group: int, head_dim: int) -> None:
    torch.manual_seed(block_size * 100 + group * 10 + head_dim)
    hkv = 2
    hq = hkv * group
    layers = [KVLayerSpec(hq, hkv, head_dim) for _ in range(2)]
    scale = head_dim**-0.5
    # (prefix already cached, new tokens this step): a fresh prefill, a chunk over a cached prefix,
    # two decodes, a one-token prompt.
    plan = [(0, 13), (9, 7), (21, 1), (5, 1), (0, 1)]
    # The cached prefixes as one ragged prefill, the mixed step, two decode steps.
    totals, steps = plan_steps(plan)
    blocks_needed = [-(-t // block_size) for t in totals]
    num_blocks = sum(blocks_needed) + 3
    backend = TorchAttention(layers, block_size, torch.float32, torch.device("cpu"))
    backend.allocate(num_blocks)
    tables = scattered_tables(totals, block_size, num_blocks)
    hist = [
        [(torch.randn(t, hkv, head_dim), torch.randn(t, hkv, head_dim)) for t in totals]
        for _ in layers
    ]
    queries = [[torch.randn(t, hq, head_dim) for t in totals] for _ in layers]

    def step(spans: list[tuple[int, int]]) -> None:
        """Run the positions [a, b) of each sequence whose span is non-empty, and check them."""
        live = [i for i, (a, b) in enumerate(spans) if b > a]
        qs, ks, vs = [], [], []
        for layer in range(len(layers)):
            qs.append(torch.cat([queries[layer][i][slice(*spans[i])] for i in live]))
            ks.append(torch.cat([hist[layer][i][0][slice(*spans[i])] for i in live]))
            vs.append(torch.cat([hist[layer][i][1][slice(*spans[i])] for i in live]))
        query_lens = [spans[i][1] - spans[i][0] for i in live]
        context_lens = [spans[i][1] for i in live]
        outs = run_step(
            backend, layers, qs, ks, vs, query_lens, context_lens, [tables[i] for i in live], scale
        )
        for layer, out in enumerate(outs):
            expected = torch.cat(
                [
                    dense_reference(
                        queries[layer][i][slice(*spans[i])],
                        hist[layer][i][0][: spans[i][1]],
                        hist[layer][i][1][: spans[i][1]],
                        scale,
                    )
                    for i in live
                ]
            )
            assert out.shape == (sum(query_lens), hq, head_dim)
            assert rel_err(out, expected) <= RTOL

    for spans in steps:
        step(spans)


def test_decode_steps_after_prefill() -> None:
    torch.manual_seed(0)
    spec = KVLayerSpec(9, 3, 64)  # the demo model's shape
    backend = TorchAttention([spec], 16, torch.float32, torch.device("cpu"))
    backend.allocate(8)
    total = 40
    k, v = torch.randn(total, 3, 64), torch.randn(total, 3, 64)
    q = torch.randn(total, 9, 64)
    table = [5, 2, 7]
    start = 30
    run_step(
        backend, [spec], [q[:start]], [k[:start]], [v[:start]], [start], [start], [table], 0.125
    )
    for pos in range(start, total):
        (out,) = run_step(
            backend,
            [spec],
            [q[pos : pos + 1]],
            [k[pos : pos + 1]],
            [v[pos : pos + 1]],
            [1],
            [pos + 1],
            [table],
            0.125,
        )
        expected = dense_reference(q[pos : pos + 1], k[: pos + 1], v[: pos + 1], 0.125)
        assert rel_err(out, expected) <= RTOL


def test_unsupported_features_are_named() -> None:
    class NoFp8(TorchAttention):
        name = "no-fp8 attention"
        features = TorchAttention.features - {"fp8_kv"}

    spec = KVLayerSpec(4, 1, 32, dtype="fp8_e4m3")
    with pytest.raises(NotImplementedError, match="needs fp8_kv attention"):
        NoFp8([spec], 16, torch.float32, torch.device("cpu"))
    # an e4m3 latent cache is taken (tests/test_mla_fp8.py), a byte a value
    mla = KVLayerSpec(4, 1, 576, kind="mla", v_head_dim=512, rope_dim=64, dtype="fp8_e4m3")
    assert (
        TorchAttention([mla], 16, torch.float32, torch.device("cpu")).bytes_per_block() == 576 * 16
    )


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (KVLayerSpec(4, 2, 576, kind="mla", v_head_dim=512, rope_dim=64), "one KV head"),
        (KVLayerSpec(4, 1, 576, kind="mla", v_head_dim=512), "one KV head"),
        (KVLayerSpec(4, 1, 570, kind="mla", v_head_dim=512, rope_dim=64), "not kv_lora_rank"),
    ],
)
def test_malformed_mla_layers_are_refused(spec: KVLayerSpec, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TorchAttention([spec], 16, torch.float32, torch.device("cpu"))


def test_mla_layers_need_their_weights_and_others_refuse_them() -> None:
    from inferx_core.interfaces.attention import MLAWeights

    mla = KVLayerSpec(4, 1, 40, kind="mla", v_head_dim=32, rope_dim=8)
    backend = TorchAttention([mla, KVLayerSpec(4, 1, 32)], 16, torch.float32, torch.device("cpu"))
    weights = MLAWeights(16, 16, lambda latent: latent)
    assert backend.layer(0, 0.1, mla=weights).mla is weights
    with pytest.raises(ValueError, match="MLA weights"):
        backend.layer(0, 0.1)
    with pytest.raises(ValueError, match="MLA weights"):
        backend.layer(1, 0.1, mla=weights)


def test_bytes_per_block_matches_allocation() -> None:
    layers = [KVLayerSpec(8, 2, 64), KVLayerSpec(8, 4, 32)]
    backend = TorchAttention(layers, 16, torch.bfloat16, torch.device("cpu"))
    backend.allocate(3)
    allocated = sum(c.numel() * c.element_size() for c in backend.caches)
    assert allocated == 3 * backend.bytes_per_block()


def test_pack_aligned_keeps_every_part_at_16_bytes():
    """Slices of one packed tensor start 16-byte aligned, as separate tensors would (Triton
    compiles a kernel variant per pointer alignment), and hold their parts unchanged."""
    from inferx_core.batch import pack_aligned

    parts = [[1, 2, 3], [], [4], list(range(10, 27)), [5, 6]]
    for dtype, per in ((torch.int32, 4), (torch.int64, 2)):
        packed, at = pack_aligned(parts, dtype)
        assert packed.dtype == dtype
        assert all(a % per == 0 for a in at)
        for part, a in zip(parts, at, strict=True):
            view = packed[a : a + len(part)]
            assert view.tolist() == part
            assert not part or view.data_ptr() % 16 == packed.data_ptr() % 16


# -- KV groups: sliding window, learned sinks, softcap -------------------------------------------

# float64 inputs and cache; the plain decode path takes its softmax in float32 (~1e-7).
RTOL64 = 1e-6


def featured_reference(q, k, v, scale, window=None, softcap=0.0, sinks=None) -> torch.Tensor:
    """dense_reference with a window (a query at p sees keys in (p - window, p]), a softcap on
    the logits before the mask, and a learned sink logit per head joining the softmax."""
    n, c = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    key_pos, query_pos = torch.arange(c)[None, :], torch.arange(c - n, c)[:, None]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, n, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


WINDOW = 5
# Two groups (full: layers 0, 3; sliding: 1, 2), every combination of the features.
GROUP_LAYERS = [
    KVLayerSpec(4, 2, 8),
    KVLayerSpec(4, 2, 8, kind="sliding", window=WINDOW),
    KVLayerSpec(4, 2, 8, kind="sliding", window=WINDOW, learned_sinks=True, softcap=1.0),
    KVLayerSpec(4, 2, 8, learned_sinks=True, softcap=1.5),
]


def test_sliding_sinks_softcap_match_float64_reference() -> None:
    """Prefill, chunked prefill over the cached prefix and decode, packed in shared steps, with
    block tables from a two-group PagedKVManager: sliding tables lose their blocks behind the
    window (entry 0). Freed blocks and block 0 hold NaN, so reading one would show."""
    from inferx_core.interfaces.kv import kv_groups
    from inferx_core.kv_manager import PagedKVManager
    from inferx_core.sequence import SamplingParams, Sequence

    bs, scale = 4, 0.5
    backend = TorchAttention(GROUP_LAYERS, bs, torch.float64, torch.device("cpu"))
    assert len(backend.groups) == 2
    backend.allocate(40)
    # The i-th layers of the two groups share a cache tensor: two tensors for four layers.
    assert len({c.data_ptr() for c in backend.caches}) == 2
    allocated = sum(
        c.numel() * c.element_size() for c in {id(c): c for c in backend.caches}.values()
    )
    assert allocated == 40 * backend.bytes_per_block()
    kv = PagedKVManager(40, bs, prefix_cache=False, groups=kv_groups(GROUP_LAYERS), max_chunk=8)
    gen = torch.Generator().manual_seed(0)
    sinks = [
        torch.randn(4, generator=gen, dtype=torch.float32) if s.learned_sinks else None
        for s in GROUP_LAYERS
    ]
    layers = [backend.layer(i, scale, sinks=sinks[i]) for i in range(len(GROUP_LAYERS))]
    total = {"a": 24, "b": 13, "c": 7}
    qkv = {
        name: [
            [torch.randn(n, h, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
            for _ in GROUP_LAYERS
        ]
        for name, n in total.items()
    }
    seqs = {name: Sequence([1] * n, SamplingParams()) for name, n in total.items()}
    schedule = [
        [("a", 0, 7), ("b", 0, 3)],  # prefills within and past the window
        [("a", 7, 15), ("b", 3, 4), ("c", 0, 7)],  # a chunk over a cached prefix, a decode
        [("a", 15, 21), ("b", 4, 12)],
        [("a", 21, 22), ("b", 12, 13)],
        [("a", 22, 23)],
        [("a", 23, 24)],
    ]
    for step in schedule:
        for name, a, b in step:
            s = seqs[name]
            assert s.num_computed == a and kv.allocate(s, b)
            s.num_computed = b
        for cache in backend.caches:  # nobody holds block 0 or a free block: poison them
            cache[:, [0, *kv._free]] = float("nan")
        chunks = [(seqs[n], a, b) for n, a, b in step]
        group_tables = [[s.block_tables[g] for s, _, _ in chunks] for g in range(2)]
        batch = make_attention_batch(
            [b - a for _, a, b in chunks],
            [b for _, _, b in chunks],
            group_tables[0],
            bs,
            group_tables=group_tables,
        )
        backend.begin_step(batch)
        for i, layer in enumerate(layers):
            q, k, v = (torch.cat([qkv[n][i][j][a:b] for n, a, b in step]) for j in range(3))
            out = backend.forward(layer, q, k, v)
            spec = GROUP_LAYERS[i]
            row = 0
            for n, a, b in step:
                full_q, full_k, full_v = qkv[n][i]
                window = spec.window if spec.kind == "sliding" else None
                expected = featured_reference(
                    full_q[a:b], full_k[:b], full_v[:b], scale, window, spec.softcap, sinks[i]
                )
                got = out[row : row + b - a]
                assert not got.isnan().any(), (i, n, a, b)
                assert rel_err(got, expected) <= RTOL64, (i, n, a, b)
                row += b - a
    # The sliding table of a lost its blocks behind the window; the full one kept them all.
    table = seqs["a"].block_tables[1]
    assert table[: (23 - WINDOW + 1) // bs] == [0] * ((23 - WINDOW + 1) // bs)
    assert all(seqs["a"].block_tables[0])


def test_sliding_window_edge_is_inclusive_of_window_keys() -> None:
    """A query at position p sees exactly `window` keys, p - window + 1 to p (transformers'
    sliding_window_overlay: kv_idx > q_idx - window): one value per position shows which."""
    bs, window = 4, 3
    spec = KVLayerSpec(1, 1, 1, kind="sliding", window=window)
    backend = TorchAttention([spec], bs, torch.float64, torch.device("cpu"))
    backend.allocate(8)
    n = 10
    q = torch.zeros(n, 1, 1, dtype=torch.float64)  # equal scores: the mean of visible values
    k = torch.zeros(n, 1, 1, dtype=torch.float64)
    v = torch.arange(n, dtype=torch.float64).view(n, 1, 1)
    out = run_step(backend, [spec], [q], [k], [v], [n], [n], [[1, 2, 3]], 1.0)[0]
    expected = [sum(range(max(0, p - window + 1), p + 1)) / min(p + 1, window) for p in range(n)]
    assert out.view(-1).tolist() == pytest.approx(expected)


@pytest.mark.parametrize("backend_path", ["triton_attention:TritonAttention"])
def test_kernel_backends_refuse_what_they_lack(backend_path: str) -> None:
    pytest.importorskip("triton", reason="the triton package is not installed")
    module, name = backend_path.split(":")
    cls = getattr(__import__(f"inferx_kernels_cuda.{module}", fromlist=[name]), name)
    assert cls.features == frozenset({"sliding", "sinks", "fp8_kv", "mla"})
    assert cls.supports_kv_groups
    layers = [dataclasses.replace(spec, head_dim=16) for spec in GROUP_LAYERS]
    cls.check_layers(layers[:2], model="GptOssForCausalLM")  # sliding, two groups
    with pytest.raises(NotImplementedError, match="softcap.*triton attention"):
        cls.check_layers(layers, model="Gemma2ForCausalLM")
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16; layer 0 has 8"):
        cls.check_layers(GROUP_LAYERS[:2])  # the kernels' own limit
    # A backend with the feature but one block table a sequence refuses several groups.
    one_table = type("OneTable", (cls,), {"supports_kv_groups": False})
    with pytest.raises(NotImplementedError, match="2 KV cache groups"):
        one_table.check_layers(layers[:2])
    one_table.check_layers(layers[1:2])  # one sliding group is one table
