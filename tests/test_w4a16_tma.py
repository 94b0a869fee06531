"""The W4A16 CUDA-core GEMV's TMA variant (w4a16.w4a16_tma_kernel, W4Config.tma): its words,
scales and zeros read through tensor descriptors in a pipelined K loop, the arithmetic
_fma_rows' own. Under the interpreter against the exact dequantized weights and bit for bit
against the pointer path at the same tiles (GPTQ symmetric, asymmetric, act-order, per
channel, AWQ; 1-4 rows; K splits and splits past K; gated); which calls take it (FMA_TMA,
tma_problem's fallbacks); its PDL launches; compiled for sm_90 without a GPU (no spills, TMA
copies in the loop and before the PDL wait, no load of x before it); on a GPU at Qwen2.5-3B's
shapes and inside a CUDA graph."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from test_w4a16 import CASES, loaded  # noqa: E402
from test_w4a16_kernel import (  # noqa: E402
    GATED_SPEC,
    QWEN_3B,
    SPEC,
    _close,
    _kernel_sass,
    k_slice,
    random_weights,
)

from inferx_core.interfaces.quant import LinearSpec  # noqa: E402
from inferx_kernels_cuda import pdl, w4a16  # noqa: E402
from inferx_kernels_cuda.w4a16 import (  # noqa: E402
    FMA_TMA_STAGES,
    W4Config,
    fma_config,
    tma_problem,
    w4a16_linear,
    w4a16_linear_parts,
)

LAYOUTS = [
    "gptq-sym-g64",
    "gptq-v2-asym-g32",
    "gptq-asym-act-order",
    "gptq-sym-perchannel",
    "awq-g64",
]
TMA = dict(block_k=32, use_dot=False, tma=True)
# 256 inputs: 8 steps of 32 rows. Splits of 8, 3 and 2 steps, splits past K (16), pipelines 2-4
# deep (deeper than a split's steps too), 32 and 64 columns (SPEC's 96: the second 64-column
# block half past N, TMA's zero fill).
CONFIGS = {
    "m1-st2": W4Config(block_m=1, block_n=64, split_k=1, num_stages=2, **TMA),
    "m2-split3-st3": W4Config(block_m=2, block_n=64, split_k=3, num_stages=3, **TMA),
    "m4-split16-st4": W4Config(block_m=4, block_n=64, split_k=16, num_stages=4, **TMA),
    "m4-n32-split4-st4": W4Config(block_m=4, block_n=32, split_k=4, num_stages=4, **TMA),
}


PDL_KEYS = ("PDL", "TRIGGER", "LATE", "launch_pdl")


class Recorder:
    """Stands in for a Triton kernel: records each launch's keyword arguments, then runs it."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def kernels(monkeypatch):
    """Records the launches of both CUDA-core kernels (w4a16_kernel, w4a16_tma_kernel) and of
    the split reduce, then runs them: {"pointer": ..., "tma": ..., "reduce": ...}."""
    recorders = {
        "pointer": Recorder(w4a16.w4a16_kernel),
        "tma": Recorder(w4a16.w4a16_tma_kernel),
        "reduce": Recorder(w4a16.split_k_reduce_kernel),
    }
    monkeypatch.setattr(w4a16, "w4a16_kernel", recorders["pointer"])
    monkeypatch.setattr(w4a16, "w4a16_tma_kernel", recorders["tma"])
    monkeypatch.setattr(w4a16, "split_k_reduce_kernel", recorders["reduce"])
    return recorders


def _counts(kernels) -> tuple[int, int]:
    """(pointer launches, TMA launches) so far, then cleared."""
    counts = len(kernels["pointer"].launches), len(kernels["tma"].launches)
    for r in kernels.values():
        r.launches.clear()
    return counts


def _args(layer):
    return layer.qweight, layer.scales, layer.zeros, layer.group, layer.perm


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_tma_matches_the_exact_weights_and_the_pointer_path(
    kernels, name: str, config: str, dtype: torch.dtype
) -> None:
    """1-4 rows of fresh random x: the TMA variant within 1e-5 (fp32) or 2^-10 (fp16, the
    output's one rounding) of the output's scale of float64 over the exact weights, with a
    bias, and bit for bit the pointer path at the same tiles (the same products, summed in
    the same order); the K-split partials too."""
    fmt, kw = CASES[name]
    layer, exact, bias = loaded(fmt, SPEC, seed=21, **kw)
    cfg = CONFIGS[config]
    b = layer.bias.to(dtype)
    rel = 1e-5 if dtype == torch.float32 else 2.0**-10
    for rows in range(1, 5):
        gen = torch.Generator().manual_seed(100 * rows + len(name))
        x = torch.randn(rows, SPEC.in_features, generator=gen).to(dtype)
        want = x.double() @ exact.double().t() + b.double()
        got = w4a16_linear(x, *_args(layer), bias=b, config=cfg)
        assert _counts(kernels) == (0, 1)
        _close(got, want, rel)
        pointer = w4a16_linear(x, *_args(layer), bias=b, config=replace(cfg, tma=False))
        assert _counts(kernels) == (1, 0)
        assert torch.equal(got, pointer), (got - pointer).abs().max().item()
        parts = w4a16_linear_parts(x, *_args(layer), bias=b, config=cfg)
        assert parts.shape == (cfg.split_k, rows, 96) and _counts(kernels) == (0, 1)
        if dtype == torch.float32:
            _close(parts.sum(0), want, 1e-5)


@interpreted
@pytest.mark.parametrize("config", ["m1-st2", "m2-split3-st3", "m4-n32-split4-st4"])
@pytest.mark.parametrize("name", ["gptq-sym-g64", "gptq-asym-act-order", "awq-g64"])
def test_tma_gated_is_the_pointer_paths(kernels, name: str, config: str) -> None:
    """gated=True (gate_up: the reduce makes silu(gate) * up) on the TMA variant: bit for bit
    the pointer path's at the same tiles, within 1e-6 of the output's scale of float64
    silu(gate) * up of the plain call, fp32, 1-3 rows, a bias."""
    fmt, kw = CASES[name]
    layer, _, _ = loaded(fmt, GATED_SPEC, seed=13, **kw)
    cfg = CONFIGS[config]
    for rows in (1, 2, 3):
        x = torch.randn(rows, GATED_SPEC.in_features, generator=torch.Generator().manual_seed(rows))
        got = w4a16_linear(x, *_args(layer), bias=layer.bias, config=cfg, gated=True)
        assert _counts(kernels) == (0, 1)
        pointer = w4a16_linear(
            x, *_args(layer), bias=layer.bias, config=replace(cfg, tma=False), gated=True
        )
        assert torch.equal(got, pointer) and _counts(kernels) == (1, 0)
        plain = w4a16_linear(x, *_args(layer), bias=layer.bias, config=cfg)
        assert _counts(kernels) == (0, 1)
        gate, up = plain.double().chunk(2, dim=-1)
        assert got.shape == (rows, 48)
        _close(got, torch.nn.functional.silu(gate) * up, 1e-6)


@interpreted
def test_fma_tma_selects_the_variant_where_it_can(kernels, monkeypatch) -> None:
    """Calls without a config: FMA_TMA off (the default) -> the pointer path; on (read at each
    call) -> the TMA variant at fma_config(tma=True)'s tiles at 1-4 rows, tl.dot's above; a
    row_group call (an act-order K slice) and a layout TMA cannot address (uint8 zeros of 24
    columns: rows of 24 bytes) fall back to the pointer path, all exact. An explicit config's
    tma falls back alike."""
    assert not w4a16.FMA_TMA
    layer, exact, _ = loaded(CASES["gptq-sym-g64"][0], LinearSpec("a.b", 512, (128,)), seed=3)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(3))
    want = x.double() @ exact.double().t()
    _close(w4a16_linear(x[:1], *_args(layer)), want[:1], 1e-5)
    assert _counts(kernels) == (1, 0)
    monkeypatch.setattr(w4a16, "FMA_TMA", True)
    for rows in (1, 2, 4):
        _close(w4a16_linear(x[:rows], *_args(layer)), want[:rows], 1e-5)
        (launch,) = kernels["tma"].launches
        cfg = fma_config(rows, 128, 512, w4a16._num_sms(x.device), tma=True)
        assert launch["BLOCK_N"] == cfg.block_n == (128 if rows == 1 else 64)
        assert launch["STAGES"] == cfg.num_stages == FMA_TMA_STAGES
        assert _counts(kernels) == (0, 1)
        parts = w4a16_linear_parts(x[:rows], *_args(layer))
        assert parts.shape[0] == cfg.split_k and _counts(kernels) == (0, 1)
    x20 = torch.randn(20, 512)
    _close(w4a16_linear(x20, *_args(layer)), x20.double() @ exact.double().t(), 1e-5)
    assert _counts(kernels) == (1, 0)  # tl.dot
    # an act-order K slice: its own scale row a kernel row
    args, row_group, slice_exact = k_slice(64, 256, 32, 2, 1, torch.device("cpu"), seed=5)
    xs = torch.randn(2, 128)
    got = w4a16_linear(xs, *args, row_group=row_group)
    _close(got, xs.double() @ slice_exact.double().t(), 1e-5)
    assert _counts(kernels) == (1, 0)
    assert "row_group" in tma_problem(xs, *args[:3], 64, row_group)
    forced = W4Config(block_m=2, block_n=64, block_k=32, num_stages=3, use_dot=False, tma=True)
    got = w4a16_linear(xs, *args, row_group=row_group, config=forced)
    _close(got, xs.double() @ slice_exact.double().t(), 1e-5)
    assert _counts(kernels) == (1, 0)
    # zeros rows of 24 bytes: no TMA descriptor
    narrow, narrow_exact, _ = loaded(CASES["awq-g64"][0], LinearSpec("a.b", 256, (24,)), seed=4)
    assert "zeros" in tma_problem(x, *_args(narrow)[:3], 64)
    xn = x[:2, :256]
    _close(w4a16_linear(xn, *_args(narrow)), xn.double() @ narrow_exact.double().t(), 1e-5)
    assert _counts(kernels) == (1, 0)
    with pytest.raises(ValueError, match="1-4 rows"):
        fma_config(5, 64, 1024, tma=True)


def test_tma_problem_names_what_stands_in_the_way(monkeypatch) -> None:
    """tma_problem outside the interpreter: a CPU tensor has no TMA; on a TMA device (faked)
    bad tile widths and misaligned bases are named."""
    from types import SimpleNamespace

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    qweight = torch.zeros(32, 128, dtype=torch.int32)
    scales = torch.zeros(2, 128, dtype=torch.float16)
    zeros = torch.zeros(2, 128, dtype=torch.uint8)
    assert "sm_90" in tma_problem(torch.zeros(1, 256), qweight, scales, zeros)
    monkeypatch.setattr(w4a16, "has_tma", lambda device: True)
    x = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert tma_problem(x, qweight, scales, zeros) is None
    assert "block_n" in tma_problem(x, qweight, scales, zeros, block_n=8)
    assert "block_n" in tma_problem(x, qweight, scales, zeros, block_n=512)
    shifted = torch.zeros(2 * 128 + 1, dtype=torch.uint8)[1:].view(2, 128)
    assert "zeros" in tma_problem(x, qweight, scales, shifted)


@interpreted
@pytest.mark.parametrize("config", ["m1-st2", "m4-split16-st4"])
def test_tma_pdl_launches_give_the_same_bits(kernels, monkeypatch, config: str) -> None:
    """On a device with PDL the TMA variant launches with PDL (its wait in the loop's first
    step, or after the loop for a split past K) and pdl.gemv_launch's trigger, and its split
    reduce with PDL; the bits are those of the launch without PDL (the interpreter's grid
    dependency control is a no-op: this checks the variant's structure, not the wait)."""
    layer, exact, bias = loaded(CASES["gptq-asym-act-order"][0], SPEC, seed=8, act_order=True)
    cfg = CONFIGS[config]
    for rows in (1, 3):
        x = torch.randn(rows, SPEC.in_features, generator=torch.Generator().manual_seed(rows))
        base = w4a16_linear(x, *_args(layer), bias=layer.bias, config=cfg)
        (launch,) = kernels["tma"].launches
        assert {k: v for k, v in launch.items() if k in PDL_KEYS} == {
            "PDL": False, "TRIGGER": False,
        }  # fmt: skip
        _counts(kernels)
        monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
        got = w4a16_linear(x, *_args(layer), bias=layer.bias, config=cfg)
        monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)
        assert torch.equal(got, base)
        (launch,) = kernels["tma"].launches
        assert launch["PDL"] and launch["launch_pdl"]
        assert launch["TRIGGER"] == (cfg.split_k > 1 or rows in range(2, 17))
        if cfg.split_k > 1:
            (reduce,) = kernels["reduce"].launches
            assert reduce["PDL"] and reduce["TRIGGER"]
        _counts(kernels)
        _close(got, x.double() @ exact.double().t() + bias.double(), 1e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_tma_variant_compiles_for_sm90_with_tma_and_no_spills(tmp_path, rows: int) -> None:
    """`benchmarks/kernel_sass.py --kernels w4a16 --shapes o,down --tma --pdl`, compiled for
    sm_90 without a GPU (a process of its own, the Triton on its path): the TMA variant
    ("fma tma") without spills, within a program's shared memory, its loop issuing TMA copies
    (UTMALDG) and loading from shared memory (LDS), no global load of words (only x's 16-bit
    loads); at one row within the ~8.8 instructions a weight byte an H100 issues while
    keeping up with memory (1.3 times the pointer path's at most, at four rows). With PDL: the
    pipeline's first copies issued before the wait (ACQBULK), no load of x (LDG) before it."""
    flags = ("--kernels", "w4a16", "--shapes", "o,down", "--tma", "--pdl", "--rows", str(rows))
    table, stdout = _kernel_sass(tmp_path, *flags)
    tma = [row for row in table if " fma tma" in row["kernel"]]
    assert len(tma) == 6, stdout  # two shapes, without PDL and with its two launches
    pointers = {_variant(row["kernel"]): row for row in table if row["kernel"].endswith(" fma")}
    for row in tma:
        assert row["stack"] == 0 and 0 < row["shared"] <= 232_448, stdout
        assert row["ops"].get("UTMALDG", 0) >= 3 and row["ops"].get("LDS", 0) >= 1, stdout
        block_n = 128 if rows == 1 else 64
        assert row["ops"]["LDG"] <= 16 * rows * block_n // 64, stdout  # x's alone
        pointer = pointers[_variant(row["kernel"])]
        if rows == 1:
            assert row["per_byte"] <= 8.9, stdout
        else:
            assert row["per_byte"] <= 1.3 * pointer["per_byte"], stdout
        if " pdl" in row["kernel"]:
            loads = row["pre_wait"]
            assert loads["sass"] == 0 and loads["tma"] >= 3, stdout
        else:
            assert row["pre_wait"] is None, stdout


def _variant(label: str) -> str:
    """A kernel_sass label's shape (its second word): the TMA row's pointer-path twin."""
    return label.split()[1]


# --- GPU ------------------------------------------------------------------------------------


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("shape", QWEN_3B, ids=["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("act_order", [False, True])
def test_tma_on_the_gpu(shape: tuple[int, int], rows: int, act_order: bool) -> None:
    """bf16 x at Qwen2.5-3B's shapes, group 128, fma_config(tma=True)'s tiles: within 2^-7 of
    the output's scale of float64 over the exact weights, and within one bf16 ulp at that
    scale (2^-7) of the pointer path at its own tiles (each rounds once to bf16 an fp32 sum
    of the same exact products, differing only in order)."""
    n, k = shape
    args, exact = random_weights(n, k, 128, act_order, torch.device("cuda"))
    x = torch.randn(rows, k, device="cuda").bfloat16()
    assert tma_problem(x, *args[:3], 128) is None
    want = x.double() @ exact.double().t()
    got = w4a16_linear(x, *args, config=fma_config(rows, n, k, tma=True))
    _close(got, want, 2.0**-7)
    pointer = w4a16_linear(x, *args, config=fma_config(rows, n, k))
    err = (got.double() - pointer.double()).abs().max().item()
    assert err <= 2.0**-7 * want.abs().max().item(), err


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_tma_in_a_cuda_graph(monkeypatch, gated: bool) -> None:
    """FMA_TMA on, 3B's gate_up (gated: silu(gate) * up) or down_proj at one and four rows:
    the calls take the TMA variant; captured in a CUDA graph (descriptors built at capture,
    PDL as on Hopper) and replayed on new x, the result is the eager call's bit for bit."""
    monkeypatch.setattr(w4a16, "FMA_TMA", True)
    n, k = (22016, 2048) if gated else (2048, 11008)
    args, _ = random_weights(n, k, 128, False, torch.device("cuda"))
    for rows in (1, 4):
        static_x = torch.randn(rows, k, device="cuda").bfloat16()
        assert w4a16._call_config(static_x, *args[:3], None).tma
        w4a16_linear(static_x, *args, gated=gated)  # compiled outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w4a16_linear(static_x, *args, gated=gated)
        for seed in range(3):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            static_x.copy_(torch.randn(rows, k, device="cuda", generator=gen).bfloat16())
            graph.replay()
            assert torch.equal(out, w4a16_linear(static_x, *args, gated=gated))
