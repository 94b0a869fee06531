"""The W4A16 Triton GEMM (inferx_kernels_cuda.w4a16) against the exact dequantized weights: GPTQ
(with and without act-order, per group and per channel) and AWQ layers as inferx_quant.w4a16
loads them, 1-16 rows (split-K GEMV) and more (tiled GEMM), on the CPU under the interpreter at
small sizes; the model's shapes in bf16 on a GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import interpreted, on_gpu  # noqa: E402
from test_w4a16 import CASES, loaded  # noqa: E402

from inferx_core.interfaces.quant import LinearSpec  # noqa: E402
from inferx_kernels_cuda.w4a16 import (  # noqa: E402
    W4Config,
    fma_config,
    pick_config,
    w4a16_linear,
    w4a16_linear_parts,
)
from inferx_quant.w4a16 import (  # noqa: E402
    W4A16Linear,
    W4Format,
    pack_rows,
    unpack_rows,
)

# 256 inputs, 96 outputs: two 64-column blocks, the second ragged.
SPEC = LinearSpec("model.layers.0.mlp.down_proj", 256, (96,), bias=True)
LAYOUTS = ["gptq-sym-g64", "gptq-sym-perchannel", "gptq-act-order-g64", "awq-g64"]
SMALL = dict(block_n=64, block_k=32, num_stages=1)
CONFIGS = {
    "gemv": W4Config(block_m=16, split_k=1, **SMALL),
    "gemv-split3": W4Config(block_m=16, split_k=3, **SMALL),
    "gemv-split3-dup-loads": W4Config(block_m=16, split_k=3, packed_loads=False, **SMALL),
    "gemm": W4Config(block_m=32, split_k=1, **SMALL),
    "fma-split3": W4Config(block_m=2, split_k=3, use_dot=False, **SMALL),
}
# the CUDA-core path's other row counts a program (1 and 4; 2 above)
FMA_ROWS = {
    "fma-m1": W4Config(block_m=1, split_k=1, use_dot=False, **SMALL),
    "fma-m4-split3": W4Config(block_m=4, split_k=3, use_dot=False, **SMALL),
}
# the CUDA-core path's register prefetch (the next step's words, scales and zeros loaded
# before this step's arithmetic) over K splits: 8 steps of 32 rows at K 256, so a step's words
# or group read a step off change the sums; split 16 leaves 8 splits past K (no steps, no
# loads), split 3 one step, three, and two a split
FMA_SPLITS = {
    "m1": W4Config(block_m=1, split_k=1, use_dot=False, **SMALL),
    "m2-split3": W4Config(block_m=2, split_k=3, use_dot=False, **SMALL),
    "m4-split16": W4Config(block_m=4, split_k=16, use_dot=False, **SMALL),
    "m4-split5": W4Config(block_m=4, split_k=5, use_dot=False, **SMALL),
}


def _layer(name: str):
    fmt, kw = CASES[name]
    return loaded(fmt, SPEC, seed=5, **kw)


def _args(layer: W4A16Linear):
    return layer.qweight, layer.scales, layer.zeros, layer.group, layer.perm


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """got within rel of want's largest magnitude (the output's scale)."""
    assert got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    assert err <= rel * want.abs().max().item(), (err, want.abs().max().item())


@interpreted
@pytest.mark.parametrize("rows", [1, 16, 40])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", LAYOUTS)
def test_fp32_matches_the_exact_weights(name: str, config: str, rows: int) -> None:
    """fp32 throughout (tl.dot in IEEE fp32): within 1e-5 of the output's scale of float64."""
    layer, exact, bias = _layer(name)
    x = torch.randn(rows, SPEC.in_features, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ exact.double().t() + bias.double()
    got = w4a16_linear(x, *_args(layer), bias=layer.bias, config=CONFIGS[config])
    assert got.dtype == torch.float32
    _close(got, want, 1e-5)
    parts = w4a16_linear_parts(x, *_args(layer), bias=layer.bias, config=CONFIGS[config])
    assert parts.shape == (CONFIGS[config].split_k, rows, 96)
    _close(parts.sum(0), want, 1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 33])
@pytest.mark.parametrize("name", ["gptq-act-order-g64", "awq-g64"])
def test_half_precision(name: str, rows: int, dtype: torch.dtype) -> None:
    """x in fp16 / bf16: the kernel rounds each dequantized weight once to x's dtype for tl.dot
    and the fp32 sum once to the output, so against float64 with the weights so rounded: two
    ulps of the output's scale (fp16 2^-10, bf16 2^-7)."""
    layer, exact, bias = _layer(name)
    x = torch.randn(rows, SPEC.in_features, generator=torch.Generator().manual_seed(7)).to(dtype)
    want = x.double() @ exact.to(dtype).double().t() + bias.to(dtype).double()
    got = w4a16_linear(x, *_args(layer), bias=layer.bias.to(dtype), config=CONFIGS["gemv-split3"])
    assert got.dtype == dtype
    _close(got, want, 2.0**-10 if dtype == torch.float16 else 2.0**-7)


@interpreted
@pytest.mark.parametrize("config", FMA_ROWS)
@pytest.mark.parametrize("name", ["gptq-act-order-g64", "awq-g64"])
def test_fma_path_over_the_range_of_x(name: str, config: str) -> None:
    """The CUDA-core path sums x * 2^(64 - p) times denormal nibbles (w4a16._fma_rows): rows
    of x scaled by 2^-30, 1 and 2^40 (inside its documented range, |x| < 2^64) each within
    1e-5 of their own output's scale of float64."""
    layer, exact, bias = _layer(name)
    x = torch.randn(3, SPEC.in_features, generator=torch.Generator().manual_seed(11))
    x = x * torch.tensor([2.0**-30, 1.0, 2.0**40])[:, None]
    want = x.double() @ exact.double().t()
    got = w4a16_linear(x, *_args(layer), config=FMA_ROWS[config])
    for row in range(3):
        _close(got[row], want[row], 1e-5)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("config", FMA_SPLITS)
@pytest.mark.parametrize("name", ["gptq-sym-g64", "gptq-act-order-g64", "awq-g64"])
def test_fma_path_over_k_splits(name: str, config: str, dtype: torch.dtype) -> None:
    """The CUDA-core path, the next step's loads in flight during each step, at 1-4 rows
    (ragged N, K splits, splits past K, act-order) against float64 of the exact weights: 1e-5
    of the output's scale in fp32, two ulps of it in fp16 / bf16 (the weights are not rounded
    on this path); the partials summed too in fp32."""
    layer, exact, bias = _layer(name)
    cfg = FMA_SPLITS[config]
    for rows in range(1, 5):
        x = torch.randn(rows, SPEC.in_features, generator=torch.Generator().manual_seed(rows))
        x = x.to(dtype)
        want = x.double() @ exact.double().t() + bias.to(dtype).double()
        b = layer.bias.to(dtype)
        got = w4a16_linear(x, *_args(layer), bias=b, config=cfg)
        rel = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[dtype]
        _close(got, want, rel)
        parts = w4a16_linear_parts(x, *_args(layer), bias=b, config=cfg)
        assert parts.shape == (cfg.split_k, rows, 96)
        if dtype == torch.float32:
            _close(parts.sum(0), want, 1e-5)


# a gate_up layer: 256 inputs, gate and up of 48 outputs each (ragged 64-column blocks)
GATED_SPEC = LinearSpec("model.layers.0.mlp.gate_up_proj", 256, (48, 48), bias=True)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", ["gemv", "gemv-split3", "fma-split3", "fma-m1"])
@pytest.mark.parametrize("name", ["gptq-sym-g64", "gptq-act-order-g64"])
def test_gated_is_silu_and_mul_of_the_plain_call(name: str, config: str, dtype) -> None:
    """gated=True (the reduce makes silu(gate) * up, launched even without a K split) against
    silu_and_mul of the plain call's output, rows 1-3, with a bias: in fp32 within 1e-6 of the
    output's scale of float64 silu(gate) * up of the plain output; in fp16 within 2^-10 of the
    output's scale of silu(gate) rounded to fp16 times up (gate and up rounded first by both),
    the result's rounding. (fp16, not bf16: the interpreter casts to bf16 toward zero.)"""
    fmt, kw = CASES[name]
    layer, _, _ = loaded(fmt, GATED_SPEC, seed=9, **kw)
    cfg = (CONFIGS | FMA_ROWS)[config]
    b = layer.bias.to(dtype)
    for rows in (1, 2, 3):
        if not cfg.use_dot and rows > cfg.block_m:
            continue
        gen = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, GATED_SPEC.in_features, generator=gen).to(dtype)
        plain = w4a16_linear(x, *_args(layer), bias=b, config=cfg)
        got = w4a16_linear(x, *_args(layer), bias=b, config=cfg, gated=True)
        assert got.shape == (rows, 48) and got.dtype == dtype
        gate, up = plain.double().chunk(2, dim=-1)
        if dtype == torch.float32:
            _close(got, torch.nn.functional.silu(gate) * up, 1e-6)
        else:
            silu = torch.nn.functional.silu(gate).to(dtype).double()
            _close(got, silu * up, 2.0**-10)
    qweight, *rest = _args(layer)
    with pytest.raises(ValueError, match="gate and up halves"):
        w4a16_linear(x, qweight[:, :-1], *rest, gated=True)


@interpreted
def test_the_layer_fuses_gate_up_and_silu_through_the_ops(monkeypatch) -> None:
    """W4A16Linear.forward_silu_and_mul runs the gated kernel where its kernels run (here the
    interpreter stands in for the GPU) and TritonOps.linear_silu_and_mul takes it; on the CPU
    reference path it declines (None) and the ops run forward, then silu_and_mul: the same
    values within fp32 rounding."""
    from inferx_kernels_cuda import w4a16 as kernels
    from inferx_kernels_cuda.ops import TritonOps

    fmt, kw = CASES["gptq-sym-g64"]
    layer, _, _ = loaded(fmt, GATED_SPEC, seed=4, **kw)
    x = torch.randn(2, GATED_SPEC.in_features)
    assert layer.forward_silu_and_mul(x) is None  # the reference path: not fused
    ops = TritonOps()
    unfused = ops.linear_silu_and_mul(layer, x)
    calls = []

    def gated_kernel(*args, **kwargs):
        calls.append(kwargs.get("gated"))
        return kernels.w4a16_linear(*args, **kwargs)

    monkeypatch.setattr(type(layer), "_kernels", lambda self, x: _Kernels(gated_kernel))
    fused = ops.linear_silu_and_mul(layer, x)
    assert calls == [True]
    _close(fused, unfused.double(), 1e-5)


class _Kernels:
    """inferx_kernels_cuda.w4a16 as W4A16Linear._kernels hands it out, w4a16_linear wrapped."""

    def __init__(self, linear) -> None:  # noqa: ANN001
        self.w4a16_linear = linear


@interpreted
def test_picked_configs_run() -> None:
    """The default configs (block_k lowered to the group): a GEMV with a K split, a GEMM."""
    fmt = W4Format("gptq", 32, True, 1)
    spec = LinearSpec("a.b", 1024, (64,))
    layer, exact, _ = loaded(fmt, spec, seed=2)
    # 2 rows split K (one column block for 8 SMs); at 20 rows the fp32 partials would cost
    # more than a quarter of the weight's bytes (split * rows <= K / 64), so no split
    assert pick_config(2, 64, 1024, num_sms=8).split_k == 2  # 4 BLOCK_K steps a split
    assert pick_config(20, 64, 1024, num_sms=8).split_k == 1
    for rows in (2, 20):
        x = torch.randn(rows, 1024)
        got = w4a16_linear(x, *_args(layer), config=pick_config(rows, 64, 1024, num_sms=8))
        _close(got, x.double() @ exact.double().t(), 1e-5)
    # the CUDA-core path's config (timed by the benchmark, not picked): 2 rows -> block_m 2,
    # K split for eight programs an SM down to two 128-row steps a split
    fma = fma_config(2, 64, 1024, num_sms=8)
    assert (fma.use_dot, fma.block_m, fma.split_k) == (False, 2, 4)
    x = torch.randn(2, 1024)
    _close(w4a16_linear(x, *_args(layer), config=fma), x.double() @ exact.double().t(), 1e-5)
    with pytest.raises(ValueError, match="1-4 rows"):
        fma_config(5, 64, 1024)


@interpreted
def test_default_config_takes_the_fma_path_up_to_fma_rows(monkeypatch) -> None:
    """A call without a config: the CUDA-core path up to FMA_ROWS rows (4 by default),
    pick_config's tl.dot path above or everywhere at 0, and both give the exact weights' product."""
    from inferx_kernels_cuda import w4a16

    assert [w4a16.default_config(m, 64, 1024).use_dot for m in (1, 4, 5, 20)] == [
        False, False, True, True,
    ]  # fmt: skip
    monkeypatch.setattr(w4a16, "FMA_ROWS", 0)
    assert all(w4a16.default_config(m, 64, 1024).use_dot for m in (1, 4, 20))
    monkeypatch.setattr(w4a16, "FMA_ROWS", 2)
    assert [w4a16.default_config(m, 64, 1024).use_dot for m in (1, 2, 3)] == [False, False, True]
    layer, exact, _ = loaded(W4Format("gptq", 32, True, 1), LinearSpec("a.b", 1024, (64,)), seed=3)
    for rows in (1, 3):
        x = torch.randn(rows, 1024)
        _close(w4a16_linear(x, *_args(layer)), x.double() @ exact.double().t(), 1e-5)


def test_fma_loop_within_the_h100_issue_budget(tmp_path) -> None:
    """The CUDA-core path's loop at one row, compiled for sm_90 without a GPU and counted by
    `benchmarks/kernel_sass.py --kernels w4a16` (in a process of its own: this one may run the
    interpreter): at most 8.8 thread-instructions a weight byte, what an H100 SM can issue
    while taking its share of 3.35 TB/s (8.5 with triton 3.6, 8.2-8.4 with 3.9)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).parents[1] / "benchmarks" / "kernel_sass.py"
    out_json = tmp_path / "sass.json"
    cmd = [sys.executable, str(script), "--kernels", "w4a16", "--shapes", "o"]
    out = subprocess.run([*cmd, "--json", str(out_json)], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out_json.read_text())["rows"]
    # pick_config's tl.dot config and fma_config's
    assert len(rows) == 2, out.stdout
    fma = [row for row in rows if " fma" in row["kernel"]]
    assert [row["kernel"].endswith(" fma") for row in fma] == [True], out.stdout
    for row in fma:
        assert row["kernel"].startswith("w4a16 o m1 "), out.stdout
        assert row["stack"] == 0, out.stdout  # no spills
        assert 0 < row["per_byte"] <= 8.8, out.stdout


def _kernel_sass(tmp_path, *flags: str, own_cache: bool = False) -> tuple[list[dict], str]:
    """benchmarks/kernel_sass.py's JSON rows and its table for these flags, run in a process
    of its own outside the interpreter (with the Triton on its path). own_cache: compiled
    afresh in a Triton cache of its own, so the PTX's line info names this checkout's files
    (a cached kernel keeps the paths of the tree that first compiled the same source)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if own_cache:
        env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    script = Path(__file__).parents[1] / "benchmarks" / "kernel_sass.py"
    out_json = tmp_path / "sass.json"
    cmd = [sys.executable, str(script), *flags, "--json", str(out_json)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out_json.read_text())["rows"], out.stdout


@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_variant_loads_its_first_weights_before_the_wait(tmp_path, rows: int) -> None:
    """w4a16.pdl_launch's launches of the CUDA-core path (`kernel_sass.py --pdl`: the trigger at
    the start, or after the K loop), compiled for sm_90: the loads before the grid-dependency
    wait (griddepcontrol.wait, ACQBULK in the SASS) are the first step's words (two or more
    128-bit loads), scales and zeros (_fma_step_loads), none of x, and ptxas moved none across
    it (as many LDGs before ACQBULK as PTX loads); the loop is the one without PDL's (as
    long, no more registers as allocated, no spills). The kernels without PDL have no
    wait."""
    flags = ["--kernels", "w4a16", "--shapes", "o", "--pdl", "--rows", str(rows)]
    table, stdout = _kernel_sass(tmp_path, *flags, own_cache=True)
    plain = [row for row in table if row["kernel"].endswith(" fma")]
    pdl = [row for row in table if " fma pdl" in row["kernel"]]
    assert len(plain) == 1 and len(pdl) == 2, stdout
    assert all(row["pre_wait"] is None for row in table if "pdl" not in row["kernel"]), stdout
    for row in pdl:
        loads = row["pre_wait"]
        assert list(loads["ptx"]) == ["_fma_step_loads"], stdout
        assert loads["ptx"]["_fma_step_loads"] >= 3, stdout  # words, scales, zeros
        assert loads["sass"] == loads["ptx"]["_fma_step_loads"], stdout
        assert loads["sass_128"] >= 2, stdout
        # registers are allocated 8 a thread at a time: no fewer programs fit an SM
        assert row["stack"] == 0 and -(-row["regs"] // 8) <= -(-plain[0]["regs"] // 8), stdout
        assert row["loop"] == plain[0]["loop"], stdout


def test_split_reduce_waits_before_it_reads_the_partials(tmp_path) -> None:
    """split_k_reduce_kernel as w4a16_linear launches it with PDL (`kernel_sass.py --kernels
    split_k_reduce --pdl`), plain and gated, compiled for sm_90: its grid-dependency wait
    (griddepcontrol.wait, ACQBULK in the SASS) comes before every load (none in the PTX, no
    LDG in the SASS before it: the partials are the GEMV's, written by the kernel ahead); its
    loop is the one without PDL's, which has no wait."""
    flags = ["--kernels", "split_k_reduce", "--pdl"]
    table, stdout = _kernel_sass(tmp_path, *flags, own_cache=True)
    plain = {row["kernel"]: row for row in table if not row["kernel"].endswith(" pdl")}
    with_pdl = [row for row in table if row["kernel"].endswith(" pdl")]
    assert len(plain) == len(with_pdl) == 2, stdout
    for row in with_pdl:
        base = plain[row["kernel"].removesuffix(" pdl")]
        assert base["pre_wait"] is None, stdout
        assert row["pre_wait"] == {"ptx": {}, "sass": 0, "sass_128": 0, "tma": 0}, stdout
        assert row["loop"] == base["loop"] > 0 and row["stack"] == 0, stdout


class LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's PDL arguments, then runs it."""

    KEYS = ("PDL", "TRIGGER", "LATE", "launch_pdl")

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append({k: v for k, v in kwargs.items() if k in self.KEYS})
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def pdl_on(monkeypatch):
    """PDL on for every device, as on Hopper (the interpreter runs gdc_* as no-ops); yields
    the recorder of w4a16_kernel's launches."""
    from inferx_kernels_cuda import pdl, w4a16

    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    recorder = LaunchRecorder(w4a16.w4a16_kernel)
    monkeypatch.setattr(w4a16, "w4a16_kernel", recorder)
    return recorder


# the CUDA-core path (whose first step's loads precede the wait), splits past K among them,
# and the tl.dot path's GEMV and GEMM
PDL_CONFIGS = {
    "fma-m1": FMA_ROWS["fma-m1"],
    "fma-m4-split16": FMA_SPLITS["m4-split16"],
    "fma-m2-split5": replace(FMA_SPLITS["m4-split5"], block_m=2),
    "gemv-split3": CONFIGS["gemv-split3"],
    "gemm": CONFIGS["gemm"],
}


@interpreted
@pytest.mark.parametrize("config", PDL_CONFIGS)
@pytest.mark.parametrize("name", ["gptq-act-order-g64", "awq-g64"])
def test_pdl_variant_gives_the_same_bits(pdl_on, monkeypatch, name: str, config: str) -> None:
    """On a device with PDL the kernel launches with PDL, triggering the next kernel at its
    start or after its K loop as pdl.gemv_launch says for the rows and the caller's trigger
    (the interpreter's grid dependency control is a no-op), and gives the bits it gives on a
    device without PDL, where it launches with PDL and TRIGGER off (compiled as without
    them): the same loads, only placed around the wait; both within bf16 rounding of the
    exact product. w4a16_linear with a K split: the GEMV triggers at its start and the split
    reduce after it launches with PDL and triggers at its start, giving the
    bits it gives without them; none after act-order's gather."""
    from inferx_kernels_cuda import pdl, w4a16

    reduces = LaunchRecorder(w4a16.split_k_reduce_kernel)
    monkeypatch.setattr(w4a16, "split_k_reduce_kernel", reduces)
    layer, exact, bias = _layer(name)
    cfg = PDL_CONFIGS[config]
    b = layer.bias.to(torch.bfloat16)
    for rows in (1, 3) if cfg.block_m < 16 else (2, 20):
        x = torch.randn(rows, SPEC.in_features, generator=torch.Generator().manual_seed(rows))
        x = x.to(torch.bfloat16)
        # past 16 rows an act-order x is gathered by a torch kernel first: no PDL arguments
        gathered = layer.perm is not None and rows > 16
        monkeypatch.setattr(pdl, "pdl_enabled", lambda device: False)  # a device without PDL
        del pdl_on.launches[:], reduces.launches[:]
        base_parts = w4a16_linear_parts(x, *_args(layer), bias=b, config=cfg)
        base = w4a16_linear(x, *_args(layer), bias=b, config=cfg)
        off = {} if gathered else {"PDL": False, "TRIGGER": False}
        assert pdl_on.launches == [off, off], pdl_on.launches
        assert reduces.launches == ([{}] if cfg.split_k > 1 else []), reduces.launches
        monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
        for trigger in (False, True):
            del pdl_on.launches[:]
            got = w4a16_linear_parts(x, *_args(layer), bias=b, config=cfg, trigger=trigger)
            assert torch.equal(got, base_parts), (rows, trigger)
            (launch,) = pdl_on.launches
            want = {"PDL": True, "launch_pdl": True, "TRIGGER": trigger or rows in range(2, 17)}
            want |= {} if want["TRIGGER"] else {"LATE": True}
            assert launch == ({} if gathered else want), launch
        del pdl_on.launches[:], reduces.launches[:]
        linear = w4a16_linear(x, *_args(layer), bias=b, config=cfg)
        assert torch.equal(linear, base)
        if cfg.split_k > 1:
            chained = {} if gathered else {"PDL": True, "TRIGGER": True, "launch_pdl": True}
            assert pdl_on.launches == reduces.launches == [chained], reduces.launches
        ref = x.double() @ exact.double().t() + b.double()
        _close(got.float().sum(0), ref, 2.0**-6)
        _close(linear, ref, 2.0**-6)


@pytest.mark.parametrize("rows", [1, 4])
def test_row_group_variant_compiles_for_sm90_without_spills(tmp_path, rows: int) -> None:
    """ROW_GROUP (an act-order K slice) compiled for sm_90 without a GPU by
    `benchmarks/kernel_sass.py --row-group` (a process of its own, as above): the tl.dot
    config and the CUDA-core one, neither spilling. Its loop is
    longer than the plain one's (a scale and zero gathered and converted per weight: 22 a
    byte at one row, triton 3.6), which is the price of a row's own group."""
    flags = ("--kernels", "w4a16", "--shapes", "o", "--row-group", "--rows", str(rows))
    found, stdout = _kernel_sass(tmp_path, *flags)
    assert "row groups True" in stdout, stdout
    assert len(found) == 2, stdout
    for row in found:
        assert row["stack"] == 0 and 0 < row["regs"] <= 255, stdout
        assert row["loop"] > 0, stdout


def test_bad_inputs_are_refused() -> None:
    layer, _, _ = _layer("awq-g64")
    with pytest.raises(ValueError, match="x must be"):
        w4a16_linear(torch.randn(2, 256).t(), *_args(layer))
    with pytest.raises(ValueError, match=r"qweight must be int32 \[16, N\]"):
        w4a16_linear(torch.randn(2, 128), *_args(layer))


@interpreted
def test_the_layer_reaches_the_kernel_on_cuda(monkeypatch) -> None:
    """W4A16Linear's forward, forward_parts and forward_split call the kernel where x is on a
    CUDA device (here: the interpreter, with is_cuda faked) and give the reference's result."""
    import inferx_quant.w4a16 as w4

    layer, exact, bias = _layer("gptq-act-order-g64")
    x = torch.randn(4, 256)
    want = x.double() @ exact.double().t() + bias.double()
    calls = []

    def kernels(x):
        calls.append(x.shape)
        from inferx_kernels_cuda import w4a16

        return w4a16

    monkeypatch.setattr(layer, "_kernels", kernels)
    _close(layer(x), want, 1e-5)
    _close(layer.forward_parts(x).sum(0), want, 1e-5)
    parts, b = layer.forward_split(x)
    _close(parts.sum(0) + b, want, 1e-5)
    assert len(calls) == 3
    assert w4._cuda_kernels() is not None  # triton is installed here


# (N, K) of Llama-3.1-8B's decode GEMMs: fused QKV, o_proj, fused gate_up, down_proj.
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@interpreted
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_split_act_order_layer_reaches_the_row_group_kernel(monkeypatch, ranks: int) -> None:
    """A row-parallel act-order layer over 2 and 4 ranks on "CUDA" (the interpreter, is_cuda
    faked): each rank's forward, forward_parts and forward_split run the kernel with its
    row_group, and the ranks' results summed are the whole layer's within 1e-5, at 3 rows
    (the CUDA-core path) and 20 (tl.dot, x permuted first)."""
    from test_w4a16 import split_along_k

    from inferx_kernels_cuda import w4a16

    fmt, kw = CASES["gptq-asym-act-order"]
    whole, exact, shards = split_along_k(fmt, 256, ranks, seed=4, **kw)
    calls = []

    def kernels(x):
        calls.append(x.shape)
        return w4a16

    for r in shards:
        assert r.row_group is not None
        monkeypatch.setattr(r, "_kernels", kernels)
    k = 256 // ranks
    for rows in (3, 20):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ exact.double().t() + whole.bias.double()
        xs = [x[:, i * k : (i + 1) * k] for i in range(ranks)]
        _close(sum(r(xi) for r, xi in zip(shards, xs, strict=True)), want, 1e-5)
        parts = [r.forward_parts(xi).sum(0) for r, xi in zip(shards, xs, strict=True)]
        _close(sum(parts), want, 1e-5)
        split = [r.forward_split(xi) for r, xi in zip(shards, xs, strict=True)]
        _close(sum(p.sum(0) + (b if b is not None else 0) for p, b in split), want, 1e-5)
    assert len(calls) == 2 * 3 * ranks


def random_weights(n: int, k: int, group: int, act_order: bool, device: torch.device):
    """Random kernel operands of an [N, K] layer (random words, scales about 2^-7, zeros in
    0..15, a random perm for act-order) -> (args for w4a16_linear, the exact fp32 [N, K])."""
    from inferx_quant.w4a16 import unpack_rows

    gen = torch.Generator(device=device).manual_seed(0)
    info = torch.iinfo(torch.int32)
    qweight = torch.randint(info.min, info.max, (k // 8, n), generator=gen, device=device)
    qweight = qweight.to(torch.int32)
    scales = (torch.rand(k // group, n, generator=gen, device=device) * 2**-6).half()
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, device=device).to(torch.uint8)
    perm = None
    if act_order:
        perm = torch.randperm(k, generator=gen, device=device).to(torch.int32)
    rows = torch.arange(k, device=device) // group
    w = (unpack_rows(qweight).float() - zeros.float()[rows]) * scales.float()[rows]
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm.long(), w)
    return (qweight, scales, zeros, group, perm), w.t()


@interpreted
def test_random_weights_are_the_layers_own() -> None:
    """random_weights' exact weight is the one W4A16Linear.dequantized_weight reads."""
    args, exact = random_weights(24, 128, 32, True, torch.device("cpu"))
    x = torch.randn(3, 128)
    _close(w4a16_linear(x, *args, config=CONFIGS["gemv"]), x.double() @ exact.double().t(), 1e-5)


def k_slice(n: int, k_whole: int, group: int, ranks: int, rank: int, device, seed: int = 0):
    """One rank's share of an act-order layer split along K (a row-parallel layer over `ranks`
    ranks), written here from the definitions: random nibbles, zeros and scales of either sign,
    a random act-order g_idx (each group `group` rows in a random order); the rank's rows
    [k0, k0 + k) sorted by group, row_group their groups counted from the first they touch.
    -> (args for w4a16_linear, row_group, the exact float32 [N, k] of the slice)."""
    gen = torch.Generator().manual_seed(seed)
    groups = k_whole // group
    q = torch.randint(0, 16, (k_whole, n), generator=gen)
    sign = torch.randint(0, 2, (groups, n), generator=gen) * 2 - 1
    scales = ((torch.rand(groups, n, generator=gen) * 7 + 1) / 512 * sign).half()
    zeros = torch.randint(0, 16, (groups, n), generator=gen)
    g_idx = torch.empty(k_whole, dtype=torch.int64)
    g_idx[torch.randperm(k_whole, generator=gen)] = torch.arange(k_whole) // group
    exact = (q - zeros[g_idx]).float() * scales.float()[g_idx]  # [K, N], input order
    k = k_whole // ranks
    rows = slice(rank * k, rank * k + k)
    perm = torch.argsort(g_idx[rows], stable=True)
    row_group = g_idx[rows][perm]
    lo, hi = int(row_group[0]), int(row_group[-1])
    args = (
        pack_rows(q[rows][perm].to(torch.uint8)).to(device),
        scales[lo : hi + 1].contiguous().to(device),
        zeros[lo : hi + 1].to(torch.uint8).contiguous().to(device),
        group,
        perm.to(torch.int32).to(device),
    )
    return args, (row_group - lo).to(torch.int32).to(device), exact[rows].t().to(device)


# (N, K whole, group, ranks, rank): slices in whole groups and across them (384 / 4 = 96 rows
# of groups of 128), ragged N, per-group rows from 2 to 64
K_SLICES = [(96, 256, 64, 2, 1), (64, 384, 128, 4, 2), (24, 512, 32, 4, 3), (72, 256, 32, 8, 5)]
ROW_GROUP_CONFIGS = {
    "fma-m1": W4Config(block_m=1, split_k=1, use_dot=False, **SMALL),
    "fma-m2-split3": W4Config(block_m=2, split_k=3, use_dot=False, **SMALL),
    "fma-m4-split2": W4Config(block_m=4, split_k=2, use_dot=False, **SMALL),
    "fma-m4": W4Config(block_m=4, split_k=1, use_dot=False, **SMALL),
    "gemv-split3": CONFIGS["gemv-split3"],
    "gemv-dup-loads": CONFIGS["gemv-split3-dup-loads"],
    "gemm": CONFIGS["gemm"],
    "default": None,
}


@interpreted
@pytest.mark.parametrize("config", ROW_GROUP_CONFIGS)
@pytest.mark.parametrize("shape", K_SLICES, ids=lambda s: "n{}-k{}-g{}-tp{}-r{}".format(*s))
def test_row_groups_match_the_exact_slice(shape: tuple[int, ...], config: str) -> None:
    """ROW_GROUP (row_group given): an act-order K slice, whose kernel rows take their scales
    and zeros from row_group, against float64 x @ W_exact.T of the slice, 1-20 rows, on the
    CUDA-core path (K splits) and the tl.dot path (split-K GEMV,
    the tiled GEMM, which permutes x first past 16 rows): within 1e-5 of the output's scale in
    fp32; the partials summed too."""
    args, row_group, exact = k_slice(*shape, torch.device("cpu"), seed=sum(shape))
    cfg = ROW_GROUP_CONFIGS[config]
    k = exact.shape[1]
    for rows in (1, 2, 3, 4, 7, 16, 20):
        if cfg is not None and not cfg.use_dot and rows > 4 and rows != 7:
            continue  # the CUDA-core path's rows: 1-4, and 7 in blocks of block_m
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        want = x.double() @ exact.double().t()
        got = w4a16_linear(x, *args, config=cfg, row_group=row_group)
        _close(got, want, 1e-5)
        parts = w4a16_linear_parts(x, *args, config=cfg, row_group=row_group)
        _close(parts.sum(0), want, 1e-5)


@interpreted
def test_row_groups_are_the_kernel_contract() -> None:
    """row_group is read as given: rows in any order and groups in any order (the layer sorts
    them only for the cache), with or without perm; a wrong row_group gives another result."""
    args, row_group, exact = k_slice(48, 256, 32, 2, 0, torch.device("cpu"), seed=3)
    qweight, scales, zeros, group, perm = args
    x = torch.randn(3, 128)
    shuffle = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    # the kernel rows shuffled, their perm and row_group alike: the same product
    q = unpack_rows(qweight)[shuffle]
    shuffled = (pack_rows(q), scales, zeros, group, perm[shuffle].contiguous())
    cfg = ROW_GROUP_CONFIGS["fma-m4-split2"]
    for config in (cfg, CONFIGS["gemv-split3"]):
        got = w4a16_linear(x, *shuffled, config=config, row_group=row_group[shuffle].contiguous())
        _close(got, x.double() @ exact.double().t(), 1e-5)
    # in input order (no perm): x's columns as they are
    order = torch.argsort(perm.long())
    plain = (pack_rows(unpack_rows(qweight)[order]), scales, zeros, group, None)
    got = w4a16_linear(x, *plain, config=cfg, row_group=row_group[order].contiguous())
    _close(got, x.double() @ exact.double().t(), 1e-5)
    # each row in the next group over (mod G): not the slice's product
    wrong = ((row_group + 1) % scales.shape[0]).to(torch.int32)
    got = w4a16_linear(x, *args, config=cfg, row_group=wrong)
    err = (got.double() - x.double() @ exact.double().t()).abs().max()
    assert err > 1e-3 * got.abs().max()
    with pytest.raises(ValueError, match=r"row_group must be int32 \[128\]"):
        w4a16_linear(x, *args, row_group=row_group[:64])


# (N, K) of Llama-3.1-8B's decode GEMMs: fused QKV, o_proj, fused gate_up, down_proj.
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


# (N, K) of Qwen2.5-3B's: fused QKV, o_proj, fused gate_up, down_proj.
QWEN_3B = [(2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)]


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("shape", QWEN_3B)
@pytest.mark.parametrize("act_order", [False, True])
def test_fma_path_on_the_gpu(shape: tuple[int, int], rows: int, act_order: bool) -> None:
    """The CUDA-core path at its benchmark config, bf16 x at the 3B shapes: the weights are
    exact there, so within 2^-7 of the output's scale of float64 over the exact weights (the
    output's one rounding to bf16); the partials, each rounded to bf16, within 2^-6."""
    n, k = shape
    args, exact = random_weights(n, k, 128, act_order, torch.device("cuda"))
    x = torch.randn(rows, k, device="cuda").bfloat16()
    want = x.double() @ exact.double().t()
    cfg = fma_config(rows, n, k)
    _close(w4a16_linear(x, *args, config=cfg), want, 2.0**-7)
    _close(w4a16_linear_parts(x, *args, config=cfg).float().sum(0), want, 2.0**-6)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_gated_on_the_gpu(rows: int) -> None:
    """Qwen2.5-3B's gate_up (2 x 11008 outputs, K 2048), bf16, the default config: gated=True
    bit for bit TritonOps.silu_and_mul of the plain call's output (the same sums, rounded to
    bf16, then the same SiLU arithmetic)."""
    from inferx_kernels_cuda.ops import TritonOps

    args, _ = random_weights(2 * 11008, 2048, 128, False, torch.device("cuda"))
    x = torch.randn(rows, 2048, device="cuda").bfloat16()
    want = TritonOps().silu_and_mul(w4a16_linear(x, *args))
    got = w4a16_linear(x, *args, gated=True)
    assert got.shape == (rows, 11008)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 64, 256])
@pytest.mark.parametrize("shape", LLAMA_8B)
@pytest.mark.parametrize("act_order", [False, True])
def test_model_shapes_on_the_gpu(shape: tuple[int, int], rows: int, act_order: bool) -> None:
    """bf16 at the 8B shapes, group 128: within 2^-7 of the output's scale of float64 over the
    weights rounded to bf16 (the kernel's one rounding of each weight); the partials, each
    rounded to bf16, within 2^-6."""
    n, k = shape
    args, exact = random_weights(n, k, 128, act_order, torch.device("cuda"))
    x = torch.randn(rows, k, device="cuda").bfloat16()
    want = x.double() @ exact.bfloat16().double().t()
    _close(w4a16_linear(x, *args), want, 2.0**-7)
    _close(w4a16_linear_parts(x, *args).float().sum(0), want, 2.0**-6)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("shape", [(2048, 2048), (2048, 11008)], ids=["o", "down"])
def test_row_groups_on_the_gpu(shape: tuple[int, int], ranks: int, rows: int) -> None:
    """The last rank's act-order K slice of Qwen2.5-3B's o_proj and down_proj (group 128;
    down's 11008 / 4 cuts groups), bf16 x, the default config: within 2^-7 of the output's
    scale of float64 over the exact weights (the CUDA-core path, up to FMA_ROWS rows) or over
    them rounded to bf16 (tl.dot's operand)."""
    from inferx_kernels_cuda.w4a16 import FMA_ROWS

    n, k_whole = shape
    args, row_group, exact = k_slice(n, k_whole, 128, ranks, ranks - 1, torch.device("cuda"))
    x = torch.randn(rows, k_whole // ranks, device="cuda").bfloat16()
    weights = exact if rows <= FMA_ROWS else exact.bfloat16()
    _close(w4a16_linear(x, *args, row_group=row_group), x.double() @ weights.double().t(), 2.0**-7)
