"""The triton backend over an FP8 (e4m3) KV cache against the torch reference backend over one:
the same cache bytes after every write (bit for bit, as uint8) and the same outputs within
TOL, on mixed, prefix-cached and split-decode steps, the fused rotary paths, scales != 1, and
whole models (interpreter on the CPU; the bf16 graph runs on a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import fused_views, interpreted, on_gpu, plan_steps, scattered_tables  # noqa: E402
from test_attention_torch import rel_err  # noqa: E402
from test_fp8 import tiny_llama  # noqa: E402
from test_fp8_kv import PROMPTS, make_llm, run  # noqa: E402
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
    backend: TorchAttention,
    steps: list[list[tuple[int, int]]],
    totals: list[int],
    scales: tuple[float, float],
) -> list[int | None]:
    """Every step through backend and through TorchAttention on the same layers: the caches
    equal bit for bit after it, the outputs within TOL. Returns each step's decode splits
    (None for a backend that plans none: flashinfer)."""
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
        splits.append(getattr(backend._plan, "num_splits", None))
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
    backend.dense_prefill = True  # switched on anyway: prompts still read the e4m3 cache back
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


@interpreted
@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_static_plans_match_torch_fp8(dtype: torch.dtype, mixed: bool) -> None:
    """The CUDA-graph paths against TorchAttention over e4m3 caches with scales: the decode
    plan prepared for 4 rows, replayed for 4 and then 2 rows, or (mixed) the mixed plan of 48
    tokens replayed for prompt chunks over cached prefixes beside decodes; padding rows get
    garbage and a slot of -1. The same bytes after each step, the same outputs within TOL.
    The scales are read through their pointers, so replays see values set after the plan was
    prepared."""
    torch.manual_seed(8)
    bs, max_blocks = 4, 16
    num_blocks = 4 * max_blocks + 1
    layers = fp8_layers(2, 16)
    split = {"min_split_len": 16, "target_programs": 12}
    static = TritonAttention(layers, bs, dtype, torch.device("cpu"), **split)
    reference = TorchAttention(layers, bs, dtype, torch.device("cpu"))
    for b in (static, reference):
        b.allocate(num_blocks)
    for mine, theirs in zip(static.caches, reference.caches, strict=True):
        mine.copy_(torch.randn(mine.shape).to(FP8))
        theirs.copy_(mine)
    k_scale, v_scale = torch.ones(1), torch.ones(1)
    padded = 48 if mixed else 4
    if mixed:
        static.init_mixed_graph_buffers(padded, 6, max_blocks)
        static.prepare_mixed_capture(padded)
        steps = [([9, 1, 20, 1, 3], [30, 17, 20, 64, 3]), ([1, 13], [40, 13])]
    else:
        static.init_graph_buffers(8, max_blocks)
        static.prepare_for_capture(padded)
        steps = [([1] * 4, [37, 5, 64, 20]), ([1, 1], [1, 50])]
    assert static._plan is not None and static._plan.num_splits > 1
    for (query_lens, contexts), scales in zip(steps, (SCALES[1], (0.5, 3.0)), strict=True):
        k_scale.fill_(scales[0])  # in place: the pointer the plan's launches hold
        v_scale.fill_(scales[1])
        tables = scattered_tables(contexts, bs, num_blocks)
        batch = make_attention_batch(query_lens, contexts, tables, bs)
        if mixed:
            static.prepare_mixed_replay(batch, padded)
        else:
            static.prepare_for_replay(batch, padded)
        reference.begin_step(batch)
        real = sum(query_lens)
        for index, spec in enumerate(layers):
            heads = (spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads)
            qkv = [(torch.randn(padded, h, spec.head_dim) * 3).to(dtype) for h in heads]
            scale = spec.head_dim**-0.5
            got = static.forward(static.layer(index, scale, k_scale=k_scale, v_scale=v_scale),
                                 *qkv)[:real]  # fmt: skip
            want = reference.forward(
                reference.layer(index, scale, k_scale=k_scale, v_scale=v_scale),
                *(x[:real] for x in qkv),
            )
            assert rel_err(got.float(), want.float()) <= TOL[dtype], (contexts, index)
            mine, theirs = static.caches[index], reference.caches[index]
            assert torch.equal(as_bytes(mine), as_bytes(theirs)), (contexts, index)


# --- whole models ---


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    return tiny_llama(tmp_path_factory.mktemp("llama"), 64, 4, 2, 128)


@interpreted
def test_fp8_kv_model_on_triton_matches_torch(llama) -> None:  # noqa: ANN001
    """The tiny Llama in float32 with an e4m3 cache: the triton backend generates the same
    greedy tokens as the torch backend (exactly: both quantize to the same bytes, and their
    logits differ by summation order only), prompts then prompts over their cached prefixes."""
    fp8 = {"kv_cache.dtype": "fp8_e4m3", "kv_cache.memory": "4MiB"}
    on_triton = make_llm(llama, **fp8, **{"engine.attention_backend": "triton"})
    on_torch = make_llm(llama, **fp8)
    assert isinstance(on_triton.engine.executor.attention, TritonAttention)
    assert not isinstance(on_torch.engine.executor.attention, TritonAttention)
    assert on_triton.engine.executor.attention.caches[0].dtype == FP8
    again = [p[:40] + [9, 8, 7] for p in PROMPTS if len(p) > 40]  # prefix-cache hits
    for prompts in (PROMPTS, again):
        got, want = run(on_triton, prompts), run(on_torch, prompts)
        assert [ids for ids, _ in got] == [ids for ids, _ in want]


@interpreted
def test_fp8_kv_graph_runner_generates_like_eager(llama) -> None:  # noqa: ANN001
    """The decode graph runner's static plan (no graph to replay on the CPU: the same pass
    runs) over an e4m3 cache, split in 4: the same tokens and logits as eager steps."""
    from test_cuda_graphs import generates_like_eager

    from inferx_kernels_cuda.cuda_graphs import DecodeGraphRunner

    llm = make_llm(
        llama,
        **{
            "kv_cache.dtype": "fp8_e4m3",
            "engine.attention_backend": "triton",
            "model.max_model_len": 64,
            "engine.overlap": True,
            "scheduler.max_running": 4,
            "scheduler.prefix_cache": False,
        },
    )
    ex = llm.engine.executor
    assert ex.attention.caches[0].dtype == FP8
    ex.attention.min_split_len = 16
    ex.attention.target_programs = 10**6

    def install() -> None:
        ex.graphs = DecodeGraphRunner(ex.model, ex.attention, ex.device, 4, ex.max_model_len, 16)

    generates_like_eager(llm, install)
    assert ex.graphs.replays


def bf16_to_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make Triton's interpreter round fp32 -> bf16 to nearest, as the GPU does (it truncates:
    test_kernel_ops), so that bf16 kernels can be checked on the CPU as the GPU runs them."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        pytest.skip("this Triton's interpreter has no _convert_float to patch")

    def nearest(data, src, dst, rounding):  # noqa: ANN001, ANN202 - the interpreter's own
        if src == tl.float32 and dst == tl.bfloat16:
            x = torch.from_numpy(np.frombuffer(data.tobytes(), np.float32).reshape(data.shape))
            return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", nearest)


@interpreted
def test_fused_rotary_paths_fp8_bf16_as_the_gpu_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU test below on the CPU: bf16 rounded to nearest in the interpreter (bf16 tl.dot
    still upcast there), the GPU's 64-token tiles, e4m3 caches at SCALES[1]: the rotary write
    and the decode kernel's own write, split, early and preloading, against torch with the
    same bytes in the caches (same_fp8_caches) and outputs within TOL."""
    bf16_to_nearest(monkeypatch)
    init = TritonAttention.__init__

    def gpu_tiles(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        init(self, *args, **kwargs)
        self.decode_block_n = self.prefill_block_m = self.prefill_block_n = 64

    monkeypatch.setattr(TritonAttention, "__init__", gpu_tiles)
    torch.manual_seed(12)
    cpu = torch.device("cpu")
    check_fused_rotary(4, torch.bfloat16, cpu, fp8_scales=SCALES[1])
    check_decode_rotary(4, torch.bfloat16, cpu, False, fp8_scales=SCALES[1])
    check_decode_rotary(4, torch.bfloat16, cpu, True, early=True, preload=True,
                        fp8_scales=SCALES[1])  # fmt: skip


# --- on a GPU (compiled kernels, bf16) ---


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("scales", SCALES)
def test_gpu_steps_match_torch_fp8_bf16(scales: tuple[float, float]) -> None:
    """run_steps on the GPU in bf16 at the GPU's tiles: the same bytes as torch's to_fp8
    (Triton's fp32 division and e4m3 cast round to nearest), split decodes included."""
    torch.manual_seed(11)
    layers = [KVLayerSpec(8, 2, 128, dtype="fp8_e4m3"), KVLayerSpec(4, 4, 64, dtype="fp8_e4m3")]
    backend = TritonAttention(layers, 16, torch.bfloat16, torch.device("cuda"), min_split_len=16)
    totals, steps = plan_steps([(0, 130), (200, 70), (300, 1), (65, 1), (0, 1)])
    run_steps(backend, steps, totals, scales)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(
    ("path", "split"),
    [("write", False), ("decode", False), ("decode", True), ("preload", False), ("preload", True)],
)
def test_gpu_fused_rotary_paths_fp8_bf16(path: str, split: bool) -> None:
    """rotary_kv_write_kernel (write) and the decode kernel's own write (decode; preload: its
    early, preloading form) over e4m3 caches, bf16, against torch: one path a case, so that a
    failure names its kernel."""
    torch.manual_seed(12)
    cuda = torch.device("cuda")
    if path == "write":
        check_fused_rotary(4, torch.bfloat16, cuda, fp8_scales=SCALES[1])
        return
    early = path == "preload"
    check_decode_rotary(4, torch.bfloat16, cuda, split, early=early, preload=early,
                        fp8_scales=SCALES[1])  # fmt: skip


@pytest.mark.gpu
@on_gpu
def test_gpu_fp8_kv_triton_graphs_agree_with_torch(tmp_path_factory) -> None:  # noqa: ANN001
    """The tiny Llama in bf16 with an e4m3 cache: the triton backend with CUDA graphs against
    the torch backend, greedy tokens in the top-5 sense (identical up to the first divergence,
    there each side's token in the other's top 5): bf16 attention rounds differently in each."""
    from test_fp8_kv import agree_in_top5

    path = tiny_llama(tmp_path_factory.mktemp("llama_gpu"), 64, 4, 2, 128)
    base = {
        "model.dtype": "bfloat16",
        "engine.device": "cuda",
        "kv_cache.dtype": "fp8_e4m3",
        "kv_cache.memory": "256MiB",
    }
    on_triton = make_llm(path, **base, **{"engine.attention_backend": "triton"})
    assert on_triton.engine.executor.graphs is not None, on_triton.engine.executor.eager_reason
    assert on_triton.engine.executor.attention.caches[0].dtype == FP8
    on_torch = make_llm(
        path, **base, **{"engine.attention_backend": "torch", "engine.cuda_graphs": False}
    )
    assert not isinstance(on_torch.engine.executor.attention, TritonAttention)
    prompts = PROMPTS + [list(range(3, 200)), [11] * 5]
    agree_in_top5(run(on_triton, prompts), run(on_torch, prompts))
    assert on_triton.engine.executor.graphs.replays
