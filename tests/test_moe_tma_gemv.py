"""moe_tma_gemv_kernel (inferx_kernels_cuda.moe_kernels): the MoE GEMMs of dense experts with the
weight tiles read through TMA descriptors, as fused_experts runs them at decode sizes. Under the
interpreter on the CPU (which runs tensor descriptors, zero fill past the edges included)
against the float64 pair-by-pair reference: SiLU and the interleaved clamped SwiGLU, with and
without biases, shared-expert slots, one token (a tile per pair) and three (grouped by
expert), atomics and a split down; when fused_experts picks it; compiled for sm_90 without a
GPU; on a GPU against moe_gemm_kernel's path at DeepSeek-V2-Lite's and Qwen3-30B-A3B's
shapes in bf16."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from test_fused_moe import (  # noqa: E402
    TOL,
    dense_experts,
    gen,
    mxfp4_experts,
    reference_experts,
    rel,
)

from inferx_core.interfaces import ExpertsSpec, ExpertWeights, RouterSpec  # noqa: E402
from inferx_core.moe import route  # noqa: E402
from inferx_kernels_cuda import moe_kernels  # noqa: E402
from inferx_kernels_cuda.moe_kernels import GemmConfig, fused_experts, tma_configs  # noqa: E402

SPECS = {
    # Qwen3-MoE: SiLU on gate rows then up rows, no biases; n 40 over 16-column tiles: the last
    # gate tile reaches into the up rows, the last up tile into the next expert's rows
    "silu": ExpertsSpec("mlp.experts", 8, 64, 40),
    # biases; K 72 over 32-column tiles: the descriptor zero-fills the last tile past K
    "silu-bias": ExpertsSpec("mlp.experts", 8, 72, 32, bias=True),
    # gpt-oss: gate and up interleaved (one tile of both, split after the loop), clamped SwiGLU
    "swiglu-oai": ExpertsSpec("mlp.experts", 4, 64, 48, activation="swiglu_oai", bias=True),
    # DeepSeek-style: the last 2 of 8 experts are shared slots every token takes at weight 1
    "shared": ExpertsSpec("mlp.experts", 8, 64, 32, shared=2),
}


def routing(spec: ExpertsSpec, tokens: int, k: int, seed: int):
    """Renormalized top-k over the routed experts, then the spec's shared slots (1.0, E + i)."""
    logits = torch.randn(tokens, spec.routed, generator=gen(seed))
    return route(logits, RouterSpec(spec.routed, k, renormalize=True, shared=spec.shared))


def launches(monkeypatch: pytest.MonkeyPatch, name: str) -> list:
    """The grids moe_kernels.<name> (a kernel) launches with from now on (it still runs)."""
    grids = []
    real = getattr(moe_kernels, name)

    class Counted:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(moe_kernels, name, Counted())
    return grids


def groupings(monkeypatch: pytest.MonkeyPatch) -> list:
    calls = []
    real = moe_kernels.group_by_expert

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return real(*args, **kw)

    monkeypatch.setattr(moe_kernels, "group_by_expert", counted)
    return calls


def check(spec, w, dtype, tokens, k, seed, **kw) -> torch.Tensor:
    """fused_experts against the float64 reference (TOL by dtype); returns the output."""
    x = torch.randn(tokens, spec.hidden_size, generator=gen(seed)).to(dtype)
    weights, ids = routing(spec, tokens, k, seed + 1)
    want = reference_experts(x, weights, ids, w.gate_up, w.gate_up_bias, w.down, w.down_bias, spec)
    got = fused_experts(x, weights, ids, w, spec, **kw)
    assert got.shape == x.shape and got.dtype == dtype
    assert want.abs().max() > 0
    assert rel(got, want) < TOL[dtype], rel(got, want)
    return got


@interpreted
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_the_reference(name, dtype, tokens, monkeypatch):
    """fp16 takes the TMA kernel by default (float32, its exact check, by asking), one launch
    per projection; one token a tile per pair, two tokens grouped by expert first."""
    spec = SPECS[name]
    w = dense_experts(spec, dtype, seed=60).expert_weights()
    grids = launches(monkeypatch, "moe_tma_gemv_kernel")
    grouped = groupings(monkeypatch)
    tma = True if dtype == torch.float32 else None
    check(spec, w, dtype, tokens, 2, seed=61, tma=tma)
    assert len(grids) == 2
    assert len(grouped) == (0 if tokens <= moe_kernels.PER_PAIR_MAX_TOKENS else 1)


@interpreted
@pytest.mark.parametrize("name", ["silu-bias", "swiglu-oai"])
def test_atomic_sum_and_down_split_along_k(name, monkeypatch):
    """The top-k sum by atomics in the down GEMM; down's K in 2 or 3 runs of whole tiles
    (float32 partial sums, the bias in run 0's, summed by moe_sum_kernel in a fixed order: the
    same bits on a second call); K 32 or 48 over 32-column tiles leaves a third run no tile."""
    spec = SPECS[name]
    dtype = torch.float16
    w = dense_experts(spec, dtype, seed=62).expert_weights()
    grids = launches(monkeypatch, "moe_tma_gemv_kernel")
    check(spec, w, dtype, 1, 2, seed=63, atomic_sum=True)
    check(spec, w, dtype, 2, 2, seed=64, atomic_sum=True)
    tile = GemmConfig(16, 16, 32, 4, 1)
    for split in (2, 3):
        cfgs = (tile, GemmConfig(16, 16, 32, 4, 1, split_k=split))
        first = check(spec, w, dtype, 2, 2, seed=65, tma=True, configs=cfgs)
        assert torch.equal(first, check(spec, w, dtype, 2, 2, seed=65, tma=True, configs=cfgs))
    assert [g[1] for g in grids] == [1, 1] * 2 + [1, 2] * 2 + [1, 3] * 2


@interpreted
def test_when_fused_experts_takes_it(monkeypatch):
    """By default fp16 / bf16 dense experts up to TMA_GEMV_MAX_TOKENS tokens; not past it, not
    with TMA_GEMV_MAX_TOKENS 0 (then moe_gemm_kernel, to the same result within rounding), not
    when gemv or configs are given, not for float32 or MXFP4 weights. Asking for it where it
    cannot run is refused, naming why."""
    spec = SPECS["silu"]
    dtype = torch.float16
    w = dense_experts(spec, dtype, seed=66).expert_weights()
    grids = launches(monkeypatch, "moe_tma_gemv_kernel")
    most = moe_kernels.TMA_GEMV_MAX_TOKENS
    x = torch.randn(most + 1, spec.hidden_size, generator=gen(67)).to(dtype)
    weights, ids = routing(spec, most + 1, 2, 68)
    tma_out = fused_experts(x[:most], weights[:most], ids[:most], w, spec)
    assert len(grids) == 2
    fused_experts(x, weights, ids, w, spec)
    fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv=False)
    cfg = GemmConfig(16, 32, 16, 4, 1)
    fused_experts(x[:1], weights[:1], ids[:1], w, spec, configs=(cfg, cfg))
    fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv=True)
    f32 = dense_experts(spec, torch.float32, seed=66).expert_weights()
    fused_experts(x[:1].float(), weights[:1], ids[:1], f32, spec)
    spec32 = SPECS["shared"]  # MXFP4 takes whole 32-column groups
    mx = mxfp4_experts(spec32, dtype, seed=69).expert_weights()
    fused_experts(x[:1], weights[:1], ids[:1], mx, spec32)
    monkeypatch.setattr(moe_kernels, "TMA_GEMV_MAX_TOKENS", 0)
    gemm_out = fused_experts(x[:most], weights[:most], ids[:most], w, spec)
    assert len(grids) == 2
    assert rel(gemm_out, tma_out.double()) < TOL[dtype]
    with pytest.raises(ValueError, match="two kernels"):
        fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv=True, tma=True)
    with pytest.raises(ValueError, match="dense fp16 / bf16 experts, got mxfp4"):
        fused_experts(x[:1], weights[:1], ids[:1], mx, spec32, tma=True)


@interpreted
def test_weight_layouts_it_reads_and_refuses(monkeypatch):
    """Rows padded past K (a row stride of K + 8: the descriptor takes the stride) are read
    right; experts that are not one after another (every second of a larger stack) do not
    flatten to [E * rows, K]: fused_experts keeps moe_gemm_kernel, and refuses tma=True."""
    spec = SPECS["silu-bias"]
    dtype = torch.float16
    w = dense_experts(spec, dtype, seed=70).expert_weights()
    grids = launches(monkeypatch, "moe_tma_gemv_kernel")
    e, rows, h = w.gate_up.shape
    padded = torch.zeros(e, rows, h + 8, dtype=dtype)
    padded[:, :, :h] = w.gate_up
    wide = ExpertWeights("dense", padded[:, :, :h], w.down, gate_up_bias=w.gate_up_bias,
                         down_bias=w.down_bias)  # fmt: skip
    check(spec, wide, dtype, 1, 2, seed=71)
    assert len(grids) == 2
    twice = torch.stack([w.gate_up, torch.zeros_like(w.gate_up)], dim=1).flatten(0, 1)
    apart = ExpertWeights("dense", twice[::2], w.down, gate_up_bias=w.gate_up_bias,
                          down_bias=w.down_bias)  # fmt: skip
    check(spec, apart, dtype, 1, 2, seed=72)
    assert len(grids) == 2
    x = torch.randn(1, spec.hidden_size, dtype=dtype)
    weights, ids = routing(spec, 1, 2, 73)
    with pytest.raises(ValueError, match="experts one after another"):
        fused_experts(x, weights, ids, apart, spec, tma=True)


def test_tiles_at_the_published_shapes(monkeypatch):
    """tma_configs at 132 SMs (as compiled: under the interpreter it picks small tiles)."""
    monkeypatch.setattr(moe_kernels, "_interpreting", lambda: False)
    picks = {
        "v2-lite 1": tma_configs(8, 66, 1408, 2048, 132),
        "qwen3 1": tma_configs(8, 128, 768, 2048, 132),
        "v2-lite 4": tma_configs(32, 66, 1408, 2048, 132),
    }
    # 176 gate_up programs of 64 gate + 64 up rows, 2 an SM at most: 3 stages of 128 columns
    assert picks["v2-lite 1"] == (GemmConfig(16, 64, 128, 4, 3), GemmConfig(16, 64, 128, 4, 4))
    # 12 tiles of 64 columns a pair would be 96 programs: 32 columns, 192
    assert picks["qwen3 1"][0] == GemmConfig(16, 32, 128, 4, 4)
    # up to 704 programs, 6 an SM: 2 stages of 64 columns keep them all resident
    assert picks["v2-lite 4"][0] == GemmConfig(16, 64, 64, 4, 2)


# --- compiled for sm_90 without a GPU ------------------------------------------------------------

SM90_MAX_SHARED_PER_PROGRAM = 232_448


def test_kernel_compiles_for_sm90_without_spills():
    """tma_configs' tiles at DeepSeek-V2-Lite's, Qwen3-30B-A3B's and gpt-oss-20b's bf16 shapes
    (1 and 4 tokens, gate_up and down; down split and atomic too; fp16 once) compile for
    sm_90 within a program's shared memory with no register spills, the weight by TMA bulk
    copies, on wgmma where the tile has 64 weight rows (32-row tiles take mma.sync). Compiled
    by Triton without a GPU, in a process of its own (this one may run the interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_moe_tma.py"
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    kernels = json.loads(out.stdout.splitlines()[-1])
    assert len(kernels) == 20
    for label, shared, _registers, spilled, wgmma, bulk in kernels:
        assert 0 < shared <= SM90_MAX_SHARED_PER_PROGRAM, (label, shared)
        assert spilled == 0, label
        assert bulk, label
        if label != "qwen3-30b-a3b 1 gate_up":  # 32 columns: mma.sync
            assert wgmma == (["f16.f16"] if "fp16" in label else ["bf16.bf16"]), label


# --- GPU: compiled at the published shapes, against moe_gemm_kernel's path ----------------------

GPU = torch.device("cuda")
SHAPES = {  # (hidden, intermediate, routed experts, top_k, shared slots)
    "deepseek-v2-lite": (2048, 1408, 64, 6, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0),
}


@functools.cache
def gpu_experts(shape: str) -> tuple[ExpertsSpec, ExpertWeights]:
    hidden, inter, routed, _, shared = SHAPES[shape]
    spec = ExpertsSpec("mlp.experts", routed + shared, hidden, inter, shared=shared)
    g = torch.Generator(device=GPU).manual_seed(80)
    e = spec.num_experts

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=GPU) * 0.02).to(torch.bfloat16)

    return spec, ExpertWeights("dense", randn(e, 2 * inter, hidden), randn(e, hidden, inter))


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gpu_matches_the_moe_gemm_path(shape, tokens, monkeypatch):
    """bf16 on sm_90+: the TMA kernel (fused_experts' default up to 2 tokens) against
    moe_gemm_kernel's path (tma=False) to bf16 rounding (both round the activation between
    the GEMMs and each expert's output once), both against float32 torch; a CUDA graph of it
    replays the eager result bit for bit."""
    from inferx_core.moe import expert_mlp, run_experts

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernel runs on Hopper or newer")
    hidden, _, routed, k, shared = SHAPES[shape]
    spec, w = gpu_experts(shape)
    x = torch.randn(tokens, hidden, device=GPU).to(torch.bfloat16)
    logits = torch.randn(tokens, routed, device=GPU)
    weights, ids = route(logits, RouterSpec(routed, k, renormalize=not shared, shared=shared))
    grids = launches(monkeypatch, "moe_tma_gemv_kernel")
    got = fused_experts(x, weights, ids, w, spec, tma=True)
    assert len(grids) == 2
    gemm = fused_experts(x, weights, ids, w, spec, tma=False)
    gate_up, down = w.gate_up.float(), w.down.float()
    want = run_experts(
        x.float(), weights, ids, spec.num_experts,
        lambda e, rows: expert_mlp(rows, gate_up[e], None, down[e], None, spec),
    )  # fmt: skip
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts(static_x, weights, ids, w, spec, tma=True)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(got, gemm.double()) < 1e-2
    assert rel(got, want.double()) < 2e-2 and rel(gemm, want.double()) < 2e-2
    assert torch.equal(static_out, got)
