"""TorchAttention against dense float64 attention over each sequence's whole history."""

from __future__ import annotations

import pytest
import torch

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
    totals = [p + n + 2 for p, n in plan]  # two decode steps follow the mixed one
    blocks_needed = [-(-t // block_size) for t in totals]
    num_blocks = sum(blocks_needed) + 3
    backend = TorchAttention(layers, block_size, torch.float32, torch.device("cpu"))
    backend.allocate(num_blocks)
    # Scattered, non-contiguous block ids, as a real block manager hands them out.
    ids = torch.randperm(num_blocks).tolist()
    tables = []
    for n in blocks_needed:
        tables.append(ids[:n])
        ids = ids[n:]
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

    step([(0, p) for p, _ in plan])  # the cached prefixes, as one ragged prefill
    step([(p, p + n) for p, n in plan])  # the mixed step
    step([(t - 2, t - 1) for t in totals])
    step([(t - 1, t) for t in totals])


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


@pytest.mark.parametrize(
    "spec",
    [
        KVLayerSpec(4, 2, 16, kind="sliding", window=8),
        KVLayerSpec(4, 1, 32, kind="mla", v_head_dim=0),
    ],
)
def test_unsupported_kinds_are_named(spec: KVLayerSpec) -> None:
    with pytest.raises(NotImplementedError, match=spec.kind):
        TorchAttention([spec], 16, torch.float32, torch.device("cpu"))


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
