"""moe_gemv_tma_kernel (inferx_kernels_cuda.moe_kernels): MXFP4's MoE GEMV with the weight words
read through TMA descriptors, pipelined. Under the interpreter on the CPU (which runs tensor
descriptors, zero fill past the edges included) against the float64 reference on the exactly
dequantized experts and against moe_gemv_kernel (pointer loads, the same arithmetic): the
interleaved clamped SwiGLU with biases and SiLU's gate and up rows as two tiles, 1 to 4
tokens, float32 / float16 / bfloat16 activations, K not a multiple of the K tile, the down
projection split along K or summed by atomics; when fused_experts takes it (by default, not
the layouts it refuses); compiled for sm_90 without a GPU; on a GPU at gpt-oss-20b's shapes
against moe_gemv_kernel and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from test_fused_moe import (  # noqa: E402
    SHAPES,
    SPECS,
    TOL,
    dense_experts,
    dequantized,
    gen,
    gpu_expert_weights,
    mxfp4_experts,
    random_routing,
    reference_experts,
    rel,
)

from inferx_core.interfaces import ExpertsSpec, ExpertWeights, RouterSpec  # noqa: E402
from inferx_core.moe import route  # noqa: E402
from inferx_kernels_cuda import moe_kernels  # noqa: E402
from inferx_kernels_cuda.moe_kernels import GemmConfig, fused_experts, gemm_configs  # noqa: E402


def launches(monkeypatch: pytest.MonkeyPatch, *names: str) -> list[str]:
    """The names of moe_kernels' kernels among `names` as they launch from now on (they run)."""
    seen: list[str] = []
    for name in names:
        real = getattr(moe_kernels, name)

        class Counted:
            def __getitem__(self, grid, name=name, real=real):
                seen.append(name)
                return real[grid]

        monkeypatch.setattr(moe_kernels, name, Counted())
    return seen


def inputs(spec: ExpertsSpec, dtype: torch.dtype, tokens: int, seed: int):
    x = torch.randn(tokens, spec.hidden_size, generator=gen(seed)).to(dtype)
    weights, ids = random_routing(tokens, spec.num_experts, 2, seed + 1)
    return x, weights, ids


def want_of(w: ExpertWeights, spec: ExpertsSpec, x, weights, ids) -> torch.Tensor:
    gate_up, down = dequantized(w)
    return reference_experts(x, weights, ids, gate_up, w.gate_up_bias, down, w.down_bias, spec)


@interpreted
@pytest.mark.parametrize("tokens", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_the_reference_and_the_pointer_gemv(name, dtype, tokens, monkeypatch):
    """gemv_tma=True: both projections on moe_gemv_tma_kernel (gemm_configs' interpreter
    tiles: 16 columns, 64 K columns a step, 2 stages; gpt-oss's down K of 96 and qwen3's of
    32 leave the last tile partly past K), against the float64 reference and against
    moe_gemv_kernel to float32 rounding (fp16: one rounding of the intermediate)."""
    spec = SPECS[name]
    w = mxfp4_experts(spec, dtype, seed=80).expert_weights()
    x, weights, ids = inputs(spec, dtype, tokens, 81)
    seen = launches(monkeypatch, "moe_gemv_tma_kernel", "moe_gemv_kernel")
    got = fused_experts(x, weights, ids, w, spec, gemv_tma=True)
    assert seen == ["moe_gemv_tma_kernel"] * 2
    pointer = fused_experts(x, weights, ids, w, spec, gemv=True, gemv_tma=False)
    assert seen[2:] == ["moe_gemv_kernel"] * 2
    want = want_of(w, spec, x, weights, ids)
    assert got.dtype == dtype and want.abs().max() > 0
    assert rel(got, want) < TOL[dtype]
    assert rel(got, pointer.double()) < (1e-6 if dtype == torch.float32 else TOL[dtype])


@interpreted
@pytest.mark.parametrize(
    ("gate_up", "down"),
    [
        (GemmConfig(16, 8, 32, 4, 3), GemmConfig(16, 8, 128, 4, 1)),  # K tiles of 1 group; 1 stage
        (GemmConfig(16, 64, 128, 2, 4), GemmConfig(16, 128, 64, 2, 4)),  # past n, rows and K
    ],
)
@pytest.mark.parametrize("name", list(SPECS))
def test_tiles_and_stages(name, gate_up, down):
    """Other tiles: K columns a step from one 32-weight group to more than K, 1 to 4 stages,
    output columns past n whose rows run past the expert's (the descriptor's zero fill past K
    and past the rows, the scales masked)."""
    spec = SPECS[name]
    w = mxfp4_experts(spec, torch.float32, seed=82).expert_weights()
    x, weights, ids = inputs(spec, torch.float32, 3, 83)
    got = fused_experts(x, weights, ids, w, spec, gemv_tma=True, configs=(gate_up, down))
    assert rel(got, want_of(w, spec, x, weights, ids)) < TOL[torch.float32]


@interpreted
@pytest.mark.parametrize("name", list(SPECS))
def test_bf16_pairs_and_rows(name):
    """bf16 activations read as int32 pairs (an even row stride) or one by one (a view of odd
    row stride): the same bits, and moe_gemv_kernel's; the reference to bf16 rounding."""
    spec = SPECS[name]
    w = mxfp4_experts(spec, torch.bfloat16, seed=84).expert_weights()
    x, weights, ids = inputs(spec, torch.bfloat16, 2, 85)
    paired = fused_experts(x, weights, ids, w, spec, gemv_tma=True)
    odd = torch.zeros(2, spec.hidden_size + 1, dtype=torch.bfloat16)
    odd[:, : spec.hidden_size] = x
    one_by_one = fused_experts(odd[:, : spec.hidden_size], weights, ids, w, spec, gemv_tma=True)
    assert torch.equal(paired, one_by_one)
    assert torch.equal(paired, fused_experts(x, weights, ids, w, spec, gemv=True))
    assert rel(paired, want_of(w, spec, x.float(), weights, ids)) < TOL[torch.bfloat16]


@interpreted
@pytest.mark.parametrize(("split", "atomic_sum"), [(1, True), (2, False), (3, False), (2, True)])
def test_down_split_along_k_and_atomics(split, atomic_sum):
    """down's K (96) in runs of whole 32-column tiles (float32 partial sums, the bias in run
    0's, summed in a fixed order: the same bits on a second call) or summed by atomics."""
    spec = SPECS["gpt-oss"]
    w = mxfp4_experts(spec, torch.float16, seed=86).expert_weights()
    x, weights, ids = inputs(spec, torch.float16, 2, 87)
    cfgs = (GemmConfig(16, 16, 32, 4, 2), GemmConfig(16, 16, 32, 4, 2, split_k=split))
    kw = dict(gemv_tma=True, configs=cfgs, atomic_sum=atomic_sum)
    got = fused_experts(x, weights, ids, w, spec, **kw)
    assert rel(got, want_of(w, spec, x, weights, ids)) < TOL[torch.float16]
    if not atomic_sum:
        assert torch.equal(got, fused_experts(x, weights, ids, w, spec, **kw))


@interpreted
def test_when_fused_experts_takes_it(monkeypatch):
    """By default MXFP4 GEMV steps (up to GEMV_MAX_TOKENS tokens) take it, with
    gemm_configs(gemv_tma=True)'s tiles; not past GEMV_MAX_TOKENS, not with gemv=False,
    gemv_tma=False or configs (the pointer GEMV's), not for blocks TMA cannot address (a base 4
    bytes past 16-byte alignment: moe_gemv_kernel's words still read them). Asking for it where
    it cannot run is refused, naming why."""
    spec = SPECS["gpt-oss"]
    w = mxfp4_experts(spec, torch.float16, seed=88).expert_weights()
    most = moe_kernels.GEMV_MAX_TOKENS
    x, weights, ids = inputs(spec, torch.float16, most + 1, 89)
    seen = launches(monkeypatch, "moe_gemv_tma_kernel", "moe_gemv_kernel", "moe_gemm_kernel")
    e, n, h = spec.num_experts, spec.intermediate_size, spec.hidden_size
    configs = gemm_configs(ids.shape[1], e, n, h, "mxfp4", 132, gemv=True)
    fused_experts(x[:1], weights[:1], ids[:1], w, spec, configs=configs, gemv=True)
    assert seen == ["moe_gemv_kernel"] * 2
    on = fused_experts(x[:most], weights[:most], ids[:most], w, spec)
    assert seen[2:] == ["moe_gemv_tma_kernel"] * 2
    assert rel(on, want_of(w, spec, x[:most], weights[:most], ids[:most])) < TOL[torch.float16]
    fused_experts(x, weights, ids, w, spec)
    fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv=False)
    fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv_tma=False)
    assert seen[4:] == ["moe_gemm_kernel"] * 4 + ["moe_gemv_kernel"] * 2

    def shifted(t: torch.Tensor) -> torch.Tensor:  # the same bytes at a base 16 * i + 4
        flat = torch.zeros(t.numel() + 20, dtype=torch.uint8)
        start = (4 - flat.data_ptr()) % 16
        out = flat[start : start + t.numel()].view(t.shape)
        out.copy_(t)
        return out

    moved = ExpertWeights(
        "mxfp4", shifted(w.gate_up), shifted(w.down), w.gate_up_scales, w.down_scales,
        w.gate_up_bias, w.down_bias,
    )  # fmt: skip
    assert moved.gate_up.data_ptr() % 16 == 4
    assert torch.equal(fused_experts(x[:1], weights[:1], ids[:1], moved, spec), on[:1])
    assert seen[10:] == ["moe_gemv_kernel"] * 2
    with pytest.raises(ValueError, match="16-byte aligned"):
        fused_experts(x[:1], weights[:1], ids[:1], moved, spec, gemv_tma=True)
    with pytest.raises(ValueError, match="neither gemv=False nor tma=True"):
        fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv=False, gemv_tma=True)
    dense = dense_experts(spec, torch.float16, seed=90).expert_weights()
    with pytest.raises(ValueError, match="takes MXFP4 experts, got dense"):
        fused_experts(x[:1], weights[:1], ids[:1], dense, spec, gemv_tma=True)
    wide = (GemmConfig(16, 256, 64, 4, 2), GemmConfig(16, 16, 64, 4, 2))
    with pytest.raises(ValueError, match="at most 256 rows"):
        fused_experts(x[:1], weights[:1], ids[:1], w, spec, gemv_tma=True, configs=wide)


def test_tiles_at_the_published_shapes(monkeypatch):
    """gemm_configs(gemv_tma=True) at 132 SMs (as compiled): gpt-oss-20b's one token copies 16
    weight rows of 1024 K columns a step for both projections (gate_up's 8 columns as 16
    interleaved rows), 4 warps, 4 stages; down split as the pointer GEMV's."""
    monkeypatch.setattr(moe_kernels, "_interpreting", lambda: False)
    gate_up, down = gemm_configs(4, 32, 2880, 2880, "mxfp4", 132, gemv=True, gemv_tma=True)
    assert gate_up == GemmConfig(16, 8, 1024, 4, 4)
    assert down == GemmConfig(16, 16, 1024, 4, 4, split_k=moe_kernels.GEMV_DOWN_SPLIT_K)


# --- compiled for sm_90 without a GPU ------------------------------------------------------------


def test_kernel_compiles_for_sm90_without_spills():
    """gemm_configs(gemv_tma=True)'s tiles at gpt-oss-20b's one token (gate_up, down; down
    split and atomic; fp16 activations) and SiLU's two tiles compile for sm_90 with no
    register spills, the words by TMA bulk copies into num_stages - 1 buffers at least
    (shared memory: the pipeline holds the copies ahead). Compiled by Triton without a GPU,
    in a process of its own (this one may run the interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parent / "sm90_moe_tma.py"
    out = subprocess.run(
        [sys.executable, str(script), "mxfp4"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    kernels = json.loads(out.stdout.splitlines()[-1])
    assert len(kernels) == 7
    stages = moe_kernels.GEMV_MXFP4_TMA_GATE_UP[3]
    for label, shared, _registers, spilled, bulk, tile_bytes in kernels:
        assert spilled == 0, label
        assert bulk, label
        assert (stages - 1) * tile_bytes <= shared <= 232_448, (label, shared)


# --- GPU: compiled at gpt-oss-20b's shapes, against moe_gemv_kernel ------------------------------


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_gpu_matches_the_pointer_gemv(tokens):
    """bf16 on sm_90+ at gpt-oss-20b's MXFP4 shapes: the TMA GEMV against moe_gemv_kernel to
    bf16 rounding (the same float32 sums, in another order), down split in 2 too; a CUDA graph
    of it replays the eager result bit for bit."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA GEMV runs on Hopper or newer")
    _, hidden, inter, experts, k = SHAPES["gpt-oss-20b"]
    spec = ExpertsSpec("mlp.experts", experts, hidden, inter, "swiglu_oai", bias=True)
    w = gpu_expert_weights("mxfp4", spec)
    gpu = torch.device("cuda")
    x = torch.randn(tokens, hidden, device=gpu).to(torch.bfloat16)
    weights, ids = route(torch.randn(tokens, experts, device=gpu), RouterSpec(experts, k))
    pointer = fused_experts(x, weights, ids, w, spec, gemv=True, gemv_tma=False)
    got = fused_experts(x, weights, ids, w, spec, gemv_tma=True)
    gate_up, down = gemm_configs(4, experts, inter, hidden, "mxfp4", 132, True, gemv_tma=True)
    split = (gate_up, GemmConfig(16, down.block_n, down.block_k, 4, down.num_stages, split_k=2))
    halves = fused_experts(x, weights, ids, w, spec, gemv_tma=True, configs=split)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_experts(static_x, weights, ids, w, spec, gemv_tma=True)
    graph.replay()
    torch.cuda.synchronize()
    assert rel(got, pointer.double()) < 1e-2
    assert rel(halves, pointer.double()) < 1e-2
    assert torch.equal(static_out, got)
