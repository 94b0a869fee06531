"""The Triton MLA prefill (inferx_kernels_cuda.mla_prefill) under TRITON_INTERPRET=1 against the
plain form in float64 (inferx_core.attention_torch.mla_plain) over a scattered paged latent
cache: fresh prompts of several lengths, chunks over cached prefixes beside decode rows,
contexts attended in pieces over several passes, widths that are not powers of two, pointer
and TMA loads, fp32, fp16 and bf16. On a GPU: V2-Lite's widths compiled, and through the
backend."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import interpreted, on_gpu

triton = pytest.importorskip("triton")

from inferx_core.attention_torch import TorchAttention, mla_plain  # noqa: E402
from inferx_core.batch import make_attention_batch  # noqa: E402
from inferx_core.interfaces.attention import AttentionLayer, MLAWeights  # noqa: E402
from inferx_core.interfaces.kv import KVLayerSpec  # noqa: E402
from inferx_kernels_cuda.mla_decode import mla_decode_absorbed  # noqa: E402
from inferx_kernels_cuda.mla_prefill import (  # noqa: E402
    PrefillPass,
    PrefillPlan,
    mla_prefill,
    plan_prefill,
    query_tiles,
)
from inferx_kernels_cuda.triton_attention import MLA_PREFILL_CONFIG, TritonAttention  # noqa: E402

# (heads, nope, rope, v, rank): widths that are not powers of two (the tiny test models'), and
# V2's proportions at a quarter of its widths (TMA-able)
SMALL = (4, 16, 8, 12, 32)
QUARTER = (3, 32, 16, 32, 128)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


class Case:
    """A step over a paged MLA cache: random cache rows for every sequence's context (the step's
    own rows among them, at their slots), q for the step's tokens, a random kv_b_proj."""

    def __init__(self, query_lens, context_lens, widths, dtype, block_size=4, seed=0,
                 device="cpu"):  # fmt: skip
        heads, nope, rope, v, rank = widths
        g = torch.Generator().manual_seed(seed)
        self.query_lens, self.context_lens = query_lens, context_lens
        self.widths, self.block_size = widths, block_size
        need = [math.ceil(c / block_size) for c in context_lens]
        num_blocks = sum(need) + 2
        ids = random.Random(seed).sample(range(num_blocks), num_blocks)
        self.tables = [[ids.pop() for _ in range(n)] for n in need]
        self.cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=g).to(dtype)
        flat = self.cache.view(-1, rank + rope)
        self.contexts = []
        for c, table in zip(context_lens, self.tables, strict=True):
            pos = torch.arange(c)
            self.contexts.append(flat[torch.tensor(table)[pos // block_size] * block_size
                                      + pos % block_size])  # fmt: skip
        lens = zip(self.contexts, query_lens, context_lens, strict=True)
        self.rows = torch.cat([ctx[c - q :] for ctx, q, c in lens])
        tokens = sum(query_lens)
        self.q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype)
        self.w = (torch.randn(heads * (nope + v), rank, generator=g) / rank**0.5).to(dtype)
        self.scale = (nope + rope) ** -0.5 * 1.3  # a YaRN-like factor on top
        self.dtype = dtype
        self.cache, self.rows, self.q, self.w = (
            t.to(device) for t in (self.cache, self.rows, self.q, self.w)
        )
        self.batch = make_attention_batch(query_lens, context_lens, self.tables, block_size,
                                          device)  # fmt: skip

    def mla(self, dtype: torch.dtype | None = None) -> MLAWeights:
        heads, nope, _, v, _ = self.widths
        w = self.w if dtype is None else self.w.to(dtype)
        return MLAWeights(
            nope, v, lambda lat: (lat @ w.to(lat.device).t()).view(-1, heads, nope + v)
        )

    def reference(self) -> list[torch.Tensor | None]:
        """Each prompt's output rows by mla_plain in float64 (None for one-query rows)."""
        mla = self.mla(torch.float64)
        out, at = [], 0
        for q_len, c, ctx in zip(self.query_lens, self.context_lens, self.contexts, strict=True):
            q = self.q[at : at + q_len].double().cpu()
            at += q_len
            if q_len == 1:
                out.append(None)
                continue
            mask = torch.arange(c)[None, :] <= torch.arange(c - q_len, c)[:, None]
            out.append(mla_plain(q, ctx.double().cpu(), mla, self.scale, mask))
        return out

    def check(self, out: torch.Tensor, tol: float) -> None:
        at = 0
        for i, want in enumerate(self.reference()):
            n = self.query_lens[i]
            if want is not None:
                assert rel_err(out[at : at + n].cpu(), want) <= tol, i
            at += n


def run(case: Case, max_rows: int = 1 << 20, block_m: int = 16, block_n: int = 16,
        tma: bool = False, launch: dict | None = None) -> torch.Tensor:  # fmt: skip
    plan = plan_prefill(case.query_lens, case.context_lens, case.tables, case.block_size,
                        block_m, max_rows, case.q.device)  # fmt: skip
    heads, _, _, v, _ = case.widths
    out = torch.full((case.q.shape[0], heads, v), float("nan"), dtype=case.dtype,
                     device=case.q.device)  # fmt: skip
    mla_prefill(case.q, case.rows, case.cache, case.mla(), case.scale, plan,
                case.batch.query_start, case.batch.context_len, out, block_n, launch,
                tma)  # fmt: skip
    return out


@interpreted
@pytest.mark.parametrize(("widths", "tma"), [(SMALL, False), (QUARTER, False), (QUARTER, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fresh_prompts_equal_plain_form(widths, tma: bool, dtype: torch.dtype):
    """Fresh prompts of 37, 5 and 20 tokens beside a decode row (which the prefill leaves
    alone): one pass over the step's own rows, causal."""
    case = Case([37, 1, 5, 20], [37, 9, 5, 20], widths, dtype, seed=1)
    plan = plan_prefill(case.query_lens, case.context_lens, case.tables, 4, 16, 1 << 20, "cpu")
    assert plan is not None and len(plan.passes) == 1 and plan.passes[0].slots is None
    out = run(case, tma=tma)
    case.check(out, TOL[dtype])
    assert out[37].isnan().all()  # the decode row: not the prefill's


@interpreted
@pytest.mark.parametrize(("widths", "tma"), [(SMALL, False), (QUARTER, True)])
def test_chunks_over_cached_prefixes_equal_plain_form(widths, tma: bool):
    """Chunks of 7 and 19 over cached prefixes of 33 and 18 (not a tile's multiple), a fresh
    prompt and a decode: the contexts gathered from the paged cache in one pass."""
    case = Case([7, 1, 12, 19], [40, 9, 12, 37], widths, torch.float32, seed=2)
    plan = plan_prefill(case.query_lens, case.context_lens, case.tables, 4, 16, 1 << 20, "cpu")
    assert plan is not None and len(plan.passes) == 1 and plan.passes[0].num_rows == 89
    case.check(run(case, tma=tma), TOL[torch.float32])


@interpreted
@pytest.mark.parametrize("max_rows", [24, 50])
@pytest.mark.parametrize(("widths", "tma"), [(SMALL, False), (QUARTER, True)])
def test_contexts_in_pieces_equal_plain_form(max_rows: int, widths, tma: bool):
    """The same step with at most max_rows context rows a pass: contexts (and chunks) cut
    across passes, each row's output merged from its pieces."""
    case = Case([7, 1, 12, 19], [40, 9, 12, 37], widths, torch.float32, seed=2)
    plan = plan_prefill(case.query_lens, case.context_lens, case.tables, 4, 16, max_rows, "cpu")
    assert plan is not None and len(plan.passes) == math.ceil(89 / max_rows)
    assert all(p.num_rows <= max_rows for p in plan.passes)
    case.check(run(case, max_rows, tma=tma), TOL[torch.float32])


def absorbed_prefix_step(widths, dtype, splits: int, tma: bool, device: str = "cpu",
                         block_m: int = 16, block_n: int = 16, launch: dict | None = None,
                         block_size: int = 4) -> None:  # fmt: skip
    """A mixed graph's form of chunks over a cached prefix, the kernels called directly: the
    chunk's own rows in the plain form (one pass over the step's rows, key_lo the prefix, row0
    query_start - prefix; plan.chunks keeps their pieces), the prefix in the absorbed form
    (mla_decode_absorbed over the chunk rows as extra rows beside a decode, each reading its
    sequence's block-table row through row_seq, its prefix as context, in `splits` splits of
    16 tokens or more), merged per row and head by log-sum-exp in the W_UV kernel. Every row
    against the float64 plain form over [prefix + chunk] (the decode over its whole context)
    within TOL[dtype]; a fresh prompt beside them is written whole by the prefill. Prefixes of
    33, 16 (a block boundary), 5 and 5, chunks of 7, 19, 12 and 2 rows; an unused row (no
    context, no piece) gives zeros."""
    heads, nope, _, v, rank = widths
    query_lens, contexts = [7, 1, 19, 12, 2, 6], [40, 9, 35, 17, 7, 6]
    case = Case(query_lens, contexts, widths, dtype, block_size, seed=4, device=device)
    n, tokens = len(query_lens), sum(query_lens)
    starts = [sum(query_lens[:i]) for i in range(n + 1)]
    prefix = [c - q if q > 1 else 0 for q, c in zip(query_lens, contexts, strict=True)]
    more = [i for i, q in enumerate(query_lens) if q > 1]
    tile_seq, tile_start = query_tiles(query_lens, more, block_m)

    def ints(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    row0 = [starts[i] - prefix[i] for i in range(n)]
    own = PrefillPass(None, tokens, ints(prefix), ints(contexts), ints(row0), ints(tile_seq),
                      ints(tile_start), len(tile_seq))  # fmt: skip
    plan = PrefillPlan([own], block_m, chunks=True)
    mla = case.mla()
    w = case.w.view(heads, nope + v, rank)
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    out = torch.full((tokens, heads, v), float("nan"), dtype=dtype, device=device)
    pieces = mla_prefill(case.q, case.rows, case.cache, mla, case.scale, plan,
                         case.batch.query_start, case.batch.context_len, out, block_n, launch,
                         tma)  # fmt: skip
    assert pieces[0].shape == (tokens, heads, max(16, triton.next_power_of_2(v)))
    # absorbed rows (query row, sequence, context, merge row): the decode, the chunk rows
    # over a prefix, an unused row
    rows = [(starts[1], 1, contexts[1], -1)]
    for i in more:
        if prefix[i]:
            rows += [(starts[i] + j, i, prefix[i], starts[i] + j) for j in range(query_lens[i])]
    rows.append((0, n - 1, 0, -1))
    q_rows = torch.tensor([r[0] for r in rows], device=device)
    o = mla_decode_absorbed(
        case.q[q_rows], case.cache, case.batch.block_table, ints([r[2] for r in rows]), mla,
        case.scale, num_splits=splits, min_split_len=16, row_seq=ints([r[1] for r in rows]),
        merge=(*pieces, ints([r[3] for r in rows])),
    )  # fmt: skip
    assert torch.equal(o[-1], torch.zeros_like(o[-1]))
    assert out[q_rows[:-1]].isnan().all()  # neither a decode's nor a chunk row's is written
    out[q_rows[:-1]] = o[:-1]
    case.check(out, TOL[dtype])
    decode = mla_plain(case.q[starts[1] : starts[2]].double().cpu(), case.contexts[1].double(),
                       case.mla(torch.float64), case.scale, None)  # fmt: skip
    assert rel_err(out[starts[1] : starts[2]].cpu(), decode) <= TOL[dtype]


@interpreted
@pytest.mark.parametrize(
    ("widths", "dtype", "splits", "tma"),
    [
        (SMALL, torch.float32, 1, False),
        (SMALL, torch.float32, 3, False),
        (SMALL, torch.float16, 2, False),
        (QUARTER, torch.float32, 2, True),
    ],
)
def test_chunks_merged_with_an_absorbed_prefix_equal_plain_form(widths, dtype, splits, tma):
    """absorbed_prefix_step under the interpreter: fp32 within 1e-5, fp16 within 3e-3, pointer
    and TMA loads, 1 to 3 splits."""
    absorbed_prefix_step(widths, dtype, splits, tma)


@interpreted
def test_bf16_upcasts_under_the_interpreter():
    case = Case([21, 6], [30, 6], QUARTER, torch.bfloat16, seed=3)
    case.check(run(case, 16), TOL[torch.bfloat16])


def backends(spec: KVLayerSpec, dtype: torch.dtype, device: str, num_blocks: int, block_size: int):
    """A TritonAttention and a TorchAttention over one MLA layer, caches allocated."""
    out = []
    for cls in (TritonAttention, TorchAttention):
        b = cls([spec], block_size, dtype, torch.device(device))
        b.allocate(num_blocks)
        out.append(b)
    return out


def step_backends(case: Case, spec: KVLayerSpec, device: str, context_rows: int):  # noqa: ANN201
    """(TritonAttention, TorchAttention) for the case's cache and the layer's MLAWeights with
    W_UK / W_UV set (both forms on hand)."""
    heads, nope, _, v, rank = case.widths
    triton_b, torch_b = backends(spec, case.dtype, device, *case.cache.shape[:2])
    triton_b.mla_context_rows = context_rows
    mla = case.mla()
    w = case.w.view(heads, nope + v, rank)
    mla.w_uk, mla.w_uv = w[:, :nope], w[:, nope:]
    return (triton_b, torch_b), mla


def backend_step(case: Case, device: str, context_rows: int, tol: float) -> None:
    """TritonAttention's MLA forward of the case's step against TorchAttention's (plain
    prompts, absorbed decodes) on the same cache: the cache rows equal, the outputs within tol
    of each other and of the float64 plain form."""
    heads, nope, rope, v, rank = case.widths
    spec = KVLayerSpec(heads, 1, rank + rope, kind="mla", v_head_dim=rank, rope_dim=rope)
    (triton_b, torch_b), mla = step_backends(case, spec, device, context_rows)
    outs = []
    for b in (triton_b, torch_b):
        b.caches[0].copy_(case.cache)
        b.caches[0].view(-1, rank + rope)[case.batch.slot_mapping] = 0  # the step writes them
        b.begin_step(case.batch)
        layer = AttentionLayer(0, spec, case.scale, mla=mla)
        k = case.rows[:, None]
        outs.append(b.forward(layer, case.q, k, k[..., :rank]))
    assert torch.equal(triton_b.caches[0], torch_b.caches[0])
    assert rel_err(outs[0], outs[1]) <= tol
    case.check(outs[0], tol)


@interpreted
@pytest.mark.parametrize("context_rows", [1 << 20, 20])
def test_backend_mixed_step_equals_torch_backend(context_rows: int):
    """A step with a fresh prompt, a chunk over a cached prefix and decodes (contexts in one
    pass, or in pieces of 20 rows), fp32: within 1e-5."""
    case = Case([9, 1, 6, 1], [9, 14, 27, 3], SMALL, torch.float32, seed=4)
    backend_step(case, "cpu", context_rows, 1e-5)


# Shared memory one program may have on sm_90 (227 KB); two programs an SM share 228 KB.
SM90_MAX_SHARED_PER_PROGRAM = 232_448


def test_default_tiles_compile_for_sm90_without_spills():
    """The backend's default tile at V2's widths, read by TMA and by pointers, compiles for
    sm_90 with no register spills and leaves room for two programs an SM (each below half the
    SM's shared memory). Compiled by Triton without a GPU, in a process of its own (this one
    may run Triton under the interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    cases = [[*MLA_PREFILL_CONFIG, tma] for tma in (1, 0)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_mla.py"
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(cases)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    for case, (shared, regs, spilled) in zip(cases, got, strict=True):
        assert 0 < shared <= SM90_MAX_SHARED_PER_PROGRAM // 2, (case, shared)
        assert spilled == 0, (case, regs, spilled)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("widths", [SMALL, QUARTER])  # pointer loads, TMA on Hopper
@pytest.mark.parametrize("context_rows", [1 << 20, 256])
def test_compiled_backend_step_equals_torch_backend(widths, context_rows: int):
    """backend_step on the GPU, fp32 (no TF32 on either side): a 300-token fresh prompt, a
    100-token chunk over a 600-token prefix and decodes, 16-token blocks, within 1e-4."""
    case = Case([300, 1, 100, 1], [300, 500, 700, 40], widths, torch.float32, block_size=16,
                seed=7, device="cuda")  # fmt: skip
    backend_step(case, "cuda", context_rows, 1e-4)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize(("tma", "splits"), [(False, 1), (True, 4)])
def test_compiled_chunks_merged_with_an_absorbed_prefix(tma: bool, splits: int):
    """absorbed_prefix_step compiled on the GPU at V2-Lite's widths in bf16 (16-token blocks,
    the backend's prefill tiles), within 2e-2 of the float64 plain form."""
    spec = KVLayerSpec(16, 1, 576, kind="mla", v_head_dim=512, rope_dim=64)
    backend = TritonAttention([spec], 16, torch.bfloat16, torch.device("cuda"))
    c = backend.mla_prefill_config
    launch = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    absorbed_prefix_step((16, 128, 64, 128, 512), torch.bfloat16, splits, tma, "cuda",
                         c.block_m, c.block_n, launch, block_size=16)  # fmt: skip


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("tma", [False, True])
def test_compiled_prefill_at_v2_lite_widths(tma: bool):
    """V2-Lite's widths (16 heads, nope 128, rope 64, v 128, latent 512) in bf16 on the GPU,
    the backend's tiles: a fresh 2048-token prompt; a 700-token fresh prompt beside a 300-token
    chunk over a 900-token prefix, and the same in 512-row pieces; against the float64 plain
    form."""
    widths = (16, 128, 64, 128, 512)
    spec = KVLayerSpec(16, 1, 576, kind="mla", v_head_dim=512, rope_dim=64)
    backend = TritonAttention([spec], 16, torch.bfloat16, torch.device("cuda"))
    c = backend.mla_prefill_config
    launch = {"num_warps": c.num_warps, "num_stages": c.num_stages}
    fresh = Case([2048], [2048], widths, torch.bfloat16, block_size=16, seed=6, device="cuda")
    chunk = Case([700, 300], [700, 1200], widths, torch.bfloat16, block_size=16, seed=5,
                 device="cuda")  # fmt: skip
    for case, max_rows in ((fresh, 1 << 20), (chunk, 1 << 20), (chunk, 512)):
        case.check(run(case, max_rows, c.block_m, c.block_n, tma, launch), TOL[torch.bfloat16])
