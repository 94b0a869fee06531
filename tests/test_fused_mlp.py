"""fused_mlp (inferx_kernels_cuda.fused_mlp): gate_up, SiLU-and-mul and down_proj in one launch,
against the unfused torch path (F.linear, TorchOps.silu_and_mul, F.linear) and float64. On the
CPU the interpreter runs its two phases as two launches; on a GPU the fused launch with its
grid barrier runs, in bf16 at the real shapes, eagerly and replayed in a CUDA graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_kernels_cuda.fused_mlp import MAX_ROWS, MlpConfig, fused_mlp  # noqa: E402

# Small tiles: the CPU sizes below still give each program several tiles, partial tiles and a
# K tail in both phases.
SMALL = MlpConfig(rows_up=4, rows_down=4, block_k=32)


def weights(
    m: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g)
    w_up = torch.randn(2 * inter, hidden, generator=g) / hidden**0.5
    w_down = torch.randn(hidden, inter, generator=g) / inter**0.5
    return x.to(device, dtype), w_up.to(device, dtype), w_down.to(device, dtype)


def unfused(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """What the model runs without the fusion, rounding where it rounds."""
    return F.linear(TorchOps().silu_and_mul(F.linear(x, w_up)), w_down)


def in_float64(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.double(), w_up.double()).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down.double())


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@interpreted
@pytest.mark.parametrize("m", [1, 3, 4])
@pytest.mark.parametrize(("hidden", "inter"), [(64, 96), (72, 200)])
def test_float32_against_float64(m: int, hidden: int, inter: int) -> None:
    x, w_up, w_down = weights(m, hidden, inter, torch.float32, "cpu", seed=m + hidden)
    out = fused_mlp(x, w_up, w_down, SMALL)
    assert out.shape == (m, hidden) and out.dtype == torch.float32
    assert rel_err(out, in_float64(x, w_up, w_down)) < 1e-5


@interpreted
@pytest.mark.parametrize("m", [1, 2])
def test_half_rounds_like_the_unfused_path(m: int) -> None:
    """float16, not bf16: the interpreter casts fp32 to bf16 by truncation (torch and GPUs round
    to nearest), so its bf16 results drift by ~1-2%; bf16 is checked on the GPU below."""
    x, w_up, w_down = weights(m, 64, 160, torch.float16, "cpu", seed=7 + m)
    out = fused_mlp(x, w_up, w_down, SMALL)
    # The sums differ only in the order of fp32 additions: an ulp (2**-11) or two at most.
    assert rel_err(out, unfused(x, w_up, w_down)) < 2**-9
    assert rel_err(out, in_float64(x, w_up, w_down)) < 2**-7


@interpreted
def test_default_tiles_on_a_shape_their_size() -> None:
    x, w_up, w_down = weights(1, 256, 512, torch.float32, "cpu", seed=3)
    assert rel_err(fused_mlp(x, w_up, w_down), in_float64(x, w_up, w_down)) < 1e-5


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((5, 64), (192, 64), (64, 96)), "rows"),
        (((1, 64), (191, 64), (64, 96)), "do not make an MLP"),
        (((1, 64), (192, 64), (64, 95)), "do not make an MLP"),
    ],
)
def test_refuses_bad_shapes(shapes: tuple[tuple[int, int], ...], message: str) -> None:
    x, w_up, w_down = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        fused_mlp(x, w_up, w_down)


def test_refuses_mixed_dtypes_and_strided_weights() -> None:
    x, w_up, w_down = weights(1, 64, 96, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="dtypes differ"):
        fused_mlp(x, w_up.bfloat16(), w_down)
    with pytest.raises(ValueError, match="contiguous"):
        fused_mlp(x, w_up, w_down.t().contiguous().t())


# Qwen2.5-3B and Llama-3.1-8B: (hidden, intermediate).
REAL = {"qwen2.5-3b": (2048, 11008), "llama-3.1-8b": (4096, 14336)}


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("model", list(REAL))
@pytest.mark.parametrize("m", list(range(1, MAX_ROWS + 1)))
def test_gpu_bf16_real_shapes(model: str, m: int) -> None:
    hidden, inter = REAL[model]
    x, w_up, w_down = weights(m, hidden, inter, torch.bfloat16, "cuda", seed=m)
    out = fused_mlp(x, w_up, w_down)
    assert rel_err(out, unfused(x, w_up, w_down)) < 2**-7
    assert rel_err(out, in_float64(x, w_up, w_down)) < 2**-5


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [MlpConfig(), MlpConfig(programs_per_sm=1, num_warps=8)])
def test_gpu_graph_replays_many_launches(cfg: MlpConfig) -> None:
    """Forty launches a replay, five replays with new inputs: the barrier's counter carries
    over between launches and replays, and every launch still waits for its own phase 1."""
    hidden, inter = REAL["qwen2.5-3b"]
    x, w_up, w_down = weights(1, hidden, inter, torch.bfloat16, "cuda", seed=11)
    static_x = x.clone()
    fused_mlp(static_x, w_up, w_down, cfg)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused_mlp(static_x, w_up, w_down, cfg) for _ in range(40)]
    for seed in range(5):
        static_x.copy_(weights(1, hidden, inter, torch.bfloat16, "cuda", seed=100 + seed)[0])
        graph.replay()
        ref = unfused(static_x, w_up, w_down)
        for out in (outs[0], outs[-1]):
            assert rel_err(out, ref) < 2**-7
