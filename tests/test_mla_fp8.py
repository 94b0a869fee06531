"""An fp8_e4m3 latent cache for MLA (DeepSeek-V2): the whole row (latent and rope key) stored as
row / k_scale in e4m3, one scale a layer. The Triton write kernel against torch's quantization
(to_fp8) byte for byte; the Triton decode (absorbed) and prefill (plain) over an e4m3 cache
against the float64 forms on the exactly dequantized latents, under TRITON_INTERPRET=1; the
triton backend's step against the torch backend's; the tiny DeepSeek-V2 generating on both
backends with the cache's bytes a token halved."""

from __future__ import annotations

import pytest
import torch
from conftest import interpreted, on_gpu

pytest.importorskip("triton")

from test_mla_decode import paged, rel_err  # noqa: E402
from test_mla_prefill import QUARTER, SMALL, TOL, Case, step_backends  # noqa: E402

from inferx_core.attention_torch import FP8, TorchAttention, mla_absorbed, to_fp8  # noqa: E402
from inferx_core.interfaces.attention import AttentionLayer, MLAWeights  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_kernels_cuda import triton_attention  # noqa: E402
from inferx_kernels_cuda.mla_decode import mla_decode, mla_decode_absorbed, write_latent  # noqa: E402

SCALES = [1.0, 0.05]


def quantized(cache: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the e4m3 cache of cache / scale, its exact dequantization in float64)."""
    q = to_fp8(cache, torch.tensor([scale]))
    return q, q.double() * scale


@interpreted
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_latent_write_equals_torch_quantization(dtype: torch.dtype, scale: float):
    """mla_write_kernel's e4m3 bytes are to_fp8's (IEEE division, clamp to +-448, nearest
    even; the interpreter rounds by hand) for every element, outliers past 448 * scale and
    subnormals included; slot -1 writes nothing. Exact: the same inputs, one rounding."""
    g = torch.Generator().manual_seed(11)
    width = 40  # latent 32 + rope 8
    rows = torch.randn(7, width, generator=g) * 4 * scale
    rows[0, :4] = torch.tensor([1e4, -1e4, 449.0, -500.0]) * scale  # clamped
    rows[1, :4] = torch.tensor([1e-3, -3e-3, 2.0**-9, 0.0]) * scale  # e4m3 subnormals
    rows = rows.to(dtype)
    slots = torch.tensor([5, 0, -1, 17, 9, -1, 22])
    cache = torch.zeros(6, 4, 1, width, dtype=FP8)
    k_scale = torch.tensor([scale])
    write_latent(rows, cache, slots, k_scale)
    want = torch.zeros(24, width, dtype=torch.uint8)
    keep = slots >= 0
    want[slots[keep]] = to_fp8(rows[keep], k_scale).view(torch.uint8)
    assert torch.equal(cache.view(-1, width).view(torch.uint8), want)
    assert cache.view(torch.uint8).view(-1, width)[slots[keep]].any(-1).all()


@interpreted
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_latent_decode_over_e4m3_cache(dtype: torch.dtype, tol: float, scale: float):
    """mla_decode over an e4m3 cache (several splits, empty ones for the short sequence)
    against softmax(q . rows * scale) @ latents in float64 on the exactly dequantized rows,
    within tol of the largest element (q's rounding; the kernel folds k_scale into the softmax
    scale and the output)."""
    rank, rope, block_size = 32, 8, 4
    contexts = [70, 3, 33]
    cache, table, ctx, _ = paged(contexts, rank + rope, block_size, torch.float32, seed=1)
    cache_q, exact = quantized(cache * 3 * scale, scale)
    rows = [exact[table[i]].reshape(-1, rank + rope)[:c] for i, c in enumerate(contexts)]
    q = torch.randn(len(contexts), 5, rank + rope, generator=torch.Generator().manual_seed(2))
    q = q.to(dtype)
    k_scale = torch.tensor([scale])
    out = mla_decode(q, cache_q, table, ctx, 0.2, rank, 4, 16, block_n=16, k_scale=k_scale)
    for i, r in enumerate(rows):
        probs = (q[i].double() @ r.t() * 0.2).softmax(-1)
        assert rel_err(out[i], probs @ r[:, :rank]) <= tol, i


@interpreted
def test_absorbed_decode_over_e4m3_cache():
    """mla_decode_absorbed (W_UK, W_UV around the kernel) over an e4m3 cache against
    mla_absorbed in float64 on the dequantized rows: fp16, 3e-3."""
    heads, nope, rope, v, rank = 4, 16, 16, 16, 64
    contexts = [9, 40, 1]
    cache, table, ctx, _ = paged(contexts, rank + rope, 16, torch.float32, seed=3)
    cache_q, exact = quantized(cache, 0.5)
    rows = [exact[table[i]].reshape(-1, rank + rope)[:c] for i, c in enumerate(contexts)]
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).half()
    mla = MLAWeights(nope, v, lambda latent: latent)
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).half()
    scale = (nope + rope) ** -0.5
    out = mla_decode_absorbed(
        q, cache_q, table, ctx, mla, scale, num_splits=3, min_split_len=8,
        k_scale=torch.tensor([0.5]),
    )  # fmt: skip
    ref = MLAWeights(nope, v, lambda latent: latent)
    ref.w_uk, ref.w_uv = w[:, :nope].double(), w[:, nope:].double()
    for i, r in enumerate(rows):
        want = mla_absorbed(q[i : i + 1].double(), r, ref, scale)[0]
        assert rel_err(out[i], want) <= 3e-3, i


def fp8_step(case: Case, device: str, context_rows: int, scale: float, tol: float) -> None:
    """The triton backend's MLA step (fresh prompt, chunk over a cached prefix, decodes) over
    an e4m3 cache against the torch backend's: the same bytes in both caches after the step,
    outputs within tol of each other and of the float64 plain form on the dequantized cache.
    The case's cache becomes its e4m3 version (the step's own rows quantize to the same bytes
    at their slots), and its contexts the exact dequantized rows."""
    heads, nope, rope, v, rank = case.widths
    width = rank + rope
    cache_q, exact = quantized(case.cache.cpu().float() * 3 * scale, scale)
    case.rows = (case.rows.float() * 3 * scale).to(case.dtype)
    # The rows the step writes quantize to the bytes the reference holds at their slots.
    slots = case.batch.slot_mapping.cpu()
    k_scale = torch.tensor([scale], device=device)
    flat_q = cache_q.view(-1, width).view(torch.uint8)
    flat_q[slots] = to_fp8(case.rows.cpu(), k_scale.cpu()).view(torch.uint8)
    flat = exact.view(-1, width)
    flat[slots] = flat_q[slots].view(FP8).double() * scale
    case.contexts = [
        flat[(torch.tensor(t)[torch.arange(c) // case.block_size] * case.block_size
              + torch.arange(c) % case.block_size)]
        for t, c in zip(case.tables, case.context_lens, strict=True)
    ]  # fmt: skip
    spec = KVLayerSpec(heads, 1, width, kind="mla", v_head_dim=rank, rope_dim=rope,
                       dtype="fp8_e4m3")  # fmt: skip
    (triton_b, torch_b), mla = step_backends(case, spec, device, context_rows)
    outs = []
    for b in (triton_b, torch_b):
        assert b.caches[0].dtype == FP8
        b.caches[0].view(torch.uint8).copy_(cache_q.view(torch.uint8).to(device))
        b.caches[0].view(-1, width).view(torch.uint8)[slots.to(device)] = 0  # the step writes
        b.begin_step(case.batch)
        layer = AttentionLayer(0, spec, case.scale, k_scale=k_scale, mla=mla)
        k = case.rows[:, None]
        outs.append(b.forward(layer, case.q, k, k[..., :rank]))
    mine, theirs = (b.caches[0].view(torch.uint8).cpu() for b in (triton_b, torch_b))
    assert torch.equal(mine, theirs)
    assert torch.equal(mine, cache_q.view(torch.uint8))
    assert rel_err(outs[0], outs[1]) <= tol
    case.check(outs[0], tol)
    # The decode rows (absorbed) against the float64 absorbed form on the dequantized rows.
    ref = MLAWeights(nope, v, lambda latent: latent)
    ref.w_uk, ref.w_uv = mla.w_uk.double().cpu(), mla.w_uv.double().cpu()
    at = 0
    for q_len, ctx in zip(case.query_lens, case.contexts, strict=True):
        if q_len == 1:
            want = mla_absorbed(case.q[at : at + 1].double().cpu(), ctx, ref, case.scale)
            assert rel_err(outs[0][at : at + 1].cpu(), want) <= tol, at
        at += q_len


@interpreted
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("context_rows", [1 << 20, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_step_over_e4m3_cache(dtype: torch.dtype, context_rows: int, scale: float):
    """A fresh prompt, a chunk over a cached prefix (gathered, dequantized, expanded through
    kv_b_proj; in one pass or pieces of 20 rows) and decodes: TOL of the dtype (fp32 1e-5,
    fp16 3e-3)."""
    case = Case([9, 1, 6, 1], [9, 14, 27, 3], SMALL, dtype, seed=4)
    fp8_step(case, "cpu", context_rows, scale, TOL[dtype])


@interpreted
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fresh_prompts_over_e4m3_cache_see_quantized_rows(dtype: torch.dtype, scale: float):
    """Fresh prompts only (beside a decode): the prefill's one pass reads the step's own rows,
    not the cache, so it must quantize them as the write does; else it is e4m3's rounding
    (~2^-4) away from the reference, far past TOL."""
    case = Case([9, 1, 12], [9, 14, 12], SMALL, dtype, seed=5)
    fp8_step(case, "cpu", 1 << 20, scale, TOL[dtype])


def test_e4m3_latent_cache_takes_a_byte_a_value():
    """bytes_per_block: (rank + rope) bytes a token a layer, half of bf16's."""
    specs = [KVLayerSpec(16, 1, 576, kind="mla", v_head_dim=512, rope_dim=64, dtype=d)
             for d in ("auto", "fp8_e4m3")]  # fmt: skip
    sizes = [TorchAttention([s] * 27, 16, torch.bfloat16, torch.device("cpu")).bytes_per_block()
             for s in specs]  # fmt: skip
    assert sizes == [576 * 2 * 27 * 16, 576 * 27 * 16]


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize(("widths", "dtype"), [(SMALL, torch.float32), (QUARTER, torch.bfloat16)])
def test_compiled_backend_step_over_e4m3_cache(widths, dtype: torch.dtype, scale: float):
    """fp8_step compiled on the GPU: a 300-token fresh prompt, a 100-token chunk over a
    600-token prefix and decodes in 16-token blocks; fp32 1e-4, bf16 2e-2 (TMA loads on
    Hopper at QUARTER's widths)."""
    case = Case([300, 1, 100, 1], [300, 500, 700, 40], widths, dtype, block_size=16,
                seed=7, device="cuda")  # fmt: skip
    fp8_step(case, "cuda", 256, scale, 1e-4 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@on_gpu
def test_compiled_decode_over_e4m3_cache_at_v2_lite_widths():
    """mla_decode_absorbed compiled, bf16 queries, V2-Lite's widths, contexts up to 3000
    tokens, 8 splits, k_scale 0.05 (through a tensor, as a graph reads it): against
    mla_absorbed in float64 on the dequantized rows, 2e-2 of the largest element."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    contexts = [1, 17, 255, 256, 1000, 2047, 3000, 64]
    cache, table, ctx, _ = paged(contexts, rank + rope, 16, torch.float32, seed=6)
    cache_q, exact = quantized(cache * 0.15, 0.05)
    rows = [exact[table[i]].reshape(-1, rank + rope)[:c] for i, c in enumerate(contexts)]
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).bfloat16()
    mla = MLAWeights(nope, v, lambda latent: latent)
    mla.w_uk, mla.w_uv = w[:, :nope].cuda(), w[:, nope:].cuda()
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).bfloat16()
    scale = 192**-0.5
    out = mla_decode_absorbed(
        q.cuda(), cache_q.cuda(), table.cuda(), ctx.cuda(), mla, scale, 8, 256,
        k_scale=torch.tensor([0.05], device="cuda"),
    )  # fmt: skip
    ref = MLAWeights(nope, v, lambda latent: latent)
    ref.w_uk, ref.w_uv = w[:, :nope].double(), w[:, nope:].double()
    for i, r in enumerate(rows):
        want = mla_absorbed(q[i : i + 1].double(), r, ref, scale)[0]
        assert rel_err(out[i].cpu(), want) <= 2e-2, i


@pytest.mark.gpu
@on_gpu
def test_captured_decode_reads_the_scale_at_replay():
    """The e4m3 decode in a CUDA graph: the scale is read through its tensor at replay, so a
    graph captured at k_scale 1.0 replays a new cache and scale (0.25) like an eager call."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    contexts = [5, 300, 40]
    cache, table, ctx, _ = paged(contexts, rank + rope, 16, torch.float32, seed=9, device="cuda")
    g = torch.Generator().manual_seed(10)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).bfloat16().cuda()
    mla = MLAWeights(nope, v, lambda latent: latent)
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).bfloat16().cuda()
    k_scale = torch.ones(1, device="cuda")
    cache_q = to_fp8(cache, k_scale)

    def step() -> torch.Tensor:
        return mla_decode_absorbed(q, cache_q, table, ctx, mla, 0.1, 4, 16, k_scale=k_scale)

    step()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    cache_q.copy_(to_fp8(cache * 0.5, torch.tensor([0.25], device="cuda")))
    k_scale.fill_(0.25)
    graph.replay()
    assert torch.equal(out, step())


# -- the tiny DeepSeek-V2 with kv_cache.dtype = fp8_e4m3 -------------------------------------------


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_deepseek_v2 import hf_model
    from test_models import saved

    return saved(hf_model("lite"), tmp_path_factory, "lite")[0]


FP8_KV = {"kv_cache.dtype": "fp8_e4m3", "kv_cache.memory": "2MiB"}
MODEL_PROMPTS = [list(range(3, 30)), [5, 9, 17, 33, 65, 129, 200]]


def generate_top5(llm) -> list:
    from inferx_core.sequence import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    done = llm.generate(MODEL_PROMPTS, params)
    return [(c.token_ids, [[t for t, _ in top] for _, top in c.logprobs]) for c in done]


def agree_in_top5(got: list, want: list) -> None:
    """vLLM's check: identical tokens up to the first divergence, where each side's token is
    in the other's top 5."""
    for (tokens_a, top_a), (tokens_b, top_b) in zip(got, want, strict=True):
        assert len(tokens_a) == len(tokens_b)
        for i, (a, b) in enumerate(zip(tokens_a, tokens_b, strict=True)):
            if a != b:
                assert a in top_b[i] and b in top_a[i], (i, tokens_a, tokens_b)
                break


@interpreted
def test_deepseek_with_e4m3_latents_generates_alike_on_torch_and_triton(lite, monkeypatch):
    """The tiny V2-Lite (fp32) with an e4m3 latent cache: the triton backend (chunked prefill
    over cached prefixes, split decodes) gives the torch backend's greedy tokens (both hold the
    same bytes and attend the same dequantized latents; the reference for the torch path is
    its own quantize-dequantize, then the plain and absorbed forms tested against transformers
    with a full-precision cache), and both agree with the full-precision cache in the top-5
    sense. The cache takes (rank + rope) bytes a token a layer: a quarter of fp32's, so the
    same memory holds four times the blocks."""
    from test_engine import make_llm
    from test_models import CHUNKED_PREFILL

    torch_fp8 = make_llm(lite, **FP8_KV)
    plain = make_llm(lite, **{"kv_cache.memory": "2MiB"})
    spec = torch_fp8.engine.executor.attention.layers[0]
    width, layers = spec.head_dim, len(torch_fp8.engine.executor.attention.layers)
    block = torch_fp8.engine.executor.attention.block_size
    assert torch_fp8.engine.executor.attention.bytes_per_block() == width * layers * block
    assert plain.engine.executor.attention.bytes_per_block() == 4 * width * layers * block
    assert torch_fp8.engine.executor.num_kv_blocks == 4 * plain.engine.executor.num_kv_blocks
    want = generate_top5(torch_fp8)
    agree_in_top5(want, generate_top5(plain))

    triton_fp8 = make_llm(
        lite, **FP8_KV, **CHUNKED_PREFILL, **{"engine.attention_backend": "triton"}
    )
    attention = triton_fp8.engine.executor.attention
    assert attention.caches[0].dtype == FP8
    assert attention.bytes_per_block() == width * layers * attention.block_size
    attention.mla_min_split_len, attention.mla_max_splits = 16, 4
    attention.target_programs = 10**6
    attention.mla_context_rows = 20
    plans: list = []
    plan = triton_attention.plan_prefill

    def recorded(*args, **kwargs):  # noqa: ANN202
        plans.append(plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(triton_attention, "plan_prefill", recorded)
    got = generate_top5(triton_fp8)
    assert [t for t, _ in got] == [t for t, _ in want]
    # chunks over cached prefixes gathered from the e4m3 cache, in pieces of 20 rows
    assert any(p is not None and p.passes[0].slots is not None and p.pieces for p in plans)


def test_checkpoint_k_scale_reaches_the_latent_cache(lite, tmp_path):
    """self_attn.k_scale of a checkpoint is the layer's latent scale (v_scale has no use: the
    latent is the value too); a cache in the model's dtype ignores it."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_engine import make_llm

    path = tmp_path / "scaled"
    shutil.copytree(lite, path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor([0.125])
    save_file(tensors, path / "model.safetensors")
    llm = make_llm(path, **FP8_KV)
    layers = llm.engine.executor.model.model.layers
    assert [a.self_attn.attn.k_scale.item() for a in layers] == [0.5, 0.125, 1.0]
    agree_in_top5(generate_top5(llm), generate_top5(make_llm(lite, **FP8_KV)))
    assert make_llm(path).engine.executor.model.model.layers[0].self_attn.k_scale is None
