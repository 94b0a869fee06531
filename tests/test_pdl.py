"""Programmatic dependent launch of the decode GEMVs (inferx_kernels_cuda.pdl): when it is on,
and that a GEMV launched with it still reads what the kernels before it wrote, inside a CUDA
graph replayed on fresh inputs (with and without GEMVs letting the next GEMV launch early)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the triton package is not installed")

from conftest import on_gpu  # noqa: E402

from inferx_core.ops_torch import TorchOps  # noqa: E402
from inferx_kernels_cuda import pdl  # noqa: E402
from inferx_kernels_cuda.ops import TritonOps  # noqa: E402
from inferx_kernels_cuda.tma_gemv import (  # noqa: E402
    norm_config,
    tma_linear_parts,
    tma_norm_linear,
)


@pytest.fixture
def pdl_env(monkeypatch: pytest.MonkeyPatch):
    """Set pdl's CHAIN_ROWS and ALL_ROWS (None: the default) for one test; the enabled check is
    read afresh."""

    defaults = {"CHAIN_ROWS": pdl.CHAIN_ROWS, "ALL_ROWS": pdl.ALL_ROWS}

    def set_rows(chain: tuple | None = None, all_: tuple | None = None) -> None:
        for name, value in (("CHAIN_ROWS", chain), ("ALL_ROWS", all_)):
            monkeypatch.setattr(pdl, name, defaults[name] if value is None else value)
        pdl._enabled.cache_clear()

    yield set_rows
    monkeypatch.undo()
    pdl._enabled.cache_clear()


def test_off_on_the_cpu(pdl_env) -> None:
    pdl_env()
    cpu = torch.device("cpu")
    assert not pdl.pdl_enabled(cpu)
    off = {"PDL": False, "TRIGGER": False}
    assert pdl.gemv_launch(cpu, 1) == off and pdl.between_launch(cpu, 1, 2048) == off


def test_in_ranges() -> None:
    assert not pdl.in_ranges(1, ())
    assert pdl.in_ranges(1 << 20, ((1, 1 << 30),))
    assert [pdl.in_ranges(m, ((5, 8), (33, 64))) for m in (4, 5, 8, 9, 33, 64, 65)] == [
        False,
        True,
        True,
        False,
        True,
        True,
        False,
    ]


@pytest.mark.gpu
@on_gpu
def test_on_for_hopper(pdl_env) -> None:
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    pdl_env()  # (and clears the enabled check's cache)
    off = {"PDL": False, "TRIGGER": False}
    assert pdl.pdl_enabled(dev) == hopper
    # the defaults: at one row a GEMV that does not trigger at its start triggers late
    late = {"PDL": True, "TRIGGER": False, "launch_pdl": True, "LATE": True}
    assert pdl.gemv_launch(dev, 1) == (late if hopper else off)
    assert pdl.between_launch(dev, 1, 2048) == ({"PDL": False, "TRIGGER": True} if hopper else off)
    # the defaults: ALL at 2-16 for layers up to 2048 wide, the chain at 33-64
    assert not pdl.between_launch(dev, 8, 4096)["PDL"]
    assert [pdl.between_launch(dev, m, 2048)["PDL"] for m in (1, 2, 16, 17)] == [
        False,
        *[hopper] * 2,
        False,
    ]
    assert [pdl.gemv_launch(dev, m)["TRIGGER"] for m in (1, 8, 32, 33, 64, 65)] == [
        False,
        hopper,
        False,
        hopper,
        hopper,
        False,
    ]
    every = ((1, 1 << 30),)
    pdl_env(every)
    assert pdl.gemv_launch(dev, 1)["TRIGGER"] == hopper
    assert not pdl.between_launch(dev, 1, 2048)["PDL"]
    pdl_env(((5, 8), (33, 64)), ())
    assert (
        [pdl.gemv_launch(dev, m)["TRIGGER"] for m in (1, 4, 5, 8, 9, 32, 33, 64)]
        == [False, False, True, True, False, False, True, True]
        if hopper
        else [False] * 8
    )
    pdl_env(None, every)
    assert pdl.gemv_launch(dev, 1)["TRIGGER"] == hopper
    assert pdl.between_launch(dev, 1, 2048) == (
        {"PDL": True, "TRIGGER": True, "launch_pdl": True} if hopper else off
    )
    pdl_env(None, ((2, 16),))
    assert [pdl.between_launch(dev, m, 2048)["PDL"] for m in (1, 2, 16, 17)] == [
        False,
        *[hopper] * 2,
        False,
    ]
    assert [pdl.gemv_launch(dev, m)["TRIGGER"] for m in (1, 2, 16, 17)] == [
        False,
        *[hopper] * 2,
        False,
    ]


@pytest.mark.parametrize(
    ("rows", "early"), [("ATTENTION_ROWS", "attention_early"), ("NORM_ROWS", "norm_early")]
)
def test_single_edge_rows(pdl_env, monkeypatch: pytest.MonkeyPatch, rows: str, early: str) -> None:
    """The single-edge settings: 1-48 rows by default; row ranges; never on the CPU."""
    pdl_env()
    assert getattr(pdl, rows) == ((1, 48),)
    monkeypatch.setattr(pdl, rows, ((1, 4),))
    assert not getattr(pdl, early)(torch.device("cpu"), 1)
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    assert [getattr(pdl, early)(torch.device("cpu"), m) for m in (1, 4, 5)] == [
        True,
        True,
        False,
    ]
    monkeypatch.setattr(pdl, rows, ())
    assert not getattr(pdl, early)(torch.device("cpu"), 1)


def test_late_trigger_only_where_a_gemv_does_not_trigger_at_its_start(
    pdl_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LATE_ROWS (1-64 by default): a GEMV at its rows triggers after its K loop (LATE), but
    only where it would not trigger at its start already (the chain, ALL, a caller's edge);
    the LATE key is left out elsewhere and where it takes no rows."""
    pdl_env()
    assert pdl.LATE_ROWS == ((1, 64),)
    monkeypatch.setattr(pdl, "LATE_ROWS", ())
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    dev = torch.device("cpu")
    assert pdl.gemv_launch(dev, 1) == {"PDL": True, "TRIGGER": False, "launch_pdl": True}
    monkeypatch.setattr(pdl, "LATE_ROWS", ((1, 64),))
    assert pdl.gemv_launch(dev, 1) == {
        "PDL": True,
        "TRIGGER": False,
        "launch_pdl": True,
        "LATE": True,
    }
    assert "LATE" not in pdl.gemv_launch(dev, 1, trigger=True)  # QKV into an early decode
    assert "LATE" not in pdl.gemv_launch(dev, 8)  # ALL (2-16): it triggers at its start
    assert pdl.gemv_launch(dev, 20).get("LATE")
    assert "LATE" not in pdl.gemv_launch(dev, 40)  # the chain (33-64)
    assert "LATE" not in pdl.gemv_launch(dev, 65)  # past the setting's rows


@pytest.mark.gpu
@on_gpu
def test_attention_early_on_hopper(pdl_env, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    pdl_env()
    monkeypatch.setattr(pdl, "ATTENTION_ROWS", ((1, 4),))
    assert [pdl.attention_early(dev, m) for m in (1, 4, 5)] == [hopper, hopper, False]
    assert pdl.gemv_launch(dev, 1, trigger=True)["TRIGGER"] == hopper


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("mode", ["default", "chain", "all", "norm", "late"])
@pytest.mark.parametrize("rows", [1, 8])
def test_gemvs_wait_for_their_producers_inside_a_graph(
    pdl_env, monkeypatch: pytest.MonkeyPatch, mode: str, rows: int
) -> None:
    """A decode layer's chain at the 3B's widths: a slow cuBLAS GEMM writes y; add + RMSNorm
    (TRIGGER) reads it; the QKV-like GEMV (PDL) the norm's output; the norm + gate_up + SiLU GEMV
    (PDL) those parts and the residual; the down GEMV (PDL) its output; a last RMSNorm that.
    "chain": each GEMV also lets the next kernel launch early; "all": that, and the norms launch
    with PDL too; "norm" (NORM_ROWS): the down GEMV triggers and the last norm launches
    with PDL; "late" (LATE_ROWS, ALL off): the GEMVs that do not trigger at their start
    trigger after their K loop. Each replay's inputs are fresh: a kernel that ran ahead of its
    producer would read the last replay's values."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA GEMVs and PDL need Hopper")
    every = ((1, 1 << 30),)
    all_ = {"all": every, "late": ()}.get(mode)
    pdl_env(every if mode == "chain" else None, all_)
    if mode == "late":
        monkeypatch.setattr(pdl, "LATE_ROWS", ((1, 64),))
        assert pdl.gemv_launch(torch.device("cuda"), rows).get("LATE")
    if mode == "norm":
        monkeypatch.setattr(pdl, "NORM_ROWS", ((1, 64),))
        assert pdl.norm_early(torch.device("cuda"), rows)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, inter, eps = 2048, 11008, 1e-6
    g = torch.Generator(device=dev).manual_seed(7)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(bf16)

    a = torch.empty(rows, 8192, device=dev, dtype=bf16)
    b = rand(8192, hidden, scale=8192**-0.5)
    residual = torch.empty(rows, hidden, device=dev, dtype=bf16)
    norm_w = (torch.rand(hidden, generator=g, device=dev) + 0.5).to(bf16)
    w_qkv = rand(2560, hidden, scale=hidden**-0.5)
    w_gate_up = rand(2 * inter, 2560, scale=2560**-0.5)
    w_down = rand(hidden, inter, scale=inter**-0.5)
    ops, ref = TritonOps(), TorchOps()
    assert pdl.between_launch(dev, rows, 2048)["TRIGGER"] and pdl.gemv_launch(dev, rows)["PDL"]

    def step() -> tuple[torch.Tensor, ...]:
        y = a @ b
        normed, summed = ops.rms_norm(y, norm_w, eps, residual)
        qkv = tma_linear_parts(normed, w_qkv, parts=2)
        act, new_res = tma_norm_linear(
            qkv,
            torch.zeros_like(qkv[0]),
            norm_w.new_ones(2560),
            eps,
            w_gate_up,
            1,
            True,
            norm_config(rows, 1, gated=True),
        )
        down = tma_linear_parts(act, w_down, 1, None, pdl.norm_early(dev, rows))
        final = ops.rms_norm(down[0], norm_w, eps)
        return y, normed, summed, qkv, new_res, act, down, final

    a.normal_(generator=g)
    residual.normal_(generator=g)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(4):
        a.normal_(generator=g)
        residual.normal_(generator=g)
        graph.replay()
        torch.cuda.synchronize()
        y, normed, summed, qkv, new_res, act, down, final = outs
        torch.testing.assert_close(y, a @ b, rtol=0, atol=0)
        want_normed, want_summed = ref.rms_norm(y, norm_w, eps, residual)
        torch.testing.assert_close(summed, want_summed, rtol=0, atol=0)
        torch.testing.assert_close(normed, want_normed, rtol=1.6e-2, atol=1e-2)
        # Each GEMV against float32 products of the inputs the graph itself held: a stale
        # read of the last replay's values would be off by O(1).
        want_qkv = F.linear(normed.float(), w_qkv.float())
        torch.testing.assert_close(qkv.float().sum(0), want_qkv, rtol=2e-2, atol=2e-2)
        h = qkv.float().sum(0).to(bf16).float()
        torch.testing.assert_close(new_res.float(), h, rtol=1e-2, atol=1e-2)
        inv_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        gate_up = F.linear(h * inv_rms, w_gate_up.float())
        want_act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        torch.testing.assert_close(act.float(), want_act, rtol=3e-2, atol=3e-2)
        want_down = F.linear(act.float(), w_down.float())
        torch.testing.assert_close(down[0].float(), want_down, rtol=2e-2, atol=2e-2)
        want_final = ref.rms_norm(down[0], norm_w, eps)
        torch.testing.assert_close(final, want_final, rtol=1.6e-2, atol=1e-2)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_fp8_chain_waits_for_its_producers_inside_a_graph(pdl_env, rows: int) -> None:
    """The FP8 W8A8 decode chain at the 3B's widths as TritonOps and Fp8Linear launch it with
    PDL: a slow cuBLAS GEMM writes y; add + RMSNorm + e4m3 quantization (PDL, TRIGGER) reads
    it; the FP8 TMA GEMV (PDL, triggering the next) its rows; quantize_rows (TRIGGER) their
    sum; a gate_up-wide FP8 GEMV (PDL) those; SiLU-and-mul + quantization (TRIGGER) its
    output; the down GEMV (PDL) that. Each replay's inputs are fresh, and each stage is held to
    float32 products of what the graph itself held: a stale read would be off by O(1)."""
    from inferx_core.interfaces.quant import ActivationQuant
    from inferx_kernels_cuda.fp8_gemm import fp8_scaled_linear, quantize_rows

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA GEMVs and PDL need Hopper")
    pdl_env()
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, inter, eps = 2048, 11008, 1e-6
    g = torch.Generator(device=dev).manual_seed(9)

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w8, scale = quantize_rows((torch.randn(n, k, generator=g, device=dev) * k**-0.5).to(bf16))
        return w8, scale.reshape(-1)

    a = torch.empty(rows, 8192, device=dev, dtype=bf16)
    b = (torch.randn(8192, hidden, generator=g, device=dev) * 8192**-0.5).to(bf16)
    residual = torch.empty(rows, hidden, device=dev, dtype=bf16)
    norm_w = (torch.rand(hidden, generator=g, device=dev) + 0.5).to(bf16)
    (w_qkv, s_qkv), (w_gu, s_gu), (w_down, s_down) = (
        weight(2560, hidden), weight(2 * inter, 2560), weight(hidden, inter)
    )  # fmt: skip
    ops, spec = TritonOps(), ActivationQuant("token")
    assert pdl.between_launch(dev, rows, hidden, norm=True)["PDL"]

    def dq(q) -> torch.Tensor:  # a QuantizedActivation or (e4m3, scale) as float32
        data, scale = (q.data, q.scale) if hasattr(q, "data") else q
        return data.float() * scale

    def step() -> tuple:
        y = a @ b
        normed, _ = ops.rms_norm_quant(y, norm_w, eps, spec, residual)
        qkv = fp8_scaled_linear(normed.data, normed.scale, w_qkv, s_qkv, None, bf16,
                                parts=True, trigger=True)  # fmt: skip
        h = quantize_rows(qkv.sum(0), trigger=True)
        gate_up = fp8_scaled_linear(*h, w_gu, s_gu, None, bf16)
        act = ops.silu_and_mul_quant(gate_up, spec)
        down = fp8_scaled_linear(act.data, act.scale, w_down, s_down, None, bf16, parts=True)
        return y, normed, qkv, h, gate_up, act, down

    a.normal_(generator=g)
    residual.normal_(generator=g)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(4):
        a.normal_(generator=g)
        residual.normal_(generator=g)
        graph.replay()
        torch.cuda.synchronize()
        y, normed, qkv, h, gate_up, act, down = outs
        torch.testing.assert_close(y, a @ b, rtol=0, atol=0)
        want_normed, _ = TorchOps().rms_norm(y, norm_w, eps, residual)
        torch.testing.assert_close(dq(normed), want_normed.float(), rtol=7e-2, atol=7e-2)
        for got, x, w, s in (
            (qkv.float().sum(0), dq(normed), w_qkv, s_qkv),
            (gate_up.float(), dq(h), w_gu, s_gu),
            (down.float().sum(0), dq(act), w_down, s_down),
        ):
            want = F.linear(x, w.float() * s[:, None])
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        g_, u = gate_up.float().chunk(2, dim=-1)
        torch.testing.assert_close(dq(act), F.silu(g_) * u, rtol=7e-2, atol=7e-2)
