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
    """Set INFERX_PDL, INFERX_PDL_CHAIN, INFERX_PDL_ALL (None: unset) for one test; read afresh."""

    def setenv(on: str | None, chain: str | None = None, all_: str | None = None) -> None:
        names = ("INFERX_PDL", "INFERX_PDL_CHAIN", "INFERX_PDL_ALL")
        for name, value in zip(names, (on, chain, all_), strict=True):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        clear()

    def clear() -> None:
        for setting in (
            pdl._enabled,
            pdl._chain_rows,
            pdl._all_rows,
            pdl._attention_rows,
            pdl._norm_rows,
            pdl._late_rows,
            pdl._chain,
            pdl._all,
        ):
            setting.cache_clear()

    yield setenv
    monkeypatch.undo()
    clear()


def test_off_on_the_cpu(pdl_env) -> None:
    pdl_env(None)
    cpu = torch.device("cpu")
    assert not pdl.pdl_enabled(cpu)
    off = {"PDL": False, "TRIGGER": False}
    assert pdl.gemv_launch(cpu, 1) == off and pdl.between_launch(cpu, 1, 2048) == off


@pytest.mark.parametrize(
    ("value", "rows"),
    [
        ("0", ()),
        ("", ()),
        ("1", ((1, 1 << 30),)),
        ("5-8", ((5, 8),)),
        ("5-8,33-64", ((5, 8), (33, 64))),
        ("8", ((8, 8),)),
    ],
)
def test_row_range_settings(pdl_env, value: str, rows: tuple) -> None:
    pdl_env("1", value, value)
    assert pdl._chain_rows() == rows and pdl._all_rows() == rows


@pytest.mark.parametrize("value", ["8-5", "0-4", "a-b", "1,", "2-"])
def test_row_range_settings_are_checked(pdl_env, value: str) -> None:
    pdl_env("1", value, value)
    with pytest.raises(ValueError, match="INFERX_PDL_CHAIN"):
        pdl._chain_rows()
    with pytest.raises(ValueError, match="INFERX_PDL_ALL"):
        pdl._all_rows()


@pytest.mark.gpu
@on_gpu
def test_on_for_hopper_unless_switched_off(pdl_env, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    monkeypatch.delenv("INFERX_PDL_LATE", raising=False)  # the defaults, whatever the shell set
    pdl_env(None)  # (and clears the settings' caches)
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
    pdl_env(None, "1")
    assert pdl.gemv_launch(dev, 1)["TRIGGER"] == hopper
    assert not pdl.between_launch(dev, 1, 2048)["PDL"]
    pdl_env(None, "5-8,33-64", "0")
    assert (
        [pdl.gemv_launch(dev, m)["TRIGGER"] for m in (1, 4, 5, 8, 9, 32, 33, 64)]
        == [False, False, True, True, False, False, True, True]
        if hopper
        else [False] * 8
    )
    pdl_env(None, None, "1")
    assert pdl.gemv_launch(dev, 1)["TRIGGER"] == hopper
    assert pdl.between_launch(dev, 1, 2048) == (
        {"PDL": True, "TRIGGER": True, "launch_pdl": True} if hopper else off
    )
    pdl_env(None, None, "2-16")
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
    pdl_env("0", "1", "1")
    assert not pdl.pdl_enabled(dev)
    assert pdl.gemv_launch(dev, 1) == off and pdl.between_launch(dev, 1, 2048) == off


@pytest.mark.parametrize(
    ("name", "rows", "early"),
    [
        ("INFERX_PDL_ATTENTION", "_attention_rows", "attention_early"),
        ("INFERX_PDL_NORM", "_norm_rows", "norm_early"),
    ],
)
def test_single_edge_rows(
    pdl_env, monkeypatch: pytest.MonkeyPatch, name: str, rows: str, early: str
) -> None:
    """The single-edge settings: 1-48 rows by default; row ranges; checked; never on the CPU."""
    setting = getattr(pdl, rows)
    monkeypatch.delenv(name, raising=False)
    pdl_env("1")
    assert setting() == ((1, 48),)
    monkeypatch.setenv(name, "0")
    setting.cache_clear()
    assert setting() == ()
    monkeypatch.setenv(name, "1-4")
    setting.cache_clear()
    assert setting() == ((1, 4),)
    assert not getattr(pdl, early)(torch.device("cpu"), 1)
    monkeypatch.setenv(name, "4-")
    setting.cache_clear()
    with pytest.raises(ValueError, match=name):
        setting()
    setting.cache_clear()


def test_late_trigger_only_where_a_gemv_does_not_trigger_at_its_start(
    pdl_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """INFERX_PDL_LATE (1-64 by default): a GEMV at its rows triggers after its K loop (LATE),
    but only where it would not trigger at its start already (the chain, ALL, a caller's
    edge); the LATE key is left out elsewhere and where it is "0"."""
    pdl_env("1")
    monkeypatch.setenv("INFERX_PDL_LATE", "0")
    pdl._late_rows.cache_clear()
    monkeypatch.setattr(pdl, "pdl_enabled", lambda device: True)
    dev = torch.device("cpu")
    assert pdl.gemv_launch(dev, 1) == {"PDL": True, "TRIGGER": False, "launch_pdl": True}
    monkeypatch.delenv("INFERX_PDL_LATE")
    pdl._late_rows.cache_clear()
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
    monkeypatch.setenv("INFERX_PDL_LATE", "9-")
    pdl._late_rows.cache_clear()
    with pytest.raises(ValueError, match="INFERX_PDL_LATE"):
        pdl._late_rows()


@pytest.mark.gpu
@on_gpu
def test_attention_early_on_hopper(pdl_env, monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    pdl_env(None)
    monkeypatch.setenv("INFERX_PDL_ATTENTION", "1-4")
    pdl._attention_rows.cache_clear()
    assert [pdl.attention_early(dev, m) for m in (1, 4, 5)] == [hopper, hopper, False]
    assert pdl.gemv_launch(dev, 1, trigger=True)["TRIGGER"] == hopper
    pdl._attention_rows.cache_clear()


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
    with PDL too; "norm" (INFERX_PDL_NORM): the down GEMV triggers and the last norm launches
    with PDL; "late" (INFERX_PDL_LATE, ALL off): the GEMVs that do not trigger at their start
    trigger after their K loop. Each replay's inputs are fresh: a kernel that ran ahead of its
    producer would read the last replay's values."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA GEMVs and PDL need Hopper")
    all_ = {"all": "1", "late": "0"}.get(mode)
    pdl_env("1", "1" if mode == "chain" else None, all_)
    if mode == "late":
        monkeypatch.setenv("INFERX_PDL_LATE", "1-64")
        pdl._late_rows.cache_clear()
        assert pdl.gemv_launch(torch.device("cuda"), rows).get("LATE")
    if mode == "norm":
        monkeypatch.setenv("INFERX_PDL_NORM", "1-64")
        pdl._norm_rows.cache_clear()
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
