"""The Triton MLA decode kernel (inferx_kernels_cuda.mla_decode) under TRITON_INTERPRET=1 against
the torch absorbed form (inferx_core.attention_torch.mla_absorbed) over a scattered paged latent
cache: one and several context splits, contexts shorter than a tile, empty splits, heads fewer
than the program's 16 rows, fp32 and fp16."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import interpreted, on_gpu

pytest.importorskip("triton")

from inferx_core.attention_torch import mla_absorbed  # noqa: E402
from inferx_core.interfaces.attention import MLAWeights  # noqa: E402
from inferx_kernels_cuda.mla_decode import mla_decode, mla_decode_absorbed  # noqa: E402


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def paged(
    contexts: list[int],
    width: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    device: str = "cpu",
):
    """Random cache rows for each sequence, in scattered blocks: (cache [blocks, block_size, 1,
    width], block_table [B, max_blocks] int32, context_len [B] int32, each sequence's rows)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for c in contexts]
    num_blocks = sum(need) + 3
    ids = random.Random(seed).sample(range(num_blocks), num_blocks)
    cache = torch.randn(num_blocks, block_size, 1, width, generator=g).to(dtype)
    table = torch.zeros(len(contexts), max(need), dtype=torch.int32)
    cache = cache.to(device)
    rows = []
    for i, (c, n) in enumerate(zip(contexts, need, strict=True)):
        blocks = [ids.pop() for _ in range(n)]
        table[i, :n] = torch.tensor(blocks, dtype=torch.int32)
        rows.append(cache[blocks].reshape(-1, width)[:c])
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    return cache, table.to(device), ctx, rows


def weights(heads: int, nope: int, v: int, rank: int, dtype: torch.dtype, seed: int) -> MLAWeights:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).to(dtype)
    mla = MLAWeights(nope, v, lambda latent: latent)  # expand: unused by the absorbed form
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    return mla


@interpreted
@pytest.mark.parametrize(
    ("contexts", "num_splits", "min_split_len"),
    [
        ([1, 5, 33], 1, 256),  # one split; a context shorter than a tile
        ([70, 3, 129], 4, 16),  # several splits, some of them empty for the short sequence
    ],
)
@pytest.mark.parametrize("heads", [16, 5])
def test_latent_decode_equals_torch_reference(
    contexts: list[int], num_splits: int, min_split_len: int, heads: int
):
    """mla_decode's latent-space output against softmax(q . rows * scale) @ latents in float64:
    fp32 to 1e-5 of the largest element."""
    rank, rope, block_size = 64, 16, 4
    cache, table, ctx, rows = paged(contexts, rank + rope, block_size, torch.float32, seed=1)
    q = torch.randn(len(contexts), heads, rank + rope, generator=torch.Generator().manual_seed(2))
    out = mla_decode(q, cache, table, ctx, 0.2, rank, num_splits, min_split_len, block_n=16)
    assert out.shape == (len(contexts), heads, rank)
    # the latent and rope parts of q as two tensors (mla_decode_absorbed's form): the same
    apart = mla_decode(
        q[..., :rank].contiguous(), cache, table, ctx, 0.2, rank, num_splits, min_split_len,
        block_n=16, q_pe=q[..., rank:].contiguous(),
    )  # fmt: skip
    assert torch.equal(apart, out)
    for i, r in enumerate(rows):
        probs = (q[i].double() @ r.double().t() * 0.2).softmax(-1)
        assert rel_err(out[i], probs @ r[:, :rank].double()) <= 1e-5, i


@interpreted
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_absorbed_decode_equals_torch_absorbed_form(dtype: torch.dtype, tol: float):
    """A decode step with DeepSeek-V2's widths (16 heads, nope 128, rope 64, v 128, latent
    512) and three context splits: the kernel and W_UK / W_UV around it against
    mla_absorbed per sequence in float64 on the same (rounded) inputs."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    contexts = [9, 40, 1]
    cache, table, ctx, rows = paged(contexts, rank + rope, 16, dtype, seed=3)
    mla = weights(heads, nope, v, rank, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).to(dtype)
    scale = 192**-0.5
    out = mla_decode_absorbed(q, cache, table, ctx, mla, scale, num_splits=3, min_split_len=8)
    ref_mla = weights(heads, nope, v, rank, torch.float64, seed=4)
    ref_mla.w_uk, ref_mla.w_uv = mla.w_uk.double(), mla.w_uv.double()
    for i, r in enumerate(rows):
        want = mla_absorbed(q[i : i + 1].double(), r.double(), ref_mla, scale)[0]
        assert rel_err(out[i], want) <= tol, i


@interpreted
def test_shapes_it_cannot_run_are_refused():
    q = torch.zeros(1, 4, 96)
    cache = torch.zeros(2, 4, 1, 96)
    table = torch.zeros(1, 1, dtype=torch.int32)
    ctx = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="power-of-two"):
        mla_decode(q, cache, table, ctx, 0.1, rank=48)  # 48 + 48
    with pytest.raises(ValueError, match="one KV"):
        mla_decode(q, torch.zeros(2, 4, 2, 96), table, ctx, 0.1, rank=64)
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode(q[..., :64], cache, table, ctx, 0.1, rank=64, q_pe=q[:, :2, 64:])


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_compiled_decode_on_the_gpu(num_splits: int):
    """Compiled for the GPU, bf16, V2-Lite's widths, a batch of eight contexts up to 3000 tokens
    in blocks of 16: against mla_absorbed in float64 on the same bf16 inputs, to 2e-2 of the
    largest element (bf16 rounding of q, the probabilities and the output)."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    contexts = [1, 17, 255, 256, 1000, 2047, 3000, 64]
    cache, table, ctx, rows = paged(contexts, rank + rope, 16, torch.bfloat16, 6, "cuda")
    mla = weights(heads, nope, v, rank, torch.bfloat16, seed=7)
    mla.w_uk, mla.w_uv = mla.w_uk.cuda(), mla.w_uv.cuda()
    g = torch.Generator().manual_seed(8)
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).to(torch.bfloat16).cuda()
    scale = 192**-0.5
    out = mla_decode_absorbed(q, cache, table, ctx, mla, scale, num_splits, min_split_len=256)
    ref_mla = MLAWeights(nope, v, lambda latent: latent)
    ref_mla.w_uk, ref_mla.w_uv = mla.w_uk.double(), mla.w_uv.double()
    for i, r in enumerate(rows):
        want = mla_absorbed(q[i : i + 1].double(), r.double(), ref_mla, scale)[0]
        assert rel_err(out[i], want) <= 2e-2, i
