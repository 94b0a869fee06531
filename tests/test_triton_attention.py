"""TritonAttention against dense float64 attention and TorchAttention: CPU (interpreter) and GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import (  # noqa: E402
    fused_views,
    interpreted,
    on_gpu,
    plan_steps,
    scattered_tables,
)
from test_attention_torch import dense_reference, rel_err  # noqa: E402

from inferx_core.attention_torch import TorchAttention  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.interfaces.attention import SplitAttention  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_kernels_cuda.pdl import pdl_enabled  # noqa: E402
from inferx_kernels_cuda.triton_attention import DenseConfig, TritonAttention  # noqa: E402

# Largest |triton - reference| over the largest |reference|. fp32 differs from float64 only by
# summation order; fp16 by rounding the softmax weights to fp16 before P @ V (as every flash
# kernel does); bf16 by rounding the output (and, on the GPU, P) to bf16.
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}

# (cached prefix, new tokens) of each sequence in the mixed step: a fresh prompt, a chunk over
# a cached prefix, decodes, a one-token prompt. Two decode steps follow it.
SMALL_PLAN = [(0, 13), (9, 7), (21, 1), (5, 1), (0, 1)]


def check_steps(
    backend: TritonAttention,
    totals: list[int],
    steps: list[list[tuple[int, int]]],
    against_torch: bool = False,
) -> list[int]:
    """Run `steps` (the span [a, b) of each sequence's positions per step; empty spans sit the
    step out) and check every layer's output against dense float64 attention over the same
    rounded inputs, and against TorchAttention on the same device if asked. Returns each step's
    number of decode splits."""
    layers, bs, dtype, device = backend.layers, backend.block_size, backend.dtype, backend.device
    tol = TOL[dtype]
    blocks_needed = [-(-t // bs) for t in totals]
    num_blocks = sum(blocks_needed) + 3
    backends: list[TorchAttention] = [backend]
    if against_torch:
        backends.append(TorchAttention(layers, bs, dtype, device))
    for b in backends:
        b.allocate(num_blocks)
    tables = scattered_tables(totals, bs, num_blocks)
    hist = [
        [
            tuple(
                torch.randn(t, h, s.head_dim).to(dtype)
                for h in (s.num_q_heads,) + (s.num_kv_heads,) * 2
            )
            for t in totals
        ]
        for s in layers
    ]
    splits = []
    for spans in steps:
        live = [i for i, (a, b) in enumerate(spans) if b > a]
        query_lens = [spans[i][1] - spans[i][0] for i in live]
        context_lens = [spans[i][1] for i in live]
        batch = make_attention_batch(
            query_lens, context_lens, [tables[i] for i in live], bs, device
        )
        outs = []
        for b in backends:
            b.begin_step(batch)
            per_layer = []
            for layer, spec in enumerate(layers):
                q, k, v = (
                    torch.cat([hist[layer][i][j][slice(*spans[i])] for i in live]).to(device)
                    for j in range(3)
                )
                per_layer.append(
                    b.forward(b.layer(layer, spec.head_dim**-0.5), *fused_views(q, k, v))
                )
            outs.append(per_layer)
        assert backend._plan is not None
        splits.append(backend._plan.num_splits)
        for layer, spec in enumerate(layers):
            out = outs[0][layer]
            assert out.shape == (sum(query_lens), spec.num_q_heads, spec.head_dim)
            assert out.dtype == dtype
            expected = torch.cat(
                [
                    dense_reference(
                        hist[layer][i][0][slice(*spans[i])],
                        hist[layer][i][1][: spans[i][1]],
                        hist[layer][i][2][: spans[i][1]],
                        spec.head_dim**-0.5,
                    )
                    for i in live
                ]
            )
            err = rel_err(out.cpu(), expected)
            assert err <= tol, f"layer {layer}, spans {spans}: {err:.2e} against float64"
            if against_torch:
                err = rel_err(out, outs[1][layer])
                assert err <= tol, f"layer {layer}, spans {spans}: {err:.2e} against torch"
    return splits


# (block_size, group, head_dim, dtype) of the interpreter's step tests.
CPU_CASES = [
    (4, 1, 16, torch.float32),
    (16, 2, 32, torch.float32),
    (4, 4, 32, torch.float32),
    (3, 3, 16, torch.float32),
    (1, 2, 16, torch.float32),
    (16, 4, 16, torch.float16),
    (4, 2, 32, torch.float16),
    (16, 2, 16, torch.bfloat16),
]


@interpreted
@pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype"), CPU_CASES)
def test_steps_match_dense(block_size: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    """Prefill-only ragged, mixed (fresh prompt, chunk over a prefix, decodes), decode-only."""
    torch.manual_seed(block_size * 100 + group * 10 + head_dim)
    layers = [KVLayerSpec(2 * group, 2, head_dim), KVLayerSpec(group, 1, head_dim)]
    backend = TritonAttention(layers, block_size, dtype, torch.device("cpu"))
    backend.dense_prefill = False  # prefill_kernel for every prompt (dense: the test below)
    totals, steps = plan_steps(SMALL_PLAN)
    assert check_steps(backend, totals, steps, against_torch=True) == [1, 1, 1, 1]


@interpreted
@pytest.mark.parametrize(
    ("block_size", "group", "dtype"),
    [(4, 1, torch.float32), (16, 2, torch.float32), (4, 4, torch.float16)],
)
@pytest.mark.parametrize("reduce_heads", [1, 4])
def test_split_k_decode(block_size: int, group: int, dtype: torch.dtype, reduce_heads: int) -> None:
    """Splits of one 16-token tile forced on: decodes of different lengths use different numbers
    of the step's splits (the shortest, one), alone and beside a prefill. reduce_heads 4: the
    reduce kernel's programs take 4 query heads each (2 where the layer has 2)."""
    torch.manual_seed(7 + block_size + group)
    layers = [KVLayerSpec(2 * group, 2, 16)]
    backend = TritonAttention(
        layers, block_size, dtype, torch.device("cpu"), min_split_len=1, target_programs=10**6
    )
    backend.max_splits = 8  # eager steps pad the reduce to this many splits
    backend.reduce_heads = reduce_heads
    assert backend._reduce_heads(2 * group, 8) == min(reduce_heads, 2 * group)
    totals = [41, 23, 7, 36, 30]
    steps = [
        [(0, 39), (0, 21), (0, 5), (0, 34), (0, 0)],
        [(39, 40), (21, 22), (5, 6), (34, 35), (0, 28)],
        [(40, 41), (22, 23), (6, 7), (35, 36), (28, 29)],
    ]
    assert check_steps(backend, totals, steps) == [1, 3, 3]


@interpreted
def test_pdl_choices_by_rows_only_in_graph_decode_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernel and the reduce ask inferx_kernels_cuda.pdl for their launch by the
    step's decode count only in CUDA-graph decode steps; eager steps, decodes beside a prefill
    or alone, ask for 0 rows, the launch warm-up compiles (a count-dependent variant compiled
    mid-run on the H200)."""
    from inferx_kernels_cuda import triton_attention

    asked: list[tuple[int, int]] = []
    real = triton_attention.between_launch

    def spy(device: torch.device, rows: int, width: int) -> dict:
        asked.append((rows, width))
        return real(device, rows, width)

    monkeypatch.setattr(triton_attention, "between_launch", spy)
    backend = TritonAttention(
        [KVLayerSpec(4, 2, 16)], 4, torch.float32, torch.device("cpu"), min_split_len=1,
        target_programs=10**6,
    )  # fmt: skip
    totals = [41, 23, 7, 36, 30]
    steps = [
        [(0, 39), (0, 21), (0, 5), (0, 34), (0, 0)],
        [(39, 40), (21, 22), (5, 6), (34, 35), (0, 28)],  # 4 decodes beside a prefill
        [(40, 41), (22, 23), (6, 7), (35, 36), (28, 29)],  # 5 decodes, eager
    ]
    check_steps(backend, totals, steps)
    # the decode kernel and the reduce, in the second step and the third
    assert asked == [(0, 64)] * 4
    asked.clear()
    backend.init_graph_buffers(8, 16)
    backend.prepare_for_capture(3)  # a captured decode step of 3 rows: the static plan
    q = torch.zeros(3, 4, 16)
    kv = torch.zeros(3, 2, 16)
    backend.forward(backend.layer(0, 1.0), q, kv, kv.clone())
    assert asked[0] == (3, 64)


def test_switch_defaults() -> None:
    """The settings' defaults (attributes that tests and benchmarks may set)."""
    backend = TritonAttention([KVLayerSpec(4, 2, 16)], 16, torch.float32, torch.device("cpu"))
    assert backend.decode_rotary and backend.qkv_parts
    assert backend.keeps_splits and backend.keep_split_rows == ((1, 4),)
    backend.keep_split_rows = ()
    assert not backend.keeps_splits


def test_preload_rows_and_when_they_apply() -> None:
    """PRELOAD goes to the decode kernel at preload_rows (default: 1 row), and only where it
    launches early (EARLY) and writes the new token itself (rotary)."""
    spec = KVLayerSpec(4, 2, 16)
    backend = TritonAttention([spec], 16, torch.float32, torch.device("cpu"))
    assert backend.preload_rows == ((1, 1),)
    early = {"PDL": True, "TRIGGER": True, "EARLY": True}
    backend._decode_pdl = lambda plan, spec: dict(early)
    for rows, rotary, want in ((1, True, True), (2, True, False), (1, False, False)):
        plan = SimpleNamespace(num_decode=rows)
        assert backend._decode_launch_pdl(plan, spec, rotary).get("PRELOAD", False) == want
    backend._decode_pdl = lambda plan, spec: {"PDL": False, "TRIGGER": True}
    assert "PRELOAD" not in backend._decode_launch_pdl(SimpleNamespace(num_decode=1), spec, True)
    backend._decode_pdl = lambda plan, spec: dict(early)
    backend.preload_rows = ((1, 4),)
    plan = SimpleNamespace(num_decode=4)
    assert backend._decode_launch_pdl(plan, spec, True).get("PRELOAD")
    backend.preload_rows = ()
    assert "PRELOAD" not in backend._decode_launch_pdl(SimpleNamespace(num_decode=1), spec, True)
    # over an e4m3 cache: preload_fp8_rows, none by default
    one = SimpleNamespace(num_decode=1)
    backend.preload_rows = ((1, 1),)
    assert backend.preload_fp8_rows == ()
    assert "PRELOAD" not in backend._decode_launch_pdl(one, spec, True, fp8=True)
    backend.preload_fp8_rows = ((1, 1),)
    assert backend._decode_launch_pdl(one, spec, True, fp8=True).get("PRELOAD")


def test_reduce_heads_fit_the_layer_and_the_tile() -> None:
    backend = TritonAttention([KVLayerSpec(16, 2, 128)], 16, torch.float32, torch.device("cpu"))
    backend.reduce_heads = 8
    assert backend._reduce_heads(16, 4) == 8  # batch-64 graphs: 4 splits
    assert backend._reduce_heads(16, 16) == 4  # no more than 64 (head, split) rows
    assert backend._reduce_heads(16, 64) == 1  # eager steps pad to 64 splits
    assert backend._reduce_heads(12, 4) == 4  # a divisor of the layer's heads
    backend.reduce_heads = 3
    with pytest.raises(ValueError, match="reduce_heads must be a power of two; got 3"):
        backend._reduce_heads(16, 4)


def test_prefill_pipelines_small_groups_only() -> None:
    """Layers of GQA group <= 4 launch the prefill kernel 2 stages deep, larger groups 1 deep,
    each from its own (tunable) options."""
    specs = [KVLayerSpec(32, 8, 128), KVLayerSpec(16, 2, 128)]  # groups 4 and 8
    backend = TritonAttention(specs, 16, torch.float32, torch.device("cpu"))
    assert backend.prefill_options(4) == {"num_warps": 4, "num_stages": 2}
    assert backend.prefill_options(1) == {"num_warps": 4, "num_stages": 2}
    assert backend.prefill_options(8) == {"num_warps": 4, "num_stages": 1}
    backend.prefill_launch_small_group = {"num_warps": 8, "num_stages": 3}
    assert backend.prefill_options(2)["num_stages"] == 3
    assert backend.prefill_options(8)["num_stages"] == 1


def test_split_policy() -> None:
    """Split only while the GPU would be short of programs, never below min_split_len."""
    backend = TritonAttention(
        [KVLayerSpec(16, 2, 128)],
        16,
        torch.bfloat16,
        torch.device("cpu"),
        min_split_len=256,
        target_programs=264,
    )
    backend.decode_block_n = 64
    assert backend._plan_splits(1, 4096) == (16, 256)  # 2 programs: as many splits as allowed
    assert backend._plan_splits(1, 300) == (1, 320)  # two splits would be under 256 tokens
    assert backend._plan_splits(8, 4096) == (16, 256)  # 16 programs: 17 splits wanted
    assert backend._plan_splits(256, 4096) == (1, 4096)  # 512 programs fill the GPU already
    assert backend._plan_splits(1, 1 << 17) == (TritonAttention.max_splits, 2048)


@pytest.mark.parametrize(
    ("spec", "dtype", "error", "match"),
    [
        (KVLayerSpec(4, 2, 48), torch.float32, ValueError, "power-of-two head_dim"),
        (KVLayerSpec(4, 2, 8), torch.float32, ValueError, "power-of-two head_dim"),
        (KVLayerSpec(6, 4, 16), torch.float32, ValueError, "multiple of num_kv_heads"),
        (
            KVLayerSpec(4, 2, 48, kind="sliding", window=8),
            torch.float32,
            ValueError,
            "power-of-two head_dim",
        ),
        (KVLayerSpec(4, 2, 16, softcap=30.0), torch.float32, NotImplementedError, "softcap"),
        (KVLayerSpec(4, 2, 16), torch.float64, NotImplementedError, "float64"),
    ],
)
def test_unsupported_layouts_are_named(
    spec: KVLayerSpec, dtype: torch.dtype, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TritonAttention([spec], 16, dtype, torch.device("cpu"))


def test_forward_before_begin_step_fails() -> None:
    backend = TritonAttention([KVLayerSpec(2, 1, 16)], 4, torch.float32, torch.device("cpu"))
    backend.allocate(2)
    x = torch.zeros(1, 2, 16)
    with pytest.raises(RuntimeError, match="begin_step"):
        backend.forward(backend.layer(0, 0.25), x, x[:, :1], x[:, :1])


@interpreted
@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "dtype"),
    [c for c in CPU_CASES if c[1] != 3] + [(3, 8, 16, torch.float32)],  # powers of two
)
def test_dense_prefill_matches_dense(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    """dense_prefill on: fresh prompts (a ragged prefill of several, then two beside a chunk
    over a cached prefix and decodes) attend through dense_prefill_kernel over the step's own
    q, k, v, and agree with float64 attention and TorchAttention; the tiles are planned for
    the fresh prompts only."""
    torch.manual_seed(block_size * 100 + group * 10 + head_dim + 1)
    layers = [KVLayerSpec(2 * group, 2, head_dim), KVLayerSpec(group, 1, head_dim)]
    backend = TritonAttention(layers, block_size, dtype, torch.device("cpu"))
    backend.dense_prefill = True
    planned = []
    begin = backend.begin_step

    def recording(batch):  # type: ignore[no-untyped-def]
        begin(batch)
        planned.append({g: t.count for g, t in backend._plan.dense_tiles.items()})

    backend.begin_step = recording  # type: ignore[method-assign]
    # A long prompt (tiles whose keys run past one tile) beside SMALL_PLAN's sequences.
    totals, steps = plan_steps([*SMALL_PLAN, (0, 37)])
    check_steps(backend, totals, steps, against_torch=True)
    block_q = backend.dense_configs[0][1].block_m // group
    fresh_first = [9, 21, 5]  # the cached prefixes, prefilled fresh
    fresh_second = [13, 37]  # (0, 13) and (0, 37); (9, 7) has a prefix
    assert planned[0] == {group: sum(-(-n // block_q) for n in fresh_first)}
    assert planned[1] == {group: sum(-(-n // block_q) for n in fresh_second)}
    assert planned[2] == planned[3] == {}  # decode-only


def test_dense_tiles_run_longest_first() -> None:
    """The dense kernel's tiles go out by first query, last first; the paged kernel's in order."""
    lens = [5, 9, 3]
    assert TritonAttention._tiles_of(lens, [0, 1, 2], 4) == [[0, 0, 1, 1, 1, 2], [0, 4, 0, 4, 8, 0]]
    assert TritonAttention._tiles_of(lens, [0, 1, 2], 4, longest_first=True) == [
        [1, 0, 1, 0, 1, 2],
        [8, 4, 4, 0, 0, 0],
    ]


def test_dense_prefill_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default where the kernel runs (here the interpreter) for GQA groups that are
    powers of two, never past them; off without TMA (and without the interpreter)."""
    cpu = torch.device("cpu")

    def dense(q_heads: int, kv_heads: int) -> bool:
        spec = KVLayerSpec(q_heads, kv_heads, 16)
        return TritonAttention([spec], 16, torch.float32, cpu).dense_prefill

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dense(4, 2) and dense(8, 2) and dense(16, 2) and not dense(6, 2)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dense(4, 2)


def test_dense_config_ladder(monkeypatch: pytest.MonkeyPatch) -> None:
    """The config by the step's longest fresh prompt: the GQA group's default ladder (or one
    set on the backend); start-up warms the ladder's later steps. DenseConfig.parse reads a
    config and refuses a bad one."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    narrow = TritonAttention([KVLayerSpec(32, 8, 128)], 16, torch.bfloat16, cpu)
    wide = TritonAttention([KVLayerSpec(16, 2, 128)], 16, torch.bfloat16, cpu)
    assert [at for at, _ in narrow.dense_configs] == [0, 8192]
    assert [at for at, _ in wide.dense_configs] == [0, 2048, 8192]
    assert narrow.dense_configs == [
        (0, DenseConfig(64, 64, 4, 3)),
        (8192, DenseConfig(128, 128, 8, 3)),
    ]
    assert wide.dense_configs == [
        (0, DenseConfig(64, 64, 4, 2)),
        (2048, DenseConfig(64, 32, 4, 3)),
        (8192, DenseConfig(128, 128, 8, 3)),
    ]
    assert narrow.warm_up_prompt_lens == ()  # no TMA here: dense off
    backend = TritonAttention([KVLayerSpec(4, 2, 16)], 16, torch.float32, cpu)
    backend.dense_configs = [
        (0, DenseConfig.parse("64x64x4x2")),
        (1000, DenseConfig(128, 64, 8, 3)),
    ]
    backend.dense_prefill = True
    assert backend.warm_up_prompt_lens == (1000,)
    assert DenseConfig.parse("128x64x8x3") == DenseConfig(128, 64, 8, 3)
    for bad in ("64x64x4", "0:64x64x4x2", "axbxcxd", "64x64x0x2"):
        with pytest.raises(ValueError, match="BMxBNxWARPSxSTAGES"):
            DenseConfig.parse(bad)


# The conformance sizes; the lead runs these on the H200 (pytest -m gpu).
GPU_PLAN = [(0, 300), (100, 37), (1000, 1), (2047, 1), (5, 1), (0, 1), (64, 64), (513, 200)]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(
    ("group", "dense"),
    [(g, False) for g in (1, 2, 3, 4, 8)] + [(g, True) for g in (1, 2, 4, 8)],  # powers of two
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_conformance_bf16(block_size: int, group: int, head_dim: int, dense: bool) -> None:
    torch.manual_seed(block_size * 1000 + group * 10 + head_dim)
    layers = [KVLayerSpec(2 * group, 2, head_dim), KVLayerSpec(4 * group, 4, head_dim)]
    backend = TritonAttention(layers, block_size, torch.bfloat16, torch.device("cuda"))
    backend.dense_prefill = dense
    totals, steps = plan_steps(GPU_PLAN)
    splits = check_steps(backend, totals, steps, against_torch=True)
    assert splits[0] == 1 and splits[2] > 1  # the decode-only steps take the split-K path


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    layers = [KVLayerSpec(16, 2, 128)]
    backend = TritonAttention(layers, 16, dtype, torch.device("cuda"))
    totals, steps = plan_steps(GPU_PLAN)
    check_steps(backend, totals, steps, against_torch=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dense", [False, True])
def test_fused_rotary_equals_rotary_then_forward(
    group: int, dtype: torch.dtype, dense: bool
) -> None:
    check_fused_rotary(group, dtype, torch.device("cpu"), dense)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gpu_fused_rotary_bf16(group: int, dense: bool) -> None:
    check_fused_rotary(group, torch.bfloat16, torch.device("cuda"), dense)


ROTARY_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}


@interpreted
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_rotary_in_the_decode_kernel(group: int, dtype: torch.dtype, split: bool) -> None:
    check_decode_rotary(group, dtype, torch.device("cpu"), split)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gpu_rotary_in_the_decode_kernel_bf16(group: int, split: bool) -> None:
    check_decode_rotary(group, torch.bfloat16, torch.device("cuda"), split)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_kernel_sums_qkv_parts(group: int, dtype: torch.dtype) -> None:
    check_decode_rotary(group, dtype, torch.device("cpu"), True, parts=True)


@interpreted
@pytest.mark.parametrize("parts", [False, True])
def test_decode_kernel_early_metadata(parts: bool) -> None:
    check_decode_rotary(4, torch.float32, torch.device("cpu"), True, parts=parts, early=True)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_decode_kernel_early_metadata_bf16(split: bool, parts: bool) -> None:
    check_decode_rotary(8, torch.bfloat16, torch.device("cuda"), split, parts=parts, early=True)


@interpreted
@pytest.mark.parametrize(
    ("dtype", "split", "parts"),
    [(torch.float32, True, False), (torch.float32, False, True), (torch.float16, True, True)],
)
def test_decode_kernel_preloads_its_first_tile(
    dtype: torch.dtype, split: bool, parts: bool
) -> None:
    """PRELOAD: each split's first tile read before the wait, the new token's row taken from
    the k and v the kernel writes (the cache holds stale random values in that slot). Split:
    one tile a program; unsplit: up to three, the rest read in the loop."""
    check_decode_rotary(4, dtype, torch.device("cpu"), split, parts=parts, early=True,
                        preload=True)  # fmt: skip


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("parts", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_gpu_decode_kernel_preloads_its_first_tile_bf16(split: bool, parts: bool) -> None:
    check_decode_rotary(8, torch.bfloat16, torch.device("cuda"), split, parts=parts, early=True,
                        preload=True)  # fmt: skip


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("group", [1, 8])
def test_gpu_decode_kernel_sums_qkv_parts_bf16(group: int, split: bool) -> None:
    check_decode_rotary(group, torch.bfloat16, torch.device("cuda"), split, parts=True)


def test_qkv_parts_only_in_decode_only_steps() -> None:
    """takes_qkv_parts(): with qkv_parts and decode_rotary on, in decode-only steps only; partial
    sums anywhere else are refused with a ValueError, not run wrong."""
    spec = KVLayerSpec(4, 2, 16)
    backend = TritonAttention([spec], 4, torch.float32, torch.device("cpu"))
    backend.qkv_parts = True
    backend.allocate(8)
    assert not backend.takes_qkv_parts()  # no step yet
    backend.begin_step(make_attention_batch([1, 1], [3, 5], [[1], [2, 3]], 4))
    assert backend.takes_qkv_parts()
    backend.decode_rotary = False
    assert not backend.takes_qkv_parts()
    backend.decode_rotary = True
    backend.qkv_parts = False
    assert not backend.takes_qkv_parts()
    backend.qkv_parts = True
    backend.begin_step(make_attention_batch([1, 2], [3, 5], [[1], [2, 3]], 4))
    assert not backend.takes_qkv_parts()
    q, k = torch.zeros(4, 3, 4, 16), torch.zeros(4, 3, 2, 16)
    cos_sin = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="takes_qkv_parts"):
        layer = backend.layer(0, 1.0)
        backend.forward_with_rotary(
            layer, q, k, k.clone(), torch.zeros(3, dtype=torch.long), cos_sin
        )


def check_decode_rotary(
    group: int,
    dtype: torch.dtype,
    device: torch.device,
    split: bool,
    parts: bool = False,
    early: bool = False,
    preload: bool = False,
    window: int = 0,
    sinks: bool = False,
    keep: bool = False,
    fp8_scales: tuple[float, float] | None = None,
) -> None:
    """decode_rotary: in a decode-only step the decode kernel rotates q and k and writes the new
    k and v itself. Against the torch reference ops' rotary followed by TorchAttention.forward
    on fresh random inputs: the same outputs and the same cache, with the context split or
    not (the split holding the new token writes it); a padding row (slot -1) writes nothing.
    parts: q, k and v arrive as 4 partial sums plus a bias (qkv_parts), which the kernel adds
    up; the reference gets their fp32 sum rounded once, as the unsplit GEMM would write it.
    early: the decode kernel's EARLY form (pdl.ATTENTION_ROWS: its metadata loaded before
    the PDL wait, with PDL where the device has it). preload: with early, its first K/V tile
    too (preload_rows); every decode launch is checked to have taken PRELOAD. window, sinks:
    sliding layers of that window, learned sinks. keep: forward_with_rotary(keep_splits=True)
    on every row count, which returns the splits (a SplitAttention, combined by its
    reduce()) where the context is split, unless the layer has sinks. fp8_scales: e4m3 caches
    with these (k_scale, v_scale) on both sides (see same_fp8_caches)."""
    head_dim, kv_heads, bs = 32, 2, 4
    kind = {"kind": "sliding", "window": window} if window else {}
    if fp8_scales is not None:
        kind["dtype"] = "fp8_e4m3"
    layers = [KVLayerSpec(kv_heads * group, kv_heads, head_dim, learned_sinks=sinks, **kind)] * 2
    heads_sinks = [torch.randn(kv_heads * group, device=device) if sinks else None for _ in layers]
    kwargs = {"min_split_len": 1, "target_programs": 10**6} if split else {}
    backend = TritonAttention(layers, bs, dtype, device, **kwargs)
    backend.decode_rotary = True
    backend.qkv_parts = parts
    if split:
        backend.decode_block_n = 16  # contexts here are short of two of the GPU's 64-token tiles
    if early:
        pdl = {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {"PDL": False}
        backend._decode_pdl = lambda plan, spec: pdl | {"TRIGGER": pdl["PDL"], "EARLY": early}
    backend.preload_rows = backend.preload_fp8_rows = ((1, 1 << 30),) if preload else ()
    backend.keep_split_rows = ((1, 1 << 30),) if keep else ()
    launches = []
    choose = backend._decode_launch_pdl

    def recorded(plan, spec, rotary, fp8=False):  # noqa: ANN001, ANN202 - the method's own
        args = choose(plan, spec, rotary, fp8)
        launches.append(args.get("PRELOAD", False))
        return args

    backend._decode_launch_pdl = recorded
    reference = TorchAttention(layers, bs, dtype, device)
    angles = torch.rand(64, head_dim // 2, device=device) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    ends = [6, 1, 37, 10, 16]  # context lengths; the new token is the last of each
    tables = [[3, 7], [4], [2, 5, 8, 11, 12, 15, 16, 17, 18, 19], [6, 13, 14], [1, 9, 10, 20]]
    backend.allocate(21)
    reference.allocate(21)
    for mine, theirs in zip(backend.caches, reference.caches, strict=True):
        mine.copy_(torch.randn(mine.shape, device=device).to(mine.dtype))  # the cached prefixes
        theirs.copy_(mine)
    scales = fp8_layer_scales(fp8_scales, device)
    batch = make_attention_batch([1] * len(ends), ends, tables, bs, device)
    positions = torch.tensor([e - 1 for e in ends], device=device)
    ops = TorchOps()
    splits = []
    for b in (backend, reference):
        b.begin_step(batch)
    for layer, spec in enumerate(layers):
        heads = (spec.num_q_heads, kv_heads, kv_heads)
        if parts:
            assert backend.takes_qkv_parts()
            sizes = [h * head_dim for h in heads]
            pieces = torch.randn(4, len(ends), sum(sizes), device=device).to(dtype)
            bias = torch.randn(sum(sizes), device=device).to(dtype)
            f = [p.float() for p in pieces]
            whole = (f[0] + f[1] + f[2] + f[3] + bias.float()).to(dtype)
            q, k, v = (
                t.unflatten(-1, (h, head_dim))
                for t, h in zip(whole.split(sizes, -1), heads, strict=True)
            )
            pq, pk, pv = (
                t.unflatten(-1, (h, head_dim))
                for t, h in zip(pieces.split(sizes, -1), heads, strict=True)
            )
            attn = backend.layer(layer, head_dim**-0.5, sinks=heads_sinks[layer], **scales)
            got = backend.forward_with_rotary(attn, pq, pk, pv, positions, cos_sin,
                                              bias=tuple(bias.split(sizes)),
                                              keep_splits=keep)  # fmt: skip
        else:
            q, k, v = (torch.randn(len(ends), h, head_dim, device=device).to(dtype) for h in heads)
            fq, fk, fv = fused_views(q.clone(), k.clone(), v.clone())
            attn = backend.layer(layer, head_dim**-0.5, sinks=heads_sinks[layer], **scales)
            got = backend.forward_with_rotary(
                attn, fq, fk, fv, positions, cos_sin, keep_splits=keep
            )
        splits.append(backend._plan.num_splits)
        if isinstance(got, SplitAttention):
            assert keep and split and not sinks
            got = got.reduce()
        else:
            assert not (keep and split and not sinks), "a split context's splits come back"
        rq, rk = ops.rotary(positions, q.clone(), k.clone(), cos_sin)
        ref_layer = reference.layer(layer, head_dim**-0.5, sinks=heads_sinks[layer], **scales)
        want = reference.forward(ref_layer, rq, rk, v)
        assert rel_err(got, want) <= TOL[dtype]
        if fp8_scales is not None:
            same_fp8_caches(backend.caches[layer], reference.caches[layer], dtype, fp8_scales)
            continue
        # bf16: the kernel and torch's ops round the two products of a rotated element
        # differently now and then, an ulp each (seen on the CPU for the separate rotary
        # kernel too): up to 2 ulps of the largest value, 2**-6.
        cache_tol = 2e-2 if dtype == torch.bfloat16 else ROTARY_TOL[dtype]
        assert rel_err(backend.caches[layer], reference.caches[layer]) <= cache_tol
    assert (max(splits) > 1) == split
    assert launches == [preload] * len(layers)
    forward_padding_row(backend, cos_sin)


def fp8_layer_scales(
    scales: tuple[float, float] | None, device: torch.device
) -> dict[str, torch.Tensor]:
    """backend.layer's k_scale / v_scale arguments for an e4m3 cache (none without one)."""
    if scales is None:
        return {}
    names = ("k_scale", "v_scale")
    return {n: torch.tensor([s], device=device) for n, s in zip(names, scales, strict=True)}


# an ulp of the rotation's bf16 products (|x * cos| up to 2-4), before the cache's scale
PRODUCT_ULP = 2.0**-6


def same_fp8_caches(
    mine: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    """Two e4m3 caches hold the same bytes: the kernels quantize exactly as to_fp8 does, over
    rotated keys rounded as the reference rounds them. In fp32 and fp16 the rare one-ulp flip
    of a rotated element almost never crosses an e4m3 rounding boundary; in bf16 (an ulp of
    2^-8 against e4m3's 2^-4) it can: there a byte may be the adjacent code, in 1% at most.
    On the GPU a flip can be a product's before the rotation's subtraction: where x1 * cos and
    x2 * sin nearly cancel, one ulp of a product is a few ulps of the small result, two e4m3
    codes apart (seen on an H100: 23 of 8192 bytes, 0.75 against 0.875). Near zero that
    absolute error, a product's ulp over the scale, spans many subnormal codes or the sign
    (0x85, -0.0098, against 0x00 at k_scale 0.013): there bytes may differ by that much."""
    a, b = mine.view(torch.uint8), theirs.view(torch.uint8)
    if dtype != torch.bfloat16:
        assert torch.equal(a, b)
        return
    diff = (a.int() - b.int()).abs()
    near = (mine.float() - theirs.float()).abs() <= PRODUCT_ULP / min(scales)
    diff = torch.where(near & (diff > 0), torch.ones_like(diff), diff)
    if diff.max() > 2 or (diff > 0).float().mean() > 1e-2:
        at = diff.flatten().argmax().item()
        raise AssertionError(
            f"{int((diff > 0).sum())} of {diff.numel()} bytes differ; the largest at flat index "
            f"{at}: {a.flatten()[at].item():#04x} ({mine.flatten()[at].float().item()}) against "
            f"{b.flatten()[at].item():#04x} ({theirs.flatten()[at].float().item()})"
        )


def check_fused_rotary(
    group: int,
    dtype: torch.dtype,
    device: torch.device,
    dense: bool = False,
    fp8_scales: tuple[float, float] | None = None,
) -> None:
    """forward_with_rotary (rotary and KV write in one kernel) against the torch reference ops'
    rotary followed by TorchAttention.forward, on fresh random inputs in a mixed step (a prompt
    over a cached prefix, a fresh prompt, decodes): the same outputs, the same cache, q rotated
    in place; a padding row (slot -1) rotates q and writes nothing. `dense`: the fresh prompt
    attends through dense_prefill_kernel over q and k rotated in place. fp8_scales: as in
    check_decode_rotary (no dense prefill then: prompts read the cache back)."""
    head_dim, kv_heads, bs = 32, 2, 4
    kind = {} if fp8_scales is None else {"dtype": "fp8_e4m3"}
    layers = [KVLayerSpec(kv_heads * group, kv_heads, head_dim, **kind)] * 2
    backend = TritonAttention(layers, bs, dtype, device)
    backend.decode_rotary = False  # the separate kernel
    backend.dense_prefill = dense
    reference = TorchAttention(layers, bs, dtype, device)
    angles = torch.rand(64, head_dim // 2, device=device) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    spans = [(5, 12), (0, 6), (20, 21), (9, 10)]  # (cached prefix, end) per sequence
    tables = [[3, 7, 1], [4, 9], [2, 5, 8, 10, 11, 12], [6, 13, 14]]
    backend.allocate(16)
    reference.allocate(16)
    for mine, theirs in zip(backend.caches, reference.caches, strict=True):
        mine.copy_(torch.randn(mine.shape, device=device).to(mine.dtype))  # the cached prefixes
        theirs.copy_(mine)
    scales = fp8_layer_scales(fp8_scales, device)
    batch = make_attention_batch(
        [e - s for s, e in spans], [e for _, e in spans], tables, bs, device
    )
    positions = torch.cat([torch.arange(s, e) for s, e in spans]).to(device)
    tokens = positions.shape[0]
    ops = TorchOps()
    for b in (backend, reference):
        b.begin_step(batch)
    assert backend._plan is not None and bool(backend._plan.dense_tiles) == dense
    for layer, spec in enumerate(layers):
        heads = (spec.num_q_heads, kv_heads, kv_heads)
        q, k, v = (torch.randn(tokens, h, head_dim, device=device).to(dtype) for h in heads)
        fq, fk, fv = fused_views(q.clone(), k.clone(), v.clone())
        got = backend.forward_with_rotary(
            backend.layer(layer, head_dim**-0.5, **scales), fq, fk, fv, positions, cos_sin
        )
        rq, rk = ops.rotary(positions, q.clone(), k.clone(), cos_sin)
        want = reference.forward(reference.layer(layer, head_dim**-0.5, **scales), rq, rk, v)
        # Rounded like the reference: equal but for an occasional one-ulp flip (test_kernel_ops).
        assert rel_err(fq, rq) <= ROTARY_TOL[dtype], "q is rotated in place"
        assert rel_err(got, want) <= TOL[dtype]
        if fp8_scales is not None:
            same_fp8_caches(backend.caches[layer], reference.caches[layer], dtype, fp8_scales)
        else:
            assert rel_err(backend.caches[layer], reference.caches[layer]) <= ROTARY_TOL[dtype]
    # Padding: slot -1 leaves the cache alone but still rotates q.
    q, rotated = forward_padding_row(backend, cos_sin)
    assert rel_err(q, rotated) <= ROTARY_TOL[dtype]


def forward_padding_row(
    backend: TritonAttention, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-token step whose slot is -1 (a padded graph row) through forward_with_rotary at
    position 2: the cache must stay as it was. Returns q after the call and q as the torch
    reference rotates it."""
    spec, device, dtype = backend.layers[0], backend.device, backend.dtype
    pad = make_attention_batch([1], [3], [[15]], backend.block_size, device)
    pad.slot_mapping.fill_(-1)
    backend.begin_step(pad)
    before = backend.caches[0].clone()
    heads = (spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads)
    q, k, v = (torch.randn(1, h, spec.head_dim, device=device).to(dtype) for h in heads)
    position = torch.tensor([2], device=device)
    rotated = TorchOps().rotary(position, q.clone(), k.clone(), cos_sin)[0]
    backend.forward_with_rotary(backend.layer(0, 1.0), q, k, v, position, cos_sin)
    assert torch.equal(backend.caches[0].view(torch.uint8), before.view(torch.uint8))
    return q, rotated


# -- Sliding windows, learned sinks and KV groups ------------------------------------------------


def group_layers(window: int) -> list[KVLayerSpec]:
    """Two KV groups (full: layers 0, 3; sliding: 1, 2) with and without learned sinks, as
    gpt-oss alternates them (its GQA group of 8 is 4 here)."""
    sliding = {"kind": "sliding", "window": window}
    return [
        KVLayerSpec(8, 2, 16),
        KVLayerSpec(8, 2, 16, **sliding),
        KVLayerSpec(8, 2, 16, learned_sinks=True, **sliding),
        KVLayerSpec(8, 2, 16, learned_sinks=True),
    ]


def run_group_schedule(
    backend: TorchAttention,
    schedule: list[list[tuple[str, int, int]]],
    totals: dict[str, int],
    shared: dict[str, tuple[str, int]],
    tol: float,
) -> dict[str, int]:
    """Steps of (sequence, first, end) chunks over block tables from a two-group
    PagedKVManager with its prefix cache on (sliding tables lose their blocks behind the
    window, entry 0); every layer's output against float64 attention with the window and the
    sinks (featured_reference) over the same rounded inputs. shared[name] = (other, n): the
    sequence's first n tokens (ids and q/k/v) are the other's, and it starts with
    match_prefix, committed after every step. Block 0 and free blocks hold NaN, so reading one
    would show. Returns each sequence's matched prefix length."""
    from test_attention_torch import featured_reference

    from inferx_core.interfaces.kv import kv_groups
    from inferx_core.kv_manager import PagedKVManager
    from inferx_core.sequence import SamplingParams, Sequence

    layers, bs, dtype, device = backend.layers, backend.block_size, backend.dtype, backend.device
    kv = PagedKVManager(60, bs, prefix_cache=True, groups=kv_groups(layers), max_chunk=16)
    backend.allocate(60)
    gen = torch.Generator().manual_seed(3)
    sinks = [
        torch.randn(s.num_q_heads, generator=gen) * 2 if s.learned_sinks else None for s in layers
    ]
    attn = [
        backend.layer(i, 0.5, sinks=None if x is None else x.to(device))
        for i, x in enumerate(sinks)
    ]
    ids, qkv = {}, {}
    for name, n in totals.items():
        ids[name] = torch.randint(0, 1000, (n,), generator=gen).tolist()
        qkv[name] = [
            [torch.randn(n, h, 16, generator=gen).to(dtype) for h in (8, 2, 2)] for _ in layers
        ]
    for name, (other, n) in shared.items():
        ids[name][:n] = ids[other][:n]
        for mine, theirs in zip(qkv[name], qkv[other], strict=True):
            for x, y in zip(mine, theirs, strict=True):
                x[:n] = y[:n]
    seqs = {name: Sequence(ids[name], SamplingParams()) for name in totals}
    matched: dict[str, int] = {}
    for step in schedule:
        spans = []
        for name, a, b in step:
            s = seqs[name]
            if name in shared and name not in matched:
                matched[name] = s.num_computed = a = kv.match_prefix(s)  # runs from there on
            assert s.num_computed == a and kv.allocate(s, b), (name, a, b)
            s.num_computed = b
            spans.append((name, a, b))
        for cache in backend.caches:  # nobody holds block 0 or a free block: poison them
            cache[:, [0, *kv._free]] = float("nan")
        group_tables = [[seqs[n].block_tables[g] for n, _, _ in spans] for g in range(2)]
        batch = make_attention_batch(
            [b - a for _, a, b in spans], [b for _, _, b in spans], group_tables[0], bs,
            backend.device, group_tables=group_tables,
        )  # fmt: skip
        backend.begin_step(batch)
        for i, layer in enumerate(attn):
            q, k, v = (
                torch.cat([qkv[n][i][j][a:b] for n, a, b in spans]).to(device) for j in range(3)
            )
            out = backend.forward(layer, *fused_views(q, k, v)).cpu()
            spec = layers[i]
            row = 0
            for n, a, b in spans:
                full_q, full_k, full_v = qkv[n][i]
                window = spec.window if spec.kind == "sliding" else None
                expected = featured_reference(
                    full_q[a:b], full_k[:b], full_v[:b], 0.5, window, 0.0, sinks[i]
                )
                got = out[row : row + b - a]
                assert not got.isnan().any(), (i, n, a, b)
                assert rel_err(got.double(), expected) <= tol, (i, n, a, b)
                row += b - a
        for s in seqs.values():
            if s.num_computed:
                kv.commit(s)
    return matched


# a: a prompt in chunks, then decodes; b: a short prompt and decodes (its context under the
# window); c and e: fresh prompts beside them, e's longer than the window; d: a's first 32
# tokens and its own, from the prefix cache (its sliding table holds only its window's blocks).
GROUP_SCHEDULE = [
    [("a", 0, 17), ("b", 0, 3)],
    [("a", 17, 30), ("b", 3, 4), ("c", 0, 7)],
    [("a", 30, 41), ("b", 4, 11), ("c", 7, 8), ("e", 0, 26)],
    [("a", 41, 42), ("b", 11, 12), ("d", 0, 37)],
    [("a", 42, 43), ("d", 37, 38), ("c", 8, 9), ("e", 26, 27)],
    [("a", 43, 44), ("d", 38, 39)],
]
GROUP_TOTALS = {"a": 44, "b": 12, "c": 9, "d": 39, "e": 27}


@interpreted
@pytest.mark.parametrize(
    ("window", "dense", "dtype"),
    [(5, True, torch.float32), (20, False, torch.float32), (20, True, torch.float16)],
)
def test_sliding_sinks_two_groups_match_float64(
    window: int, dense: bool, dtype: torch.dtype
) -> None:
    """Sliding windows (shorter than a 16-token tile, and across the decode splits' 16-token
    boundaries; longer than b's and c's contexts) and learned sinks in two KV groups, through
    every kernel: fresh prompts (dense_prefill_kernel or prefill_kernel), chunks over a cached
    or prefix-cache-matched prefix, and decodes split over the context (a split wholly before
    the window reads nothing), in mixed steps."""
    backend = TritonAttention(
        group_layers(window), 4, dtype, torch.device("cpu"), min_split_len=1,
        target_programs=10**6,
    )  # fmt: skip
    backend.dense_prefill = dense
    assert len(backend.groups) == 2
    matched = run_group_schedule(
        backend, GROUP_SCHEDULE, GROUP_TOTALS, {"d": ("a", 32)}, TOL[dtype]
    )
    assert 0 < matched["d"] <= 32


@interpreted
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize(("window", "sinks"), [(9, False), (9, True), (0, True)])
@pytest.mark.parametrize("parts", [False, True])
def test_decode_rotary_with_windows_and_sinks(
    window: int, sinks: bool, parts: bool, keep: bool
) -> None:
    """The decode kernel's fused paths (rotary and KV write, QKV parts, early metadata and the
    preloaded first tile) on sliding layers (a 9-token window across 16-token splits) and
    layers with sinks, split: against the torch reference; a layer with sinks combines its
    splits itself (with the sinks), one without may hand them to o_proj (keep)."""
    torch.manual_seed(window + 2 * sinks + 4 * parts)
    check_decode_rotary(
        4, torch.float32, torch.device("cpu"), True, parts, early=True, preload=True,
        window=window, sinks=sinks, keep=keep,
    )  # fmt: skip


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("small_tiles", [False, True])
@pytest.mark.parametrize("window", [5, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_sliding_sinks_two_groups(window: int, dtype: torch.dtype, small_tiles: bool) -> None:
    """test_sliding_sinks_two_groups_match_float64 on the GPU's compiled kernels (dense
    prefill by TMA on sm_90), with the GPU's tiles or the interpreter's 16-token ones (then
    the decodes split at 16-token boundaries, across the window)."""
    backend = TritonAttention(
        group_layers(window), 4, dtype, torch.device("cuda"), min_split_len=1,
        target_programs=10**6,
    )  # fmt: skip
    if small_tiles:
        backend.decode_block_n = backend.prefill_block_m = backend.prefill_block_n = 16
    matched = run_group_schedule(
        backend, GROUP_SCHEDULE, GROUP_TOTALS, {"d": ("a", 32)}, TOL[dtype]
    )
    assert 0 < matched["d"] <= 32
