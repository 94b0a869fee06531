"""skinny_linear (inferx_kernels_cuda.gemv) against float64 torch: both kernel paths, split and
unsplit, ragged N and K, with and without bias; on the CPU under the interpreter, bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402

from inferx_kernels_cuda.gemv import (  # noqa: E402
    MAX_ROWS,
    GemvConfig,
    pick_config,
    skinny_linear,
    split_for,
)
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402

# (N, K) of the decode step's GEMMs: fused QKV, o_proj, fused gate_up, down_proj, lm_head.
MODEL_SHAPES = {
    "qwen2.5-3b": [(2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008), (151936, 2048)],
    "llama-3.1-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)],
}

# Half an ulp, relative, of the one rounding of the fp32 result to the output dtype (none in fp32).
HALF_ULP = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
CPU = torch.device("cpu")
# Small tiles so the CPU sizes below still have several column blocks and K steps.
SMALL = dict(block_n=16, block_k=32)
CONFIGS = {
    "fma": GemvConfig(**SMALL, split_k=1, use_dot=False),
    "fma-split3": GemvConfig(**SMALL, split_k=3, use_dot=False),
    "dot": GemvConfig(**SMALL, split_k=1, use_dot=True),
    "dot-split3": GemvConfig(**SMALL, split_k=3, use_dot=True),
    "fma-prefetch": GemvConfig(**SMALL, split_k=1, use_dot=False, prefetch=True),
    "fma-prefetch-split3": GemvConfig(**SMALL, split_k=3, use_dot=False, prefetch=True),
    "dot-prefetch-split3": GemvConfig(**SMALL, split_k=3, use_dot=True, prefetch=True),
}


def inputs(
    m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k], weight [n, k], bias [n]: unit-normal activations, weights and a bias that is
    not small next to the products' sum, so a missing bias shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) * 4
    return x.to(device, dtype), w.to(device, dtype), b.to(device, dtype)


def check(
    ours: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    fp32_unit: float = 2.0**-24,
) -> None:
    """ours within a rigorous per-element bound of the exact float64 result: fp32 summation of
    K products and the bias, |error| <= (K + 2) u (sum |x_k w_k| + |b|) with u = 2**-24 (the
    products of half-precision inputs are exact in fp32), then one rounding to the dtype, half
    an ulp of the value (plus half the smallest subnormal step). On tensor cores, which may
    truncate while accumulating, u = 2**-23."""
    m, k, n = x.shape[0], x.shape[1], w.shape[0]
    assert ours.shape == (m, n) and ours.dtype == x.dtype and ours.device == x.device
    exact = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        exact = exact + b.double()
        mag = mag + b.double().abs()
    fp32_err = (k + 2) * fp32_unit * mag
    info = torch.finfo(x.dtype)
    bound = fp32_err + HALF_ULP[x.dtype] * (exact.abs() + fp32_err) + info.tiny * info.eps
    err = (ours.double() - exact).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, (
        f"error {err.max().item():.3e} exceeds the bound by {worst:.2f}x "
        f"(at {divmod((err / bound).argmax().item(), n)})"
    )


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_against_float64(dtype: torch.dtype, m: int, with_bias: bool, name: str) -> None:
    # N = 50: four column blocks of 16, the last one ragged. K = 200 = 6 blocks of 32 and 8 more:
    # unsplit, a masked tail after the loop; in 3 splits of 96, two of 3 whole blocks and a last
    # one of the 8-wide tail alone.
    x, w, b = inputs(m, 50, 200, dtype, CPU, seed=m * 100 + with_bias)
    bias = b if with_bias else None
    before = [t.clone() for t in (x, w, b)]
    check(skinny_linear(x, w, bias, CONFIGS[name]), x, w, bias)
    assert all(torch.equal(t, u) for t, u in zip((x, w, b), before, strict=True))


# The fused epilogue and the unfused path may see fp32 sums a few fp32 ulps apart (other tile
# shapes), which can flip the rounding of gate or up and so move the result by an ulp or two.
GATED_TOL = {torch.float32: 1e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("name", ["fma", "fma-split3", "dot", "dot-split3", "fma-prefetch"])
def test_gated_is_silu_and_mul_of_the_product(
    dtype: torch.dtype, m: int, with_bias: bool, name: str
) -> None:
    """gated=True (a fused gate_up weight): silu(gate) * up from the fp32 sums, rounded as
    silu_and_mul rounds the unfused product (which test_against_float64 checks). 37 output
    columns, ragged in a program's 8, and K = 100, ragged in its 32-wide blocks."""
    x, w, b = inputs(m, 74, 100, dtype, CPU, seed=m * 10 + int(with_bias))
    bias = b if with_bias else None
    cfg = CONFIGS[name]
    ours = skinny_linear(x, w, bias, cfg, gated=True)
    want = TritonOps().silu_and_mul(skinny_linear(x, w, bias, cfg))
    assert ours.shape == (m, 37) and ours.dtype == dtype
    tol = GATED_TOL[dtype]
    torch.testing.assert_close(ours, want, rtol=tol, atol=tol * want.abs().max().item())


@interpreted
@pytest.mark.parametrize("m", [17, 40, 64])
@pytest.mark.parametrize("name", ["dot", "dot-split3"])
def test_dot_path_past_16_rows(m: int, name: str) -> None:
    """17-64 rows on the tensor-core path, x padded to 32 or 64 rows: plain against float64,
    gated against silu_and_mul of the plain product (N and K ragged as above)."""
    x, w, b = inputs(m, 74, 100, torch.float16, CPU, seed=m)
    cfg = CONFIGS[name]
    check(skinny_linear(x, w, b, cfg), x, w, b)
    ours = skinny_linear(x, w, b, cfg, gated=True)
    want = TritonOps().silu_and_mul(skinny_linear(x, w, b, cfg))
    tol = GATED_TOL[torch.float16]
    torch.testing.assert_close(ours, want, rtol=tol, atol=tol * want.abs().max().item())


def test_fma_path_refuses_past_16_rows() -> None:
    x, w, _ = inputs(17, 32, 64, torch.float32, CPU, seed=0)
    with pytest.raises(ValueError, match="FMA path takes at most 16 rows"):
        skinny_linear(x, w, None, GemvConfig(block_n=16, block_k=32))


def test_gated_refuses_odd_weights_and_one_row_tiles() -> None:
    x, w, _ = inputs(1, 6, 32, torch.float32, CPU, seed=0)
    with pytest.raises(ValueError, match="gated needs gate and up rows"):
        skinny_linear(x, w[:5], gated=True)
    with pytest.raises(ValueError, match="gated needs block_n >= 2"):
        skinny_linear(x, w, config=GemvConfig(block_n=1, block_k=32), gated=True)


@interpreted
@pytest.mark.parametrize("use_dot", [False, True])
def test_empty_splits_and_strided_rows(use_dot: bool) -> None:
    # K = 40 in 4 splits of one 32-block: split 1 holds an 8-wide tail, splits 2-3 nothing and
    # must contribute zeros. x and weight are column and row slices of larger tensors (a fused
    # weight's part): row strides 45 and 40, K still contiguous.
    wide_x, fused_w, b = inputs(5, 90, 45, torch.float32, CPU, seed=7)
    x = wide_x[:, 3:43]
    w = fused_w[:, :40].contiguous()[20:70]
    cfg = GemvConfig(block_n=16, block_k=32, split_k=4, use_dot=use_dot)
    check(skinny_linear(x, w, b[20:70], cfg), x, w, b[20:70])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5])
def test_default_config(dtype: torch.dtype, m: int) -> None:
    # pick_config's real tiles (FMA 16x256 at 1 row; 64x128 dot in 2 splits at 5 rows).
    x, w, b = inputs(m, 300, 1000, dtype, CPU, seed=m)
    check(skinny_linear(x, w, b), x, w, b)


@interpreted
def test_fma_block_n_below_16() -> None:
    x, w, _ = inputs(3, 21, 70, torch.float16, CPU, seed=3)
    check(skinny_linear(x, w, None, GemvConfig(block_n=4, block_k=16, split_k=2)), x, w, None)


def test_empty_output_launches_nothing() -> None:
    x, w, _ = inputs(2, 8, 16, torch.float32, CPU, seed=0)
    assert skinny_linear(x[:0], w).shape == (0, 8)
    assert skinny_linear(x, w[:0]).shape == (2, 0)


@pytest.mark.parametrize(
    "args, message",
    [
        (((65, 64), (32, 64)), "at most 64"),
        (((2, 64), (32, 48)), "last dims"),
        (((2, 64, 1), (32, 64)), "must be \\[M, K\\]"),
        (((2, 64), (32, 64), (31,)), "bias must be"),
    ],
)
def test_refuses_bad_shapes(args: tuple[tuple[int, ...], ...], message: str) -> None:
    tensors = [torch.zeros(s) for s in args]
    with pytest.raises(ValueError, match=message):
        skinny_linear(*tensors)


def test_refuses_bad_layouts_dtypes_and_configs() -> None:
    x, w = torch.zeros(2, 64), torch.zeros(32, 64)
    with pytest.raises(ValueError, match="contiguous K"):
        skinny_linear(torch.zeros(64, 2).t(), w)
    with pytest.raises(ValueError, match="contiguous K"):
        skinny_linear(x, torch.zeros(32, 128)[:, ::2])
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear(x, w.half())
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear(x, w, torch.zeros(32, dtype=torch.float16))
    with pytest.raises(ValueError, match="power of two >= 16"):
        skinny_linear(x, w, None, GemvConfig(block_n=8, block_k=32, use_dot=True))
    with pytest.raises(ValueError, match="power of two"):
        skinny_linear(x, w, None, GemvConfig(block_n=24))
    with pytest.raises(ValueError, match="split_k"):
        skinny_linear(x, w, None, GemvConfig(split_k=0))


def test_pick_config_on_the_real_shapes() -> None:
    """The heuristic's promises on every benchmarked shape: a valid config, a power-of-two
    split that fills two programs per SM unless splits would get shorter than 2 K blocks."""
    sms = 132
    for shapes in MODEL_SHAPES.values():
        for n, k in shapes:
            for m in range(1, MAX_ROWS + 1):
                cfg = pick_config(m, n, k, sms)
                cfg.check()
                assert cfg.use_dot == (m > 4)
                s = cfg.split_k
                assert s & (s - 1) == 0
                programs = -(-n // cfg.block_n) * s
                assert programs >= 2 * sms or k < 4 * cfg.block_k * s
                assert s == 1 or k >= 2 * cfg.block_k * s
    assert split_for(blocks_n=1000, k=4096, block_k=256) == 1


GPU_SHAPES = [
    ("3b-qkv", 2560, 2048, True),
    ("3b-o", 2048, 2048, False),
    ("3b-gate_up", 22016, 2048, False),
    ("3b-down", 2048, 11008, False),
    ("3b-lm_head", 151936, 2048, False),
    ("8b-qkv", 6144, 4096, False),
    ("8b-down", 4096, 14336, False),
]
GPU_CONFIGS = {
    "default": None,
    "fma-unsplit": GemvConfig(block_n=16, block_k=256, split_k=1),
    "fma-prefetch-split2": GemvConfig(block_n=16, block_k=256, split_k=2, prefetch=True),
    "dot-split4": GemvConfig(block_n=64, block_k=128, split_k=4, use_dot=True, num_stages=3),
}


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[s[0] for s in GPU_SHAPES])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_bf16_real_shapes(shape: tuple[str, int, int, bool], m: int, name: str) -> None:
    _, n, k, with_bias = shape
    dev = torch.device("cuda")
    x, w, b = inputs(m, n, k, torch.bfloat16, dev, seed=n + m)
    w = w * 0.05  # weights of a trained model's size; the bound scales with them
    bias = b if with_bias else None
    ours = skinny_linear(x, w, bias, GPU_CONFIGS[name])
    check(ours, x, w, bias, fp32_unit=2.0**-23)
    cublas = F.linear(x, w, bias)
    rel = ((ours.double() - cublas.double()).abs().max() / cublas.double().abs().max()).item()
    assert rel <= 1e-2, f"{rel:.2e} against cuBLAS"


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [("3b", 22016, 2048), ("8b", 28672, 4096)], ids=["3b", "8b"])
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("name", list(GPU_CONFIGS))
def test_gpu_gated_real_gate_up(shape: tuple[str, int, int], m: int, name: str) -> None:
    """The fused gate_up + SiLU-and-mul against the model's unfused path: cuBLAS, then
    TritonOps.silu_and_mul."""

    _, n, k = shape
    x, w, _ = inputs(m, n, k, torch.bfloat16, torch.device("cuda"), seed=n + m)
    w = w * 0.05
    ours = skinny_linear(x, w, None, GPU_CONFIGS[name], gated=True)
    want = TritonOps().silu_and_mul(F.linear(x, w))
    assert ours.shape == want.shape
    rel = ((ours.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert rel <= 1e-2, f"{rel:.2e} against cuBLAS + silu_and_mul"


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [("3b", 22016, 2048), ("8b", 28672, 4096)], ids=["3b", "8b"])
@pytest.mark.parametrize("m", [24, 33, 64])
@pytest.mark.parametrize("name", ["default", "dot-split4"])
def test_gpu_gated_past_16_rows(shape: tuple[str, int, int], m: int, name: str) -> None:
    """The tensor-core path at 17-64 rows (x padded to 32 or 64), gated gate_up against cuBLAS
    then TritonOps.silu_and_mul."""
    _, n, k = shape
    x, w, _ = inputs(m, n, k, torch.bfloat16, torch.device("cuda"), seed=n + m)
    w = w * 0.05
    ours = skinny_linear(x, w, None, GPU_CONFIGS[name], gated=True)
    want = TritonOps().silu_and_mul(F.linear(x, w))
    rel = ((ours.double() - want.double()).abs().max() / want.double().abs().max()).item()
    assert ours.shape == want.shape and rel <= 1e-2, f"{rel:.2e} against cuBLAS + silu_and_mul"


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_gpu_cuda_graph_replays_new_inputs(split_k: int) -> None:
    dev = torch.device("cuda")
    x, w, b = inputs(4, 2560, 2048, torch.bfloat16, dev, seed=1)
    cfg = GemvConfig(block_n=32, block_k=256, split_k=split_k)
    static_x = x.clone()
    skinny_linear(static_x, w, b, cfg)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = skinny_linear(static_x, w, b, cfg)
    for seed in (2, 3):
        fresh, _, _ = inputs(4, 2560, 2048, torch.bfloat16, dev, seed=seed)
        static_x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, skinny_linear(fresh, w, b, cfg))
        check(static_out, fresh, w, b, fp32_unit=2.0**-23)
