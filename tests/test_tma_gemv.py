"""tma_linear_parts (inferx_kernels_cuda.tma_gemv): partial products over K slices, read through
TMA tensor descriptors, against float64 and F.linear; its gated form (SiLU-and-mul after) and
the norm fused in front (tma_norm_linear); the decode attention's split combine in front
(tma_reduce_linear); on the CPU under the interpreter (which
runs tensor descriptors, zero fill past the edges included), bf16 at the real shapes on a GPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_core.interfaces.attention import SplitAttention  # noqa: E402
from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_kernels_cuda.tma_gemv import (  # noqa: E402
    MAX_ROWS,
    TmaGemvConfig,
    TmaNormConfig,
    norm_config,
    plain_config,
    reduce_config,
    tma_linear_parts,
    tma_linear_silu_and_mul,
    tma_norm_linear,
    tma_reduce_linear,
)

SMALL = TmaGemvConfig(block_n=32, block_k=32, num_stages=2)


def inputs(
    m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(m, k, generator=g).to(device, dtype),
        torch.randn(n, k, generator=g).to(device, dtype),
    )


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@interpreted
@pytest.mark.parametrize("m", [1, 3, 16, 40, 100])
@pytest.mark.parametrize(("n", "k", "parts"), [(100, 96, 1), (70, 200, 3), (33, 64, 2)])
def test_half_parts_sum_to_the_product(m: int, n: int, k: int, parts: int) -> None:
    """float16 (the interpreter rounds fp32 to bf16 by truncation; bf16 runs on the GPU below).
    Ragged N and K: the descriptors zero-fill past both edges, and rows past M."""
    x, w = inputs(m, n, k, torch.float16, "cpu", seed=m * 7 + n)
    out = tma_linear_parts(x, w, parts, SMALL)
    assert out.shape == (parts, m, n) and out.dtype == torch.float16
    ref = x.double() @ w.double().T
    # Each part is rounded once to fp16 (2**-11 relative to its own size, at most the total's).
    assert rel_err(out.sum(0), ref) < parts * 2**-10


@interpreted
def test_each_part_is_its_slice_of_k() -> None:
    x, w = inputs(2, 40, 128, torch.float16, "cpu", seed=1)
    out = tma_linear_parts(x, w, 4, SMALL)  # 32 columns of K a part
    for s in range(4):
        ks = slice(32 * s, 32 * (s + 1))
        assert rel_err(out[s], x[:, ks].double() @ w[:, ks].double().T) < 2**-10


@interpreted
def test_more_parts_than_k_blocks_gives_zero_parts() -> None:
    x, w = inputs(1, 40, 64, torch.float16, "cpu", seed=2)
    out = tma_linear_parts(x, w, 4, SMALL)  # 2 K blocks of 32 over 4 parts
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert rel_err(out.sum(0), x.double() @ w.double().T) < 2**-9


@interpreted
@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2**-9), (torch.float32, 1e-5)])
def test_bias_goes_into_part_zero(parts: int, dtype: torch.dtype, tol: float) -> None:
    """A bias (gpt-oss's o_proj) is added to part 0 in fp32 before its rounding, the other
    parts untouched: the parts sum to F.linear with the bias; rows past N (70 over 32-row
    tiles) read no bias."""
    x, w = inputs(3, 70, 200, dtype, "cpu", seed=5)
    bias = torch.randn(70, generator=torch.Generator().manual_seed(6)).to(dtype) * 4
    out = tma_linear_parts(x, w, parts, SMALL, bias=bias)
    plain = tma_linear_parts(x, w, parts, SMALL)
    assert torch.equal(out[1:], plain[1:])
    assert not torch.equal(out[0], plain[0])
    ref = x.double() @ w.double().T + bias.double()
    assert rel_err(out.sum(0), ref) < parts * tol
    with pytest.raises(ValueError, match="bias must be"):
        tma_linear_parts(x, w, parts, SMALL, bias=bias[:69])


def silu_and_mul_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    gate, up = (x.double() @ w.double().T).chunk(2, dim=-1)
    return F.silu(gate) * up


@interpreted
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2**-8), (torch.float32, 1e-5)])
def test_silu_and_mul_in_the_epilogue(m: int, dtype: torch.dtype, tol: float) -> None:
    """gate rows 0..49, up rows 50..99: the last 32-row tile of gate rows (32..63) reaches into
    the up rows, whose outputs are never stored; K ragged (96 over 32-column tiles is even, 80
    is not). fp16 rounds gate, up and silu (a few ulps); fp32 against float64."""
    for k in (96, 80):
        x, w = inputs(m, 100, k, dtype, "cpu", seed=m + k)
        out = tma_linear_silu_and_mul(x, w, SMALL)
        assert out.shape == (m, 50) and out.dtype == dtype
        assert rel_err(out, silu_and_mul_reference(x, w)) < tol


def test_refuses_what_tma_cannot_read() -> None:
    x, w = inputs(1, 40, 64, torch.float16, "cpu", seed=3)
    with pytest.raises(ValueError, match="must agree on K"):
        tma_linear_parts(x, w[:, :32])
    with pytest.raises(ValueError, match="1 to 128 rows"):
        tma_linear_parts(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="must share float16, bfloat16 or float32"):
        tma_linear_parts(x.float(), w)
    with pytest.raises(ValueError, match="gate then up rows"):
        tma_linear_silu_and_mul(x, w[:39])
    with pytest.raises(ValueError, match="tma_linear_silu_and_mul: takes 1 to 128 rows"):
        tma_linear_silu_and_mul(torch.zeros(MAX_ROWS + 1, 64, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        odd = torch.zeros(40, 68, dtype=torch.float16)[:, :60]  # rows 136 bytes apart
        tma_linear_parts(torch.zeros(1, 60, dtype=torch.float16), odd)


def norm_inputs(
    s_in: int, m: int, k: int, rows: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    """Parts [s_in, m, k], residual, norm weight (near 1) and a weight [rows, k] (scaled so
    the products stay near 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s_in, m, k, generator=g)
    res = torch.randn(m, k, generator=g)
    nw = 1 + 0.1 * torch.randn(k, generator=g)
    w = torch.randn(rows, k, generator=g) / k**0.5
    return tuple(t.to(device, dtype) for t in (x, res, nw, w))


def norm_then_product(
    x: torch.Tensor, res: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, gated: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused reference: TorchOps' add + RMSNorm, then the product in float64 (and
    silu(gate) * up), with the new residual."""
    normed, summed = TorchOps().rms_norm(x, nw, 1e-6, res, parts=True)
    if gated:
        return silu_and_mul_reference(normed, w), summed
    return normed.double() @ w.double().T, summed


@interpreted
@pytest.mark.parametrize(
    "tiles",
    [TmaNormConfig(32, 32, 4, 2), TmaNormConfig(32, 32, 4, 2, select_own=True)],
    ids=str,
)
@pytest.mark.parametrize(
    ("s_in", "m", "k", "n", "parts", "gated"),
    [(4, 1, 128, 96, 4, False), (3, 5, 104, 70, 2, False), (2, 2, 136, 40, 4, False),
     (1, 3, 96, 80, 1, True), (4, 17, 136, 64, 1, True), (4, 1, 64, 40, 1, False)],
)  # fmt: skip
def test_norm_linear_matches_rms_norm_then_the_product(
    s_in: int, m: int, k: int, n: int, parts: int, gated: bool, tiles: TmaNormConfig
) -> None:
    """float16 (bf16 on the GPU below): ragged K across the splits (the last ones run past K),
    rows not a power of two, more rows than 16 (the dot's minimum), 1, 2 and 4 splits. The new
    residual is rms_norm's to the bit; the products differ by where 1 / rms is applied (after
    the sum here, before the rounding of the normed rows there): a few fp16 ulps."""
    x, res, nw, w = norm_inputs(s_in, m, k, 2 * n if gated else n, torch.float16, "cpu", seed=k)
    out, summed = tma_norm_linear(x, res, nw, 1e-6, w, parts, gated, tiles)
    ref, ref_summed = norm_then_product(x, res, nw, w, gated)
    assert torch.equal(summed, ref_summed)
    assert out.shape == ((m, n) if gated else (parts, m, n)) and out.dtype == torch.float16
    assert rel_err(out if gated else out.sum(0), ref) < (parts + 3) * 2**-11


@interpreted
def test_norm_linear_float32_and_the_residual_untouched() -> None:
    x, res, nw, w = norm_inputs(4, 3, 128, 48, torch.float32, "cpu", seed=9)
    before = res.clone()
    out, summed = tma_norm_linear(x, res, nw, 1e-6, w, 4, config=TmaNormConfig(32, 32, 4, 2))
    ref, ref_summed = norm_then_product(x, res, nw, w, gated=False)
    assert torch.equal(res, before) and summed.data_ptr() != res.data_ptr()
    torch.testing.assert_close(summed, ref_summed, rtol=1e-6, atol=1e-6)
    assert rel_err(out.sum(0), ref) < 1e-5


def test_norm_linear_refuses_mismatched_inputs() -> None:
    x, res, nw, w = norm_inputs(4, 2, 64, 40, torch.float16, "cpu", seed=4)
    with pytest.raises(ValueError, match=r"needs residual \[M, K\] and norm weight \[K\]"):
        tma_norm_linear(x, res[:1], nw, 1e-6, w)
    with pytest.raises(ValueError, match="tma_norm_linear: x \\[M, K\\] and weight"):
        tma_norm_linear(x, res, nw, 1e-6, w[:, :32])
    with pytest.raises(ValueError, match="must share a dtype"):
        tma_norm_linear(x, res, nw.float(), 1e-6, w)
    with pytest.raises(ValueError, match="gated takes parts=1"):
        tma_norm_linear(x, res, nw, 1e-6, w, parts=4, gated=True)


def test_configs_by_rows_and_programs() -> None:
    assert norm_config(1, 4, gated=False).block_k == 128
    assert norm_config(8, 4, gated=False).block_k == 64  # 4 splits x 8 rows in shared memory
    assert norm_config(4, 1, gated=True) == TmaNormConfig(64, 128, 4, 3, select_own=True)
    assert norm_config(8, 1, gated=True) == TmaNormConfig(64, 64, 4, 4, select_own=True)
    # 3B's QKV (2560 rows) in 4 parts: 160 programs, 4 deep; 8B's (6144): 384, 3 deep
    assert plain_config(2560, 4, num_sms=132) == TmaGemvConfig(64, 128, 4, 4)
    assert plain_config(6144, 4, num_sms=132) == TmaGemvConfig(64, 128, 4, 3)
    assert plain_config(22016, 1, num_sms=132) == TmaGemvConfig(128, 128, 4, 3)
    # 64 rows of x: 3B's QKV 3 deep (two 96 KB programs an SM), gate_up in 64 x 64 tiles
    assert plain_config(2560, 4, num_sms=132, rows=64) == TmaGemvConfig(64, 128, 4, 3)
    assert plain_config(2048, 4, num_sms=132, rows=64) == TmaGemvConfig(64, 128, 4, 4)
    assert plain_config(2560, 4, num_sms=132, rows=128) == TmaGemvConfig(64, 64, 4, 4)
    assert plain_config(22016, 1, num_sms=132, rows=33) == TmaGemvConfig(64, 64, 4, 4)
    # gated (gate and up tiles a stage): 3B's 11008 outputs, 172 programs, two an SM
    assert plain_config(11008, 1, num_sms=132, rows=16, gated=True) == TmaGemvConfig(64, 128, 4, 3)
    assert plain_config(11008, 1, num_sms=132, rows=64, gated=True) == TmaGemvConfig(64, 64, 4, 4)
    # float32 (the GPU tests' tiny models): half the stages fit; 64 rows of o_proj 3 deep, not 4
    # (the gated tiles at 64 rows 4 deep were 320 KB in Triton's sm_90 compile, 227 allowed)
    assert plain_config(2048, 4, num_sms=132, rows=64, elem_bytes=4) == TmaGemvConfig(64, 128, 4, 3)
    assert plain_config(11008, 1, 132, 64, gated=True, elem_bytes=4) == TmaGemvConfig(64, 64, 4, 2)


def decode_splits(
    m: int, heads: int, dim: int, splits: int, seq_split: bool, device: str, seed: int
) -> SplitAttention:
    """Random split outputs as the decode kernel leaves them, contexts 1..300 (row 0 one
    token: a single used split), min split 16 tokens, decode tiles of 16. reduce() is the
    float64 reference."""
    g = torch.Generator().manual_seed(seed)
    rows_parts = m * heads * splits
    ctx = torch.randint(1, 300, (m,), generator=g, dtype=torch.int32)
    ctx[0] = 1
    fields = {
        "part_o": torch.randn(rows_parts, dim, generator=g).to(device),
        "part_lse": (4 * torch.randn(rows_parts, generator=g)).to(device),
        "context_len": ctx.to(device),
        "rows": m, "heads": heads, "head_dim": dim, "splits": splits,
        "split_len": 16 if seq_split else 64, "seq_split": seq_split, "tile": 16,
    }  # fmt: skip
    return SplitAttention(
        **fields, reduce=lambda: reduced_reference(SplitAttention(**fields, reduce=None))
    )


def reduced_reference(sp: SplitAttention) -> torch.Tensor:
    """decode_reduce_kernel's output in float64: [rows, heads * head_dim]."""
    out = torch.zeros(sp.rows, sp.heads, sp.head_dim, dtype=torch.float64)
    o = sp.part_o.double().cpu().view(sp.rows, sp.heads, sp.splits, sp.head_dim)
    lse = sp.part_lse.double().cpu().view(sp.rows, sp.heads, sp.splits)
    for r, ctx in enumerate(sp.context_len.tolist()):
        split_len = sp.split_len
        if sp.seq_split:
            per = max(-(-ctx // sp.splits), sp.split_len)
            split_len = -(-per // sp.tile) * sp.tile
        used = -(-ctx // split_len)
        w = torch.exp2(lse[r, :, :used] - lse[r, :, :used].max(1, keepdim=True).values)
        out[r] = (o[r, :, :used] * w[..., None]).sum(1) / w.sum(1)[:, None]
    return out.flatten(1)


@interpreted
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("seq_split", [True, False])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2**-8), (torch.float32, 1e-5)])
@pytest.mark.parametrize(("block_k", "chunk"), [(32, None), (32, 2), (64, None), (64, 2)])
def test_reduce_linear_matches_the_reduce_then_the_product(
    m: int, seq_split: bool, dtype: torch.dtype, tol: float, block_k: int, chunk: int | None
) -> None:
    """tma_reduce_linear against decode_reduce_kernel's combine (float64, rounded to the dtype
    as its store rounds) and the product: 4 heads of 32 in 2 K-slices, a K step a head
    (block_k 32) or the whole slice's weight in one tile before the wait (block_k 64); 8
    splits at once or 2 at a time (the running max rescales); ragged contexts (one of one
    token)."""
    sp = decode_splits(m, 4, 32, 8, seq_split, "cpu", seed=m + 10 * seq_split)
    w = torch.randn(40, 4 * 32, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = tma_reduce_linear(sp, w, 2, TmaGemvConfig(32, block_k, 4, 2), split_chunk=chunk)
    assert out.shape == (2, m, 40) and out.dtype == dtype
    x = reduced_reference(sp).to(dtype)
    assert rel_err(out.sum(0), x.double() @ w.double().T) < tol


@interpreted
@pytest.mark.parametrize("seq_split", [True, False])
def test_the_reference_is_decode_reduce_kernels_combine(seq_split: bool) -> None:
    """reduced_reference (above) against decode_reduce_kernel itself on the same splits."""
    from inferx_kernels_cuda.triton_kernels import decode_reduce_kernel

    sp = decode_splits(5, 4, 32, 8, seq_split, "cpu", seed=3)
    out = torch.empty(sp.rows, sp.heads, sp.head_dim)
    ctx = sp.context_len
    decode_reduce_kernel[(sp.rows, sp.heads)](
        sp.part_o, sp.part_lse, out, ctx, ctx, ctx, sp.split_len, sp.splits, out.stride(0),
        out.stride(1), HEAD_DIM=sp.head_dim, SPLITS_PAD=sp.splits, HEADS=1,
        SEQ_SPLIT=seq_split, BLOCK_N=sp.tile, ALL_DECODE=True,
    )  # fmt: skip
    torch.testing.assert_close(out.flatten(1).double(), reduced_reference(sp), rtol=1e-5, atol=1e-5)


def test_reduce_linear_refuses_what_it_cannot_take() -> None:
    sp = decode_splits(2, 4, 32, 8, True, "cpu", seed=1)
    w = torch.zeros(40, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="weight must be"):
        tma_reduce_linear(sp, w[:, :96])
    with pytest.raises(ValueError, match="K-slices of a power-of-two count of whole heads"):
        tma_reduce_linear(sp, w, parts=3)
    with pytest.raises(ValueError, match="fewer than"):
        tma_reduce_linear(SplitAttention(**(vars(sp) | {"splits": 16})), w)
    with pytest.raises(ValueError, match="block_k must be the head dim"):
        tma_reduce_linear(sp, w, parts=2, config=TmaGemvConfig(32, 16, 4, 2))


def test_reduce_config_takes_the_whole_slice_up_to_64_kb() -> None:
    """Qwen2.5-3B's o_proj (16 heads of 128 in 4 slices): 64 rows x 512 columns of bf16, 64 KB,
    one tile; Llama-3.1-8B's (32 heads): 128 KB, a K step a head."""
    w3 = torch.empty(2048, 2048, dtype=torch.bfloat16)
    w8 = torch.empty(4096, 4096, dtype=torch.bfloat16)
    sp3 = decode_splits(1, 16, 128, 4, True, "cpu", seed=0)
    sp8 = decode_splits(1, 32, 128, 4, True, "cpu", seed=0)
    assert reduce_config(sp3, w3, 4) == TmaGemvConfig(64, 512, 4, 1)
    assert reduce_config(sp8, w8, 4) == TmaGemvConfig(64, 128, 4, 3)
    assert reduce_config(sp8, w8, 8) == TmaGemvConfig(64, 512, 4, 1)


# Dynamic shared memory one program may have on sm_90 (227 KB).
SM90_MAX_SHARED_PER_PROGRAM = 232_448


def test_configs_fit_shared_memory_in_the_sm90_compile() -> None:
    """plain_config's picks for 3B's o_proj (few programs: the deepest pipelines), 8B's QKV
    and 3B's gate_up (gated), at 1, 64 and 128 rows, bf16 and float32 (the GPU tests' tiny
    models; sized as bf16, the gated tiles at 64 rows took 320 KB), compile for sm_90 within a
    program's shared memory. Compiled by Triton without a GPU, in a process of its own: this
    one runs Triton under the interpreter."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    cases = []
    for dtype, elem_bytes in (("bf16", 2), ("fp32", 4)):
        for rows in (1, 64, 128):
            for n, parts, gated in ((2048, 4, False), (6144, 4, False), (11008, 1, True)):
                cfg = plain_config(n, parts, 132, rows, gated, elem_bytes)
                cases.append([dtype, rows, list(vars(cfg).values()), gated])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_shared.py"
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    shared = json.loads(out.stdout.splitlines()[-1])
    assert len(shared) == len(cases)
    for case, nbytes in zip(cases, shared, strict=True):
        assert 0 < nbytes <= SM90_MAX_SHARED_PER_PROGRAM, (case, nbytes)


# (n, k) of the decode GEMMs: Qwen2.5-3B QKV, o_proj, gate_up, down_proj, then Llama-3.1-8B's.
REAL = {
    "3b-qkv": (2560, 2048), "3b-o": (2048, 2048), "3b-gate_up": (22016, 2048),
    "3b-down": (2048, 11008), "8b-qkv": (6144, 4096), "8b-o": (4096, 4096),
    "8b-gate_up": (28672, 4096), "8b-down": (4096, 14336),
}  # fmt: skip


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("m", [1, 8, 32, 64])
@pytest.mark.parametrize("parts", [1, 4])
def test_gpu_bf16_real_shapes(shape: str, m: int, parts: int) -> None:
    """At TritonOps' tiles for the rows (plain_config)."""
    n, k = REAL[shape]
    x, w = inputs(m, n, k, torch.bfloat16, "cuda", seed=m)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = tma_linear_parts(x, w * 0.02, parts, plain_config(n, parts, sms, m))
    # F.linear rounds once; the parts' sum rounds each part (a bf16 ulp, 2**-8, each).
    assert rel_err(out.float().sum(0), F.linear(x, w * 0.02)) < parts * 2**-7


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["3b", "8b"])
@pytest.mark.parametrize("m", [1, 9, 32, 64])
def test_gpu_silu_and_mul_bf16_real_shapes(model: str, m: int) -> None:
    """gate_up + SiLU-and-mul at TritonOps' tiles (plain_config, gated)."""
    n, k = REAL[f"{model}-gate_up"]
    x, w = inputs(m, n, k, torch.bfloat16, "cuda", seed=m + 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = tma_linear_silu_and_mul(x, w * 0.02, plain_config(n // 2, 1, sms, m, gated=True))
    # gate, up and silu each rounded to bf16 (2**-8 relative) before the product
    assert rel_err(out, silu_and_mul_reference(x, w * 0.02)) < 4 * 2**-8


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("model", "heads"), [("3b", 16), ("8b", 32)])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_gpu_reduce_linear_bf16_real_shapes(model: str, heads: int, m: int) -> None:
    """The split combine inside o_proj (4 K-slices of whole heads, reduce_config's tiles: the
    whole slice at 3B, a head a step at 8B), bf16, 64 splits of up to 300-token contexts,
    against the float64 combine (rounded to bf16) and product."""
    n, k = REAL[f"{model}-o"]
    sp = decode_splits(m, heads, k // heads, 64, True, "cuda", seed=m)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(m)) * 0.02).to("cuda")
    w = w.to(torch.bfloat16)
    out = tma_reduce_linear(sp, w, 4)
    x = reduced_reference(sp).to(torch.bfloat16).double()
    # the combine rounds like decode_reduce_kernel up to an ulp; each part rounds once
    assert rel_err(out.float().sum(0), (x @ w.double().cpu().T).cuda()) < 6 * 2**-8


@on_gpu
@pytest.mark.gpu
def test_gpu_graph_replays_new_inputs() -> None:
    n, k = REAL["3b-down"]
    x, w = inputs(1, n, k, torch.bfloat16, "cuda", seed=5)
    static_x = x.clone()
    tma_linear_parts(static_x, w, 4)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tma_linear_parts(static_x, w, 4)
    for seed in range(3):
        static_x.copy_(inputs(1, n, k, torch.bfloat16, "cuda", seed=50 + seed)[0])
        graph.replay()
        assert rel_err(out.float().sum(0), F.linear(static_x, w)) < 4 * 2**-7


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model", ["3b", "8b"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_norm_linear_bf16_real_shapes(model: str, m: int, gated: bool) -> None:
    """The input norm + QKV (4 parts) and the post-attention norm + gate_up + SiLU-and-mul, at
    the real shapes, with TritonOps' configs (norm_config)."""
    n, k = REAL[f"{model}-{'gate_up' if gated else 'qkv'}"]
    parts = 1 if gated else 4
    x, res, nw, w = norm_inputs(4, m, k, n, torch.bfloat16, "cuda", seed=m + n)
    out, summed = tma_norm_linear(x, res, nw, 1e-6, w, parts, gated, norm_config(m, parts, gated))
    ref, ref_summed = norm_then_product(x, res, nw, w, gated)
    # the new residual: the same roundings as TorchOps, the four parts summed in another order
    torch.testing.assert_close(summed, ref_summed, rtol=2**-8, atol=0)
    assert rel_err(out if gated else out.float().sum(0), ref) < (parts + 3) * 2**-8
