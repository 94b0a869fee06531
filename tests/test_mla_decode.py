"""The Triton MLA decode kernel (inferx_kernels_cuda.mla_decode) under TRITON_INTERPRET=1 against
the torch absorbed form (inferx_core.attention_torch.mla_absorbed) over a scattered paged latent
cache: one and several context splits, contexts shorter than a tile, empty splits, heads fewer
than the program's 16 rows, fp32 and fp16. mla_decode_absorbed's fused form (W_UK and the split
combine with W_UV in Triton) against the same reference and against the unfused form, through
each of its kernel's tile paths, with sequences of no context (a mixed graph's unused slots)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import interpreted, on_gpu

pytest.importorskip("triton")

from inferx_core.attention_torch import mla_absorbed  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.interfaces.attention import AttentionLayer, MLAWeights  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_kernels_cuda import mla_decode as mla_decode_module  # noqa: E402
from inferx_kernels_cuda.mla_decode import mla_decode, mla_decode_absorbed  # noqa: E402
from inferx_kernels_cuda.triton_attention import TritonAttention  # noqa: E402


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


def weights(
    heads: int, nope: int, v: int, rank: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> MLAWeights:
    """W_UK and W_UV as views of one [heads, nope + v, rank] tensor (MLAttention.absorb's)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads, nope + v, rank, generator=g) / rank**0.5).to(device, dtype)
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


def reference(q: torch.Tensor, rows: list, mla: MLAWeights, scale: float) -> list:
    """mla_absorbed per sequence in float64 on the same (rounded) inputs and weights (None
    for a sequence of no context)."""
    ref = MLAWeights(mla.qk_nope_head_dim, mla.v_head_dim, lambda latent: latent)
    ref.w_uk, ref.w_uv = mla.w_uk.double(), mla.w_uv.double()
    return [
        mla_absorbed(q[i : i + 1].double(), r.double(), ref, scale)[0] if len(r) else None
        for i, r in enumerate(rows)
    ]


@interpreted
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_absorbed_decode_equals_torch_absorbed_form(dtype: torch.dtype, tol: float, fused: bool):
    """A decode step with DeepSeek-V2's widths (16 heads, nope 128, rope 64, v 128, latent
    512) and three context splits: the kernel and W_UK / W_UV around it (fused: in Triton,
    the output contiguous) against mla_absorbed per sequence in float64 on the same (rounded)
    inputs."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    contexts = [9, 40, 1]
    cache, table, ctx, rows = paged(contexts, rank + rope, 16, dtype, seed=3)
    mla = weights(heads, nope, v, rank, dtype, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).to(dtype)
    scale = 192**-0.5
    out = mla_decode_absorbed(
        q, cache, table, ctx, mla, scale, num_splits=3, min_split_len=8, fused=fused
    )
    assert out.shape == (len(contexts), heads, v) and out.dtype == dtype
    assert out.is_contiguous() == fused  # the unfused form's last einsum: a permuted view
    for i, want in enumerate(reference(q, rows, mla, scale)):
        assert rel_err(out[i], want) <= tol, i


# Small widths for the fused form's interpreter tests: nope and v not powers of two (the
# kernels pad them), a latent of 64.
SMALL = {"nope": 48, "rope": 16, "v": 40, "rank": 64}


def small_case(
    contexts: list[int], heads: int, dtype: torch.dtype, seed: int, widths: dict = SMALL
) -> tuple:
    """(q, cache, table, ctx, rows, mla) for a decode step of `contexts` (blocks of 4)."""
    nope, rope, v, rank = widths["nope"], widths["rope"], widths["v"], widths["rank"]
    cache, table, ctx, rows = paged(contexts, rank + rope, 4, dtype, seed=seed)
    mla = weights(heads, nope, v, rank, dtype, seed=seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    q = torch.randn(len(contexts), heads, nope + rope, generator=g).to(dtype)
    return q, cache, table, ctx, rows, mla


@interpreted
@pytest.mark.parametrize(
    ("contexts", "heads", "num_splits"),
    [
        ([100], 16, 4),  # batch 1, four splits of 32
        ([1, 5, 33, 70, 130], 3, 4),  # contexts shorter than a tile; one to four splits used
        ([9, 64, 2], 5, 1),  # one split
    ],
)
@pytest.mark.parametrize(("dtype", "tol", "tol_ab"), [(torch.float32, 1e-5, 1e-6),
                                                      (torch.float16, 3e-3, 1e-3)])  # fmt: skip
def test_fused_absorbed_equals_torch_reference_and_the_unfused_form(
    contexts: list[int], heads: int, num_splits: int, dtype: torch.dtype, tol: float,
    tol_ab: float,
):  # fmt: skip
    """Both forms of mla_decode_absorbed against mla_absorbed in float64 within tol of the
    largest element, and against each other within tol_ab (the same rounding points, q's
    dtype for the absorbed query, the combined latent and the output; float32 sums in
    another order, which may flip a rounding: fp16's tol_ab is one ulp of any element, 2 **
    -10 of it; the interpreter's dots go through numpy's BLAS, whose sum order can change
    from run to run); heads fewer than a program's 16 rows."""
    q, cache, table, ctx, rows, mla = small_case(contexts, heads, dtype, seed=11)
    scale = 0.15
    args = (q, cache, table, ctx, mla, scale, num_splits, 16)
    fused = mla_decode_absorbed(*args, fused=True)
    unfused = mla_decode_absorbed(*args, fused=False)
    assert fused.shape == unfused.shape == (len(contexts), heads, SMALL["v"])
    for i, want in enumerate(reference(q, rows, mla, scale)):
        assert rel_err(fused[i], want) <= tol, i
        assert rel_err(unfused[i], want) <= tol, i
    assert rel_err(fused, unfused) <= tol_ab


@interpreted
@pytest.mark.parametrize(
    "tiles",
    [
        (16, 16, 16, 2),  # tl.dot over 16 sequences, two groups: group 0 takes blocks 0 and 2
        (4, 32, 32, 3),  # 4 sequences a block, a broadcast product; v tiles past v masked
        (1, 64, 64, 1),  # one sequence a block (batch 1's), one program's loop over all 40
    ],
)
def test_fused_kernel_tile_paths(monkeypatch: pytest.MonkeyPatch, tiles: tuple):
    """mla_reduce_uv_kernel at tiles forced past _uv_tiles' pick, over 40 sequences (three
    blocks of 16 for W_UK's kernel too) of contexts 0-90, some of no context: within 1e-5
    (fp32) of the float64 reference and 1e-6 of the unfused form; zeros for no context."""
    rng = random.Random(12)
    contexts = [rng.choice([0, 1, 3, 17, 40, 90]) for _ in range(40)]
    q, cache, table, ctx, rows, mla = small_case(contexts, 3, torch.float32, seed=13)
    monkeypatch.setattr(mla_decode_module, "_uv_tiles", lambda *_: tiles)
    args = (q, cache, table, ctx, mla, 0.15, 3, 16)
    fused = mla_decode_absorbed(*args, fused=True)
    unfused = mla_decode_absorbed(*args, fused=False)
    for i, want in enumerate(reference(q, rows, mla, 0.15)):
        if want is None:
            assert torch.equal(fused[i], torch.zeros_like(fused[i])), i
        else:
            assert rel_err(fused[i], want) <= 1e-5, i
    assert rel_err(fused, unfused) <= 1e-6


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sequences_of_no_context_give_zeros_in_both_forms(dtype: torch.dtype):
    """A sequence of context 0 (a mixed graph's unused decode slot, whose output row is the
    spare one nobody reads) gets zeros from mla_decode and from either form of
    mla_decode_absorbed, never NaN, and leaves the other sequences' outputs as they are
    without it (the fused form's bit for bit)."""
    contexts = [0, 9, 0, 40]
    q, cache, table, ctx, rows, mla = small_case(contexts, 3, dtype, seed=14)
    rank, rope = SMALL["rank"], SMALL["rope"]
    q_lat = torch.randn(4, 3, rank + rope, generator=torch.Generator().manual_seed(15)).to(dtype)
    latent = mla_decode(q_lat, cache, table, ctx, 0.15, rank, 4, 16)
    assert torch.equal(latent[[0, 2]], torch.zeros_like(latent[[0, 2]]))
    assert latent[[1, 3]].abs().amax() > 0
    live = [1, 3]
    for fused in (True, False):
        out = mla_decode_absorbed(q, cache, table, ctx, mla, 0.15, 4, 16, fused=fused)
        assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]])), fused
        alone = mla_decode_absorbed(
            q[live], cache, table[live], ctx[live], mla, 0.15, 4, 16, fused=fused
        )
        if fused:  # each sequence's rows its own in every product
            assert torch.equal(out[live], alone)
        else:  # (torch's CPU einsum blocks by the batch)
            assert rel_err(out[live], alone) <= 1e-3, fused


@interpreted
def test_fused_output_is_contiguous_and_weights_are_read_through_strides():
    """The fused output is [B, H, V] contiguous, so the model's reshape to [B, H * V] is a
    view. W_UK and W_UV given as strided views (W_UK from a [H, rank, nope] tensor's
    transpose: its last dim not contiguous) in float32 beside fp16 queries: read as they are,
    rounded to fp16 per tile as the unfused form's w.to(q.dtype) rounds them (to 1e-4)."""
    heads, nope, v, rank = 3, SMALL["nope"], SMALL["v"], SMALL["rank"]
    q, cache, table, ctx, rows, _ = small_case([7, 33], heads, torch.float16, seed=15)
    g = torch.Generator().manual_seed(16)
    mla = MLAWeights(nope, v, lambda latent: latent)
    mla.w_uk = (torch.randn(heads, rank, nope, generator=g) / rank**0.5).transpose(1, 2)
    mla.w_uv = (torch.randn(heads, 2 * v, rank, generator=g) / rank**0.5)[:, ::2]
    assert mla.w_uk.stride(-1) != 1 and not mla.w_uv.is_contiguous()
    out = mla_decode_absorbed(q, cache, table, ctx, mla, 0.15, 2, 16)
    assert out.shape == (2, heads, v) and out.dtype == torch.float16 and out.is_contiguous()
    assert out.view(2, heads * v).data_ptr() == out.data_ptr()
    unfused = mla_decode_absorbed(q, cache, table, ctx, mla, 0.15, 2, 16, fused=False)
    assert rel_err(out, unfused) <= 1e-4  # unrounded float32 weights: ~5e-4
    half = MLAWeights(nope, v, lambda latent: latent)
    half.w_uk, half.w_uv = mla.w_uk.half(), mla.w_uv.half()
    for i, want in enumerate(reference(q, rows, half, 0.15)):
        assert rel_err(out[i], want) <= 3e-3, i


@interpreted
def test_backend_switch_gives_the_same_decode_step():
    """TritonAttention's mla_fused_absorb (on by default) and off: one decode step of four
    sequences through forward() (latent write, then the absorbed decode, contexts split in 16s)
    gives the same output within 1e-6, and each within 1e-5 of the float64 reference."""
    heads, nope, rope, v, rank = 3, SMALL["nope"], SMALL["rope"], SMALL["v"], SMALL["rank"]
    contexts, block = [5, 40, 1, 23], 4
    spec = KVLayerSpec(heads, 1, rank + rope, kind="mla", v_head_dim=rank, rope_dim=rope)
    _, _, _, rows = paged(contexts, rank + rope, block, torch.float32, seed=17)
    mla = weights(heads, nope, v, rank, torch.float32, seed=18)
    g = torch.Generator().manual_seed(19)
    q = torch.randn(len(contexts), heads, nope + rope, generator=g)
    tables = [list(range(1 + 12 * i, 1 + 12 * i + -(-c // block))) for i, c in enumerate(contexts)]
    batch = make_attention_batch([1] * len(contexts), contexts, tables, block)
    outs = []
    assert TritonAttention.mla_fused_absorb
    for fused in (True, False):
        backend = TritonAttention([spec], block, torch.float32, torch.device("cpu"))
        backend.mla_fused_absorb, backend.mla_min_split_len = fused, 16
        backend.allocate(64)
        flat = backend.caches[0].view(-1, rank + rope)
        for t, r in zip(tables, rows, strict=True):  # the context before the new token
            slots = torch.tensor([b * block + j for b in t for j in range(block)])
            flat[slots[: len(r) - 1]] = r[:-1]
        backend.begin_step(batch)
        new = torch.stack([r[-1] for r in rows])[:, None]  # the step's own token's row
        layer = AttentionLayer(0, spec, 0.15, mla=mla)
        outs.append(backend.forward(layer, q, new, new[..., :rank]))
    assert outs[0].is_contiguous() and not outs[1].is_contiguous()  # the switch took each path
    assert rel_err(outs[0], outs[1]) <= 1e-6
    for i, want in enumerate(reference(q, rows, mla, 0.15)):
        assert rel_err(outs[0][i], want) <= 1e-5, i


def test_fused_tile_picks_fit_their_limits():
    """_uv_tiles and _uk_block for batches 1-512, 1-16 splits, 1-128 heads, v 16-192: tiles
    the kernels take (powers of two, BLOCK_R dividing the latent and at least 16, register
    tiles within _TILE), one program per head at least and sequence groups the batch fills;
    at DeepSeek-V2-Lite's widths, batch 1 takes one sequence a block over _PROGRAMS programs."""
    tile = mla_decode_module._TILE
    for batch in (1, 2, 3, 8, 16, 33, 64, 512):
        for splits in (1, 3, 16):
            for heads, v in ((1, 16), (3, 40), (16, 128), (128, 192)):
                for rank in (64, 512):
                    bb, bv, br, groups = mla_decode_module._uv_tiles(
                        batch, heads, v, rank, splits, 2
                    )
                    pad = max(2, 1 << (splits - 1).bit_length())
                    assert bb & (bb - 1) == 0 and bv & (bv - 1) == 0 and br & (br - 1) == 0
                    assert bb <= 16 and 16 <= bv <= max(16, 2 * v) and 16 <= br <= rank
                    assert bb * pad * br <= tile and bv * br <= tile
                    assert bb == 16 or bb * bv * br <= tile
                    assert 1 <= groups <= -(-batch // bb)
                    block_r = mla_decode_module._uk_block(heads, 128, rank)
                    assert 16 <= block_r <= rank and 128 * block_r <= tile
    lite = mla_decode_module._uv_tiles(1, 16, 128, 512, 16, 2)
    assert lite[0] == 1 and 16 * (128 // lite[1]) * lite[3] == mla_decode_module._PROGRAMS


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
    mla = weights(2, 32, 32, 64, torch.float32, seed=0)  # two heads' weights for four heads
    with pytest.raises(ValueError, match="w_uk"):
        mla_decode_absorbed(q, cache, table, ctx, mla, 0.1)
    with pytest.raises(ValueError, match="row_seq"):
        mla_decode(q, cache, table, ctx, 0.1, rank=64, row_seq=torch.zeros(1, dtype=torch.int64))
    mla = weights(4, 64, 32, 64, torch.float32, seed=0)
    pieces = torch.zeros(3, 4, 32), torch.zeros(3, 4), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="fused form"):
        mla_decode_absorbed(q, cache, table, ctx, mla, 0.1, fused=False, merge=pieces)
    bad = pieces[0].half(), *pieces[1:]
    with pytest.raises(ValueError, match="merge takes"):
        mla_decode_absorbed(q, cache, table, ctx, mla, 0.1, merge=bad)


def test_fused_kernels_compile_for_sm90_without_spills():
    """mla_decode_absorbed's fused kernels at V2-Lite's widths in bf16, with the tiles it picks
    at batch 1, 16, 64 and 512 (16, 16, 5 and 1 splits, TritonAttention's on an H100), compile
    for sm_90 with no register spills, the W_UV kernel's MERGE variant (a mixed graph's chunk
    rows over a cached prefix) too, and mla_decode_kernel plain and ROW_SEQ. Compiled by Triton
    without a GPU, in a process of its own (this one may run Triton under the interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = [[1, 16], [16, 16], [64, 5], [512, 1]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_mla_decode.py"
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got, decode = json.loads(out.stdout.splitlines()[-1])
    assert got[0][0][0] == 1  # batch 1: one sequence a block, no tl.dot
    assert {tiles[0] for tiles, *_ in got[1:]} & {16}  # and tl.dot's path at some batch
    for case, (tiles, *kernels) in zip(cases, got, strict=True):
        assert len(kernels) == 3 and all(k[1] == 0 for k in kernels), (case, tiles, kernels)
    assert len(decode) == 2 and all(k[1] == 0 for k in decode), decode


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


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("context", [256, 2048])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_compiled_fused_absorbed_on_the_gpu(batch: int, context: int):
    """Compiled, bf16, DeepSeek-V2-Lite's widths, `batch` contexts up to `context` (the first
    exactly it) in blocks of 16, split as TritonAttention splits them (2 x SMs programs, at
    most 16 splits of at least 64 tokens): the fused form is contiguous, within 1e-2 of the
    unfused form (the same rounding points; float32 sums in another order can round a bf16
    latent the other way) and both within 2e-2 of mla_absorbed in float64 on the same bf16
    inputs."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    rng = random.Random(batch * context)
    contexts = [context] + [rng.randint(1, context) for _ in range(batch - 1)]
    cache, table, ctx, rows = paged(contexts, rank + rope, 16, torch.bfloat16, 20, "cuda")
    mla = weights(heads, nope, v, rank, torch.bfloat16, seed=21, device="cuda")
    g = torch.Generator().manual_seed(22)
    q = torch.randn(batch, heads, nope + rope, generator=g).to("cuda", torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = max(1, min(16, -(-2 * sms // batch)))
    scale = 192**-0.5
    fused = mla_decode_absorbed(q, cache, table, ctx, mla, scale, splits, 64)
    unfused = mla_decode_absorbed(q, cache, table, ctx, mla, scale, splits, 64, fused=False)
    assert fused.shape == (batch, heads, v) and fused.is_contiguous()
    assert rel_err(fused, unfused) <= 1e-2
    for i, want in enumerate(reference(q, rows, mla, scale)):
        assert rel_err(fused[i], want) <= 2e-2, i
        assert rel_err(unfused[i], want) <= 2e-2, i


@pytest.mark.gpu
@on_gpu
def test_fused_absorbed_replays_from_a_cuda_graph():
    """The fused form captured in a CUDA graph over static queries, tables and contexts (8
    sequences, 16 splits) replays new values of all three, one of them context 0, exactly as
    an eager call computes them."""
    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    cache, table, ctx, _ = paged([2048] * 8, rank + rope, 16, torch.bfloat16, 23, "cuda")
    mla = weights(heads, nope, v, rank, torch.bfloat16, seed=24, device="cuda")
    q = torch.randn(8, heads, nope + rope, device="cuda").bfloat16()

    def step() -> torch.Tensor:
        return mla_decode_absorbed(q, cache, table, ctx, mla, 192**-0.5, 16, 64)

    step()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.normal_()
    ctx.copy_(torch.tensor([1, 0, 17, 300, 2048, 64, 1000, 5], dtype=torch.int32))
    table.copy_(table[torch.randperm(8, device="cuda")])
    graph.replay()
    want = step()
    assert torch.equal(out, want)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
