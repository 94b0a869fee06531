"""The triton backend over an FP8 (e4m3) KV cache against the torch reference backend over one:
the same cache bytes after every write (bit for bit, as uint8) and the same outputs within
TOL, on mixed, prefix-cached and split-decode steps, the fused rotary paths, scales != 1, and
whole models (interpreter on the CPU; the bf16 graph runs on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import fused_views, interpreted, plan_steps  # noqa: E402
from test_attention_torch import rel_err  # noqa: E402
from test_triton_attention import check_decode_rotary, check_fused_rotary  # noqa: E402

from inferx_core.attention_torch import FP8, TorchAttention  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_kernels_cuda.triton_attention import TritonAttention  # noqa: E402

# Largest |triton - torch| over the largest |torch|, both over the same e4m3 bytes: the kernels
# fold k_scale into the softmax scale and v_scale into the output (in fp32) where torch
# dequantizes into the model's dtype first, so beyond summation order they differ by that
# rounding of the dequantized values: none in fp32, an fp16 / bf16 ulp (2^-11 / 2^-8) else.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# (k_scale, v_scale), not powers of two: k / 0.013 passes 448 for |k| > 5.8 (clamped), v / 2.5
# reaches e4m3's subnormals.
SCALES = [(1.0, 1.0), (0.013, 2.5)]


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def scaled_layer(backend: TorchAttention, index: int, scales: tuple[float, float]):  # noqa: ANN201
    spec = backend.layers[index]
    k_scale, v_scale = (torch.tensor([s], device=backend.device) for s in scales)
    return backend.layer(index, spec.head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)


def fp8_layers(group: int, head_dim: int) -> list[KVLayerSpec]:
    return [
        KVLayerSpec(2 * group, 2, head_dim, dtype="fp8_e4m3"),
        KVLayerSpec(group, 1, head_dim, dtype="fp8_e4m3"),
    ]


def run_steps(
    backend: TritonAttention,
    steps: list[list[tuple[int, int]]],
    totals: list[int],
    scales: tuple[float, float],
) -> list[int]:
    """Every step through backend and through TorchAttention on the same layers: the caches
    equal bit for bit after it, the outputs within TOL. Returns each step's decode splits."""
    layers, bs, dtype, device = backend.layers, backend.block_size, backend.dtype, backend.device
    reference = TorchAttention(layers, bs, dtype, device)
    blocks = [-(-t // bs) for t in totals]
    num_blocks = sum(blocks) + 3
    for b in (backend, reference):
        b.allocate(num_blocks)
        assert all(c.dtype == FP8 for c in b.caches)
    ids = torch.randperm(num_blocks).tolist()
    tables = []
    for n in blocks:
        tables.append(ids[:n])
        ids = ids[n:]
    hist = [
        [
            (
                torch.randn(t, s.num_q_heads, s.head_dim).to(dtype),
                (torch.randn(t, s.num_kv_heads, s.head_dim) * 3).to(dtype),
                torch.randn(t, s.num_kv_heads, s.head_dim).to(dtype),
            )
            for t in totals
        ]
        for s in layers
    ]
    splits = []
    for spans in steps:
        live = [i for i, (a, b) in enumerate(spans) if b > a]
        batch = make_attention_batch(
            [spans[i][1] - spans[i][0] for i in live],
            [spans[i][1] for i in live],
            [tables[i] for i in live],
            bs,
            device,
        )
        outs = []
        for b in (backend, reference):
            b.begin_step(batch)
            per_layer = []
            for index in range(len(layers)):
                q, k, v = (
                    torch.cat([hist[index][i][j][slice(*spans[i])] for i in live]).to(device)
                    for j in range(3)
                )
                layer = scaled_layer(b, index, scales)
                per_layer.append(b.forward(layer, *fused_views(q, k, v)))
            outs.append(per_layer)
        splits.append(backend._plan.num_splits)
        if scales[0] < 1:  # some keys clamped to +-448 (0x7e under the sign bit)
            assert ((as_bytes(backend.caches[0][0]) & 0x7F) == 0x7E).any()
        for index in range(len(layers)):
            mine, theirs = backend.caches[index], reference.caches[index]
            assert torch.equal(as_bytes(mine), as_bytes(theirs)), f"layer {index}, {spans}"
            err = rel_err(outs[0][index].float(), outs[1][index].float())
            assert err <= TOL[dtype], f"layer {index}, spans {spans}: {err:.2e} against torch"
    return splits


# (cached prefix, new tokens): a fresh prompt, a chunk over a cached prefix, decodes.
PLAN = [(0, 13), (9, 7), (21, 1), (5, 1), (0, 1)]


@interpreted
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize(
    ("block_size", "group", "dtype"),
    [(4, 1, torch.float32), (16, 2, torch.float16), (4, 4, torch.bfloat16), (3, 2, torch.float32)],
)
def test_steps_match_torch_fp8(
    block_size: int, group: int, dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    """A ragged prefill, a mixed step (fresh prompt, prefix-cached chunk, decodes), decodes."""
    torch.manual_seed(block_size * 10 + group)
    backend = TritonAttention(fp8_layers(group, 16), block_size, dtype, torch.device("cpu"))
    assert not backend.dense_prefill  # an e4m3 cache: prompts read it back (prefill_kernel)
    totals, steps = plan_steps(PLAN)
    assert run_steps(backend, steps, totals, scales) == [1, 1, 1, 1]


@interpreted
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_decode_matches_torch_fp8(dtype: torch.dtype, scales: tuple[float, float]) -> None:
    torch.manual_seed(3)
    backend = TritonAttention(
        fp8_layers(2, 16), 4, dtype, torch.device("cpu"), min_split_len=1, target_programs=10**6
    )
    totals, steps = plan_steps([(40, 3), (17, 1), (0, 30)])
    splits = run_steps(backend, steps, totals, scales)
    assert max(splits[2:]) > 1  # the decode steps split their contexts


@interpreted
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_rotary_write_matches_torch_fp8(
    dtype: torch.dtype, scales: tuple[float, float]
) -> None:
    """rotary_kv_write_kernel (a mixed step: prefix-cached prompt, fresh prompt, decodes)."""
    torch.manual_seed(5)
    check_fused_rotary(2, dtype, torch.device("cpu"), fp8_scales=scales)


@interpreted
@pytest.mark.parametrize(
    ("split", "parts", "preload", "keep"),
    [(False, False, False, False), (True, False, False, True), (True, True, True, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_in_the_decode_kernel_fp8(
    dtype: torch.dtype, split: bool, parts: bool, preload: bool, keep: bool
) -> None:
    """decode_rotary: the decode kernel's own write of the new token, split or not, its QKV
    parts, its preloaded first tile (the new row taken from the e4m3 values it wrote), and the
    splits handed back to o_proj (keep_splits: v_scale already in each split's output)."""
    torch.manual_seed(6)
    check_decode_rotary(4, dtype, torch.device("cpu"), split, parts=parts, early=preload,
                        preload=preload, keep=keep, fp8_scales=SCALES[1])  # fmt: skip
